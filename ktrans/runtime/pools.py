"""Engine-owned per-request memory: a paged KV cache for the full-attention layers and a slot pool of
Gated DeltaNet states (conv window and recurrent matrix) for the linear-attention layers.

Modules never hold per-request state; they read and write these tensors at the rows a ForwardBatch names.
Which pages and slots are in use, and by whom, is the engine's CacheManager (`ktrans/engine/cache.py`): these
classes hold only the tensors.
"""
from __future__ import annotations

import torch

from ktrans.config import ModelConfig


class KVPool:
    """Paged K and V for each full-attention layer: rows [num_pages * page_size, kv_heads, head_dim].

    Row r holds token (r % page_size) of page r // page_size. A sequence's pages are its block table. One page past
    the last usable one, `pad_page` (= num_pages), is reserved for the pad rows of a padded decode batch (a CUDA
    graph's bucket): they write there and nobody reads it. `num_pages` counts the usable pages only.
    """

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.pad_page = num_pages
        self.layer_index = {layer: i for i, layer in enumerate(config.full_attention_layers)}
        shape = ((num_pages + 1) * page_size, config.num_key_value_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layer_index]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layer_index]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.layer_index[layer_id]
        return self.k[i], self.v[i]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * len(config.full_attention_layers) * config.num_key_value_heads * config.head_dim * elem

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class StatePool:
    """Gated DeltaNet state slots: conv window [slots, conv_dim, kernel-1] and fp32 recurrent state
    [slots, value_heads, key_head_dim, value_head_dim] per linear-attention layer.

    A new request's slot is zeroed by the model itself when its cached length is 0, so allocation need not clear.
    One slot past the last usable one, `pad_slot` (= num_slots), takes the pad rows of a padded decode batch.
    """

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self.layer_index = {layer: i for i, layer in enumerate(config.linear_attention_layers)}
        conv_shape = (num_slots + 1, config.conv_dim, config.linear_conv_kernel_dim - 1)
        ssm_shape = (num_slots + 1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
        self.conv = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in self.layer_index]
        self.ssm = [torch.zeros(ssm_shape, dtype=torch.float32, device=device) for _ in self.layer_index]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.layer_index[layer_id]
        return self.conv[i], self.ssm[i]

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * elem
        ssm = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return len(config.linear_attention_layers) * (conv + ssm)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.ssm))
