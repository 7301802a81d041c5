"""One entry point that turns CLI flags (--model_path / --gguf_path / none) into a config, weights and tokenizer."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ktrans.config import ModelConfig
from ktrans.model.qwen3_next import Qwen3NextForCausalLM, Qwen3NextRotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None, on_cuda: bool = False) -> torch.dtype:
    """--dtype; when not given, bfloat16 where modules run on CUDA (as KTransformers computes there) and float32
    on a CPU-only placement (the exact path)."""
    if name is None:
        return torch.bfloat16 if on_cuda else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class ModelSource:
    """Where a model comes from. With neither path set, the embedded default model."""

    model_path: str | None = None
    gguf_path: str | None = None

    def resolve_dir(self) -> Path:
        """The HF directory: --model_path, or the embedded default when no path is set."""
        if self.model_path:
            path = Path(self.model_path)
            if not path.is_dir():
                raise FileNotFoundError(f"--model_path {path}: no such directory")
            return path
        if self.gguf_path:
            raise FileNotFoundError("a --gguf_path source without --model_path has no HF directory")
        from ktrans.model.tiny import default_model_dir

        return default_model_dir()

    def config(self) -> ModelConfig:
        if self.gguf_path:  # the GGUF's metadata, as llama.cpp reads it, even when --model_path is also given
            from ktrans.weights.gguf_source import GGUFSource

            return GGUFSource(self.gguf_path).config
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
    if source.gguf_path:
        # The plain model (no rules) dequantizes routed experts into its ModuleList; expert operators placed by
        # rules take GGUFSource.get_raw_experts instead and keep the blocks as stored.
        from ktrans.weights.gguf_source import GGUFSource, load_gguf_weights

        gguf = GGUFSource(source.gguf_path)
        config = gguf.config
        model = build_model(config)
        load_gguf_weights(model, gguf, dtype, device, show_progress)
    else:
        from ktrans.weights.hf import load_hf_weights

        model_dir = source.resolve_dir()
        config = ModelConfig.from_json(model_dir / "config.json")
        model = build_model(config)
        load_hf_weights(model, model_dir, config, dtype, device, show_progress)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(device)
    return model.eval(), config


def load_tokenizer(source: ModelSource):
    """--model_path's tokenizer files when it has them; else the GGUF's own vocabulary and chat template."""
    from ktrans.tokenizer.tokenizer import Tokenizer

    if source.gguf_path and not (source.model_path and (Path(source.model_path) / "tokenizer.json").is_file()):
        from ktrans.weights.gguf import GGUFModelFile
        from ktrans.tokenizer.gguf import has_tokenizer, tokenizer_from_gguf

        meta = GGUFModelFile(source.gguf_path).metadata
        if has_tokenizer(meta):
            return tokenizer_from_gguf(meta, source=str(source.gguf_path))
        logging.getLogger(__name__).warning("%s has no tokenizer metadata; using the built-in Qwen3 tokenizer",
                                            source.gguf_path)
        return Tokenizer.default()
    model_dir = source.resolve_dir()
    if (model_dir / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(model_dir)
    return Tokenizer.default()
