"""WeightSource: how an injected operator gets its tensors, whatever the checkpoint format.

Operators load their own weights under Hugging Face names (`model.layers.3.mlp.experts.7.up_proj.weight`), so a
format translates names and layouts only here, at the loader boundary. Three kinds of access:

- `get(name, dtype, device)`: a dense tensor in the HF shape, converted (and dequantized) as asked. Every
  operator uses this (through `require`, which adds errors naming the tensor); it is all a torch op needs.
- `get_raw(name)`: any tensor as stored (a RawTensor: ggml type and uint8 bytes, one row of blocks per HF row),
  for kernels that read the stored encoding (GGUF Q4_K blocks, ...) instead of a dequantized copy. A float
  checkpoint's tensor comes back as its float bytes with the matching ggml type (F32, F16 or BF16).
- `get_raw_experts(layer, kind)`: one layer's routed experts ("gate", "up" or "down") stacked [E, rows, cols] as
  stored (a RawExperts), so the C++ KExpertsCPU uses them in place without a dequantize/requantize round trip.

Implementations: `HFWeightSource` (ktrans.weights.hf), `GGUFSource` (ktrans.weights.gguf_source) and
`StateDictSource` (below: tensors from a dict, for tests and models built in memory). `ktrans.model.source`
picks one for a model's paths.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping

import torch

from ktrans.weights.quants import quant_type
from ktrans.weights.safetensors_mmap import CheckpointError

EXPERT_KINDS = ("gate", "up", "down")
# ggml type ids of the float types a safetensors checkpoint stores (GGUF's numbering).
GGML_FLOAT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


class WeightError(CheckpointError):
    """A tensor an operator needs is missing or has the wrong shape; the message names it and the source."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored. `shape` is the logical HF shape; `data` is uint8 [*shape[:-1], row_bytes] in the
    encoding of `ggml_type` (its rows are HF's rows). A view of the checkpoint's map when the stored layout is HF's;
    a copy only where a format regroups rows (GGUF's split attn_qkv/attn_gate) or stores other values (GGUF keeps
    1 + w for zero-centred norms and -exp(A_log)): those come back as the HF values in F32."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: torch.Tensor

    @property
    def type_name(self) -> str:
        return quant_type(self.ggml_type).name


@dataclass(frozen=True)
class RawExperts:
    """A layer's stacked routed-expert matrices as stored: `data` is uint8 [E, rows, row_bytes] (a view of the
    mapped file; for a fused gate_up tensor, a strided view of its half), `shape` the logical [E, rows, cols]."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int, int]
    name: str  # the stored tensor(s) it comes from

    @property
    def type_name(self) -> str:
        return quant_type(self.ggml_type).name


def float_bytes(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(ggml type, uint8 [*shape[:-1], row_bytes]) of a float tensor; a view when it is contiguous."""
    if t.dtype not in GGML_FLOAT:
        raise TypeError(f"{t.dtype} has no ggml float type (F32, F16, BF16)")
    t = t.contiguous()
    data = t.reshape(1) if t.dim() == 0 else t
    return GGML_FLOAT[t.dtype], data.view(torch.uint8)


class WeightSource(ABC):
    """Read-only access to a checkpoint by HF tensor name. Reads must be repeatable (the streaming prefill
    experts fetch tensors on every call), which memory-mapped files are."""

    description: str = "weights"  # the checkpoint's path, for messages

    @abstractmethod
    def __contains__(self, name: str) -> bool: ...

    @abstractmethod
    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None
            ) -> torch.Tensor:
        """The tensor in its HF shape, in dtype (None: as stored; a quantized tensor is dequantized to fp32)."""

    def get_raw(self, name: str) -> RawTensor:
        """Tensor `name` as stored (see RawTensor). This default serves float checkpoints: the stored tensor's
        bytes, a view of it."""
        if name not in self:
            raise WeightError(f"{self.description}: checkpoint is missing tensor {name!r}")
        t = self.get(name)
        if t.dtype not in GGML_FLOAT:
            raise WeightError(f"{self.description}: tensor {name!r} is {t.dtype}, not a float type")
        ggml_type, data = float_bytes(t)
        return RawTensor(name, ggml_type, tuple(t.shape), data)

    def get_raw_parts(self, name: str) -> tuple[list[RawTensor], torch.Tensor | None]:
        """Tensor `name` as the stored tensors it is made of, each as stored, and the order of HF's rows in their
        concatenation (None: the parts are HF's rows in order). One part, `get_raw(name)`, except where a format
        splits one HF tensor into tensors of different types (GGUF's attn_qkv + attn_gate), which get_raw could
        only hand back as floats."""
        return [self.get_raw(name)], None

    def get_raw_experts(self, layer: int, kind: str) -> RawExperts:
        """Stacked experts as stored. This default stacks a float checkpoint's per-expert matrices, which costs a
        copy; GGUF stores them stacked already."""
        if kind not in EXPERT_KINDS:
            raise ValueError(f"expert kind must be one of {EXPERT_KINDS}, got {kind!r}")
        prefix = f"model.layers.{layer}.mlp.experts"
        parts, e = [], 0
        while f"{prefix}.{e}.{kind}_proj.weight" in self:
            parts.append(self.get(f"{prefix}.{e}.{kind}_proj.weight"))
            e += 1
        if not parts:
            raise WeightError(f"{self.description}: no experts under {prefix}")
        stacked = torch.stack(parts)
        if stacked.dtype not in GGML_FLOAT:
            raise WeightError(f"{self.description}: experts of {prefix} are {stacked.dtype}, not a float type")
        ggml_type, data = float_bytes(stacked)
        return RawExperts(data, ggml_type, tuple(stacked.shape), f"{prefix}.*.{kind}_proj")

    def tensor_type(self, name: str) -> str:
        """Storage type name ("BF16", "Q4_K", ...) of a tensor, for reports."""
        dtype = self.get(name).dtype
        return quant_type(GGML_FLOAT[dtype]).name if dtype in GGML_FLOAT else "?"

    def unused(self, wanted: set[str]) -> list[str]:
        """Checkpoint tensors none of `wanted` uses: worth a warning, not an error."""
        return []

    def require(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None,
                device: str | torch.device = "cpu") -> torch.Tensor:
        """get() with the errors a loader wants: a missing tensor or a wrong shape names the tensor."""
        if name not in self:
            raise WeightError(f"{self.description}: checkpoint is missing tensor {name!r} (shape {tuple(shape)})")
        t = self.get(name, dtype, device)
        if tuple(t.shape) != tuple(shape):
            raise WeightError(f"{self.description}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                              f"{tuple(shape)}")
        return t


class StateDictSource(WeightSource):
    """Tensors from an in-memory {HF name: tensor} dict."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], description: str = "state dict"):
        self.tensors = dict(tensors)
        self.description = description

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name, dtype=None, device=None) -> torch.Tensor:
        if name not in self.tensors:
            raise WeightError(f"{self.description}: no tensor {name!r}")
        t = self.tensors[name]
        return t.to(device=device or t.device, dtype=dtype or t.dtype)

    def unused(self, wanted: set[str]) -> list[str]:
        return [k for k in self.tensors if k not in wanted]
