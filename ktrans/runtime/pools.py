"""Engine-owned per-request memory: a paged KV cache for the full-attention layers and a slot pool of
Gated DeltaNet states (conv window and recurrent matrix) for the linear-attention layers.

Modules never hold per-request state; they read and write these tensors at the rows a ForwardBatch names.
Which pages and slots are in use, and by whom, is the engine's CacheManager (`ktrans/engine/cache.py`): these
classes hold only the tensors.

A model split over several devices (layers 0-23 on cuda:0, 24-47 on cuda:1) has one pool per device, each holding
only the layers placed there (`layers=`), gathered in a SplitKVPool / SplitStatePool that the batch carries as if
it were one pool: `layer(i)` answers from the part holding layer i. Page and slot ids are shared by the parts, so
page p (slot s) of a sequence means the same rows in every device's pool; the CacheManager hands out ids once.
`make_kv_pool` / `make_state_pool` build the plain pool when every layer is on one device, the split one otherwise.
"""
from __future__ import annotations

import torch

from collections.abc import Iterable, Mapping

from ktrans.config import ModelConfig


def _layers(wanted: Iterable[int] | None, kind: list[int], what: str) -> list[int]:
    if wanted is None:
        return list(kind)
    wanted = sorted(set(wanted))
    bad = [i for i in wanted if i not in kind]
    if bad:
        raise ValueError(f"layers {bad} are not {what} layers of this model")
    return wanted


class KVPool:
    """Paged K and V for each full-attention layer: rows [num_pages * page_size, kv_heads, head_dim].

    Row r holds token (r % page_size) of page r // page_size. A sequence's pages are its block table. One page past
    the last usable one, `pad_page` (= num_pages), is reserved for the pad rows of a padded decode batch (a CUDA
    graph's bucket): they write there and nobody reads it. `num_pages` counts the usable pages only.
    """

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", layers: Iterable[int] | None = None):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.pad_page = num_pages
        self.device = torch.device(device)
        self.layer_index = {layer: i for i, layer in
                            enumerate(_layers(layers, config.full_attention_layers, "full-attention"))}
        shape = ((num_pages + 1) * page_size, config.num_key_value_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layer_index]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layer_index]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.layer_index[layer_id]
        return self.k[i], self.v[i]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, layers: int | None = None) -> int:
        """KV bytes per token of `layers` full-attention layers (default all of them)."""
        elem = torch.empty((), dtype=dtype).element_size()
        n = len(config.full_attention_layers) if layers is None else layers
        return 2 * n * config.num_key_value_heads * config.head_dim * elem

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def parts(self) -> list["KVPool"]:
        return [self]


class StatePool:
    """Gated DeltaNet state slots: conv window [slots, conv_dim, kernel-1] and fp32 recurrent state
    [slots, value_heads, key_head_dim, value_head_dim] per linear-attention layer.

    A new request's slot is zeroed by the model itself when its cached length is 0, so allocation need not clear.
    One slot past the last usable one, `pad_slot` (= num_slots), takes the pad rows of a padded decode batch.
    """

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", layers: Iterable[int] | None = None):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.device = torch.device(device)
        self.layer_index = {layer: i for i, layer in
                            enumerate(_layers(layers, config.linear_attention_layers, "linear-attention"))}
        conv_shape = (num_slots + 1, config.conv_dim, config.linear_conv_kernel_dim - 1)
        ssm_shape = (num_slots + 1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
        # every layer's slots in one tensor a kind ([layers, slots + 1, ...]), each layer's a view of it: a slot's
        # copy (the prefix cache's snapshots) is one index_copy_ a kind, not one a layer (72 launches at the 80B)
        n = len(self.layer_index)
        self.conv_all = torch.zeros((n, *conv_shape), dtype=dtype, device=device)
        self.ssm_all = torch.zeros((n, *ssm_shape), dtype=torch.float32, device=device)
        self.conv, self.ssm = list(self.conv_all.unbind(0)), list(self.ssm_all.unbind(0))

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.layer_index[layer_id]
        return self.conv[i], self.ssm[i]

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype, layers: int | None = None) -> int:
        """State bytes per slot of `layers` linear-attention layers (default all of them)."""
        elem = torch.empty((), dtype=dtype).element_size()
        conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * elem
        ssm = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return (len(config.linear_attention_layers) if layers is None else layers) * (conv + ssm)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.ssm))

    @property
    def parts(self) -> list["StatePool"]:
        return [self]


