"""WeightSource: how an injected operator gets its tensors, whatever the checkpoint format.

Operators load their own weights under Hugging Face names (`model.layers.3.mlp.experts.7.up_proj.weight`), so a
format translates names and layouts only here, at the loader boundary. Two kinds of access:

- `get(name, dtype, device)`: a dense tensor in the HF shape, converted (and dequantized) as asked. Every
  operator uses this (through `require`, which adds errors naming the tensor); it is all a torch op needs.
- `get_raw_experts(layer, kind)`: one layer's routed experts ("gate", "up" or "down") stacked [E, rows, cols] as
  stored (GGUF Q4_K blocks, ...), so a quantized kernel (the C++ KExpertsCPU) uses them in place without a
  dequantize/requantize round trip. The names and the RawExperts type are GGUFSource's.

Implementations: `HFWeightSource` (ktrans.weights.hf), `GGUFWeightSource` (below, over GGUFSource) and
`StateDictSource` (tensors from a dict: tests, models built in memory).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import torch

from ktrans.weights.safetensors_mmap import CheckpointError

EXPERT_KINDS = ("gate", "up", "down")
# ggml type ids of the float types a safetensors checkpoint stores (GGUF's numbering, as RawExperts uses).
_GGML_FLOAT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


class WeightError(CheckpointError):
    """A tensor an operator needs is missing or has the wrong shape; the message names it and the source."""


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

    def get_raw_experts(self, layer: int, kind: str):
        """Stacked experts as stored (a ktrans.weights.gguf_source.RawExperts). This default stacks a float
        checkpoint's per-expert matrices, which costs a copy; GGUF stores them stacked already."""
        from ktrans.weights.gguf_source import RawExperts

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
        if stacked.dtype not in _GGML_FLOAT:
            raise WeightError(f"{self.description}: experts of {prefix} are {stacked.dtype}, not a float type")
        rows, cols = stacked.shape[1:]
        data = stacked.view(torch.uint8).reshape(len(parts), rows, cols * stacked.element_size())
        return RawExperts(data, _GGML_FLOAT[stacked.dtype], (len(parts), rows, cols), f"{prefix}.*.{kind}_proj")

    def tensor_type(self, name: str) -> str:
        """Storage type name ("BF16", "Q4_K", ...) of a tensor, for reports."""
        return {0: "F32", 1: "F16", 30: "BF16"}.get(_GGML_FLOAT.get(self.get(name).dtype), "?")

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


class GGUFWeightSource(WeightSource):
    """A GGUFSource (ktrans.weights.gguf_source) behind this interface: it already speaks HF names."""

    def __init__(self, gguf):
        self.gguf = gguf
        self.config = gguf.config
        self.description = str(gguf.path)

    def __contains__(self, name: str) -> bool:
        from ktrans.weights.gguf import GGUFError

        try:
            gname = self.gguf._locate(name)[0]
        except GGUFError:
            return False
        return gname in self.gguf.file

    def get(self, name, dtype=None, device=None) -> torch.Tensor:
        return self.gguf.get(name, dtype, device)

    def get_raw_experts(self, layer: int, kind: str):
        return self.gguf.get_raw_experts(layer, kind)

    def tensor_type(self, name: str) -> str:
        return self.gguf.tensor_type(name)

    def unused(self, wanted: set[str]) -> list[str]:
        return self.gguf.unused_tensors(wanted)
