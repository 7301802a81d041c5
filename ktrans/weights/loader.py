"""One entry point that turns CLI flags (--model_path / --gguf_path / none) into a config, weights and tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ktrans.config import ModelConfig
from ktrans.model.qwen3_next import Qwen3NextForCausalLM, Qwen3NextRotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class ModelSource:
    """Where a model comes from. With neither path set, the embedded default model."""

    model_path: str | None = None
    gguf_path: str | None = None

    def resolve_dir(self) -> Path:
        if self.gguf_path:
            raise NotImplementedError("--gguf_path is not supported yet (GGUF loading lands with its own issue)")
        if self.model_path:
            path = Path(self.model_path)
            if not path.is_dir():
                raise FileNotFoundError(f"--model_path {path}: no such directory")
            return path
        from ktrans.model.tiny import default_model_dir

        return default_model_dir()

    def config(self) -> ModelConfig:
        return ModelConfig.from_json(self.resolve_dir() / "config.json")


def build_model(config: ModelConfig) -> Qwen3NextForCausalLM:
    """The module tree on the meta device: no memory until weights are loaded."""
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    # Buffers are derived from the config, not the checkpoint: build them for real.
    model.model.rotary_emb = Qwen3NextRotaryEmbedding(config)
    return model


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu",
               show_progress: bool = True) -> tuple[Qwen3NextForCausalLM, ModelConfig]:
    from ktrans.weights.hf import load_hf_weights

    model_dir = source.resolve_dir()
    config = ModelConfig.from_json(model_dir / "config.json")
    model = build_model(config)
    load_hf_weights(model, model_dir, config, dtype, device, show_progress)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(device)
    return model.eval(), config


def load_tokenizer(source: ModelSource):
    from ktrans.weights.tokenizer import Tokenizer

    model_dir = source.resolve_dir()
    if (model_dir / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(model_dir)
    return Tokenizer.default()
