"""A Hugging Face Qwen3-Next directory's safetensors behind the WeightSource interface.

Operators take every parameter from the memory-mapped checkpoint under its own HF name (the injector checks the
shape and converts the dtype); `lm_head.weight` falls back to the embedding when the config ties them.
Multi-token-prediction tensors (mtp.*) are not reported as unused.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ktrans.config import ModelConfig
from ktrans.weights.safetensors_mmap import SafetensorsCheckpoint
from ktrans.weights.source import WeightSource

IGNORED_PREFIXES = ("mtp.",)


class HFWeightSource(WeightSource):
    """A HF directory's safetensors by HF name; `lm_head.weight` falls back to the embedding when tied.

    A tensor asked for in its stored dtype on the CPU is a view of the memory map (page cache, not private RSS),
    and so is its `get_raw` (the float bytes, typed F32/F16/BF16).
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