class _Split:
    """Pools of one kind on several devices, each holding its own layers, read through one `layer(i)`."""

    def __init__(self, parts: list, what: str):
        if not parts:
            raise ValueError(f"a split {what} pool needs at least one part")
        self.parts = list(parts)
        self._owner = {}
        for part in self.parts:
            for layer in part.layer_index:
                if layer in self._owner:
                    raise ValueError(f"layer {layer} is in two {what} pools ({self._owner[layer].device} and "
                                     f"{part.device})")
                self._owner[layer] = part
        self.layer_index = {layer: i for i, layer in enumerate(sorted(self._owner))}

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._owner[layer_id].layer(layer_id)

    def part_of(self, layer_id: int):
        return self._owner[layer_id]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class SplitKVPool(_Split):
    """KV pools on several devices sharing one page numbering (see the module docstring)."""

    def __init__(self, parts: list[KVPool]):
        super().__init__(parts, "KV")
        first = self.parts[0]
        if any((p.num_pages, p.page_size) != (first.num_pages, first.page_size) for p in self.parts):
            raise ValueError("the parts of a split KV pool must have the same pages: "
                             + ", ".join(f"{p.device}: {p.num_pages} x {p.page_size}" for p in self.parts))
        self.page_size, self.num_pages, self.pad_page = first.page_size, first.num_pages, first.pad_page
        # every layer's K and V, each on its own device (the CacheManager copies rows tensor by tensor)
        self.k = [t for p in self.parts for t in p.k]
        self.v = [t for p in self.parts for t in p.v]

    pages_for = KVPool.pages_for
    bytes_per_token = staticmethod(KVPool.bytes_per_token)


class SplitStatePool(_Split):
    """DeltaNet state pools on several devices sharing one slot numbering (see the module docstring)."""

    def __init__(self, parts: list[StatePool]):
        super().__init__(parts, "state")
        first = self.parts[0]
        if any(p.num_slots != first.num_slots for p in self.parts):
            raise ValueError("the parts of a split state pool must have the same slots: "
                             + ", ".join(f"{p.device}: {p.num_slots}" for p in self.parts))
        self.num_slots, self.pad_slot = first.num_slots, first.pad_slot
        self.conv = [t for p in self.parts for t in p.conv]
        self.ssm = [t for p in self.parts for t in p.ssm]

    bytes_per_slot = staticmethod(StatePool.bytes_per_slot)


def _groups(layer_devices: Mapping[int, object], layers: list[int]) -> dict[object, list[int]]:
    """Layers by their group (a device, or any key a test uses to stand in a second device), in first-seen order."""
    out: dict[object, list[int]] = {}
    for layer in layers:
        out.setdefault(layer_devices.get(layer, "cpu"), []).append(layer)
    return out


def make_kv_pool(config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 layer_devices: Mapping[int, object], device_of=torch.device) -> "KVPool | SplitKVPool":
    """One KVPool when every full-attention layer maps to one group, else a SplitKVPool with a part per group.
    `layer_devices`: layer -> group; `device_of(group)`: the device the group's tensors go to (a group is a device
    unless a test says otherwise)."""
    groups = _groups(layer_devices, config.full_attention_layers)
    parts = [KVPool(config, num_pages, page_size, dtype, device_of(g), layers) for g, layers in groups.items()]
    if len(parts) <= 1:  # (no full-attention layer at all: an empty pool on the CPU)
        return parts[0] if parts else KVPool(config, num_pages, page_size, dtype, "cpu")
    return SplitKVPool(parts)


def make_state_pool(config: ModelConfig, num_slots: int, dtype: torch.dtype, layer_devices: Mapping[int, object],
                    device_of=torch.device) -> "StatePool | SplitStatePool":
    """As make_kv_pool, for the linear-attention layers' DeltaNet states."""
    groups = _groups(layer_devices, config.linear_attention_layers)
    parts = [StatePool(config, num_slots, dtype, device_of(g), layers) for g, layers in groups.items()]
    if len(parts) <= 1:
        return parts[0] if parts else StatePool(config, num_slots, dtype, "cpu")
    return SplitStatePool(parts)
