"""Load a Hugging Face Qwen3-Next directory (config.json + safetensors) into the module tree.

The model is built on the meta device, then every parameter is taken from the memory-mapped checkpoint under
its own HF name, checked for shape, and converted to the requested dtype. Missing or misshapen tensors are
errors that name the key; multi-token-prediction tensors (mtp.*) are skipped, other unknown keys warned about.

`HFWeightSource` is the same checkpoint behind the WeightSource interface that injected operators load from.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from ktrans.config import ModelConfig
from ktrans.weights.safetensors_mmap import CheckpointError, SafetensorsCheckpoint
from ktrans.weights.source import WeightSource

log = logging.getLogger(__name__)

IGNORED_PREFIXES = ("mtp.",)


def progress(items: Iterable, total: int, desc: str, enabled: bool = True):
    """tqdm progress bar on stderr when enabled and attached to a terminal or forced."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", dynamic_ncols=True, leave=False)


def materialize(model: nn.Module, get: Callable[[str, tuple[int, ...]], torch.Tensor], dtype: torch.dtype,
                device: str | torch.device = "cpu", show_progress: bool = True, desc: str = "loading") -> None:
    """Replace every meta parameter of `model` by get(name, expected_shape), cast to dtype, on device.

    Float parameters follow `dtype`, except the DeltaNet A_log and dt_bias, which HF keeps in fp32 math anyway.
    """
    params = list(model.named_parameters())
    for name, p in progress(params, len(params), desc, show_progress):
        t = get(name, tuple(p.shape))
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        target = torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype
        t = t.to(device=device, dtype=target)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._parameters[attr] = nn.Parameter(t, requires_grad=False)
    for module_name, module in model.named_modules():
        for bname, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                raise CheckpointError(f"buffer {module_name}.{bname} was left on the meta device")


def load_hf_weights(model: nn.Module, model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
                    device: str | torch.device = "cpu", show_progress: bool = True) -> None:
    ckpt = SafetensorsCheckpoint(model_dir)
    wanted = {name for name, _ in model.named_parameters()}

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name in ckpt:
            return ckpt.get(name)
        if name == "lm_head.weight" and config.tie_word_embeddings and "model.embed_tokens.weight" in ckpt:
            return ckpt.get("model.embed_tokens.weight")
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensor {name!r} (shape {shape})")

    extra = [k for k in ckpt.keys() if k not in wanted and not k.startswith(IGNORED_PREFIXES)]
    if extra:
        log.warning("%s: %d tensors not used by the model, e.g. %s", model_dir, len(extra), extra[:3])
    materialize(model, get, dtype, device, show_progress, desc=f"loading {Path(model_dir).name}")


class HFWeightSource(WeightSource):
    """A HF directory's safetensors by HF name; `lm_head.weight` falls back to the embedding when tied.

    A tensor asked for in its stored dtype on the CPU is a view of the memory map (page cache, not private RSS).
    """

    def __init__(self, model_dir: str | Path, config: ModelConfig):
        self.model_dir = Path(model_dir)
        self.description = str(self.model_dir)
        self.ckpt = SafetensorsCheckpoint(self.model_dir)
        self.tied = config.tie_word_embeddings

    def _key(self, name: str) -> str:
        if name == "lm_head.weight" and name not in self.ckpt and self.tied:
            return "model.embed_tokens.weight"
        return name

    def __contains__(self, name: str) -> bool:
        return self._key(name) in self.ckpt

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None
            ) -> torch.Tensor:
        t = self.ckpt.get(self._key(name))
        return t.to(device=device or "cpu", dtype=dtype or t.dtype)

    def unused(self, wanted: set[str]) -> list[str]:
        return [k for k in self.ckpt.keys() if k not in wanted and not k.startswith(IGNORED_PREFIXES)]
