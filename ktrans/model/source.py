"""One entry from the CLI's flags (--model_path / --gguf_path / none) to a model's parts: `ModelSource.open()`
gives the config, the WeightSource (GGUF, HF safetensors, or the embedded default model with no path) and the
tokenizer. `ktrans.inject.load_model` builds the module tree from them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from ktrans.config import ModelConfig
from ktrans.model.qwen3_next import Qwen3NextForCausalLM, Qwen3NextRotaryEmbedding
from ktrans.weights.source import WeightSource

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
    """Where a model comes from. With neither path set, the embedded default model.

    With --gguf_path, config and weights come from the GGUF (its metadata as llama.cpp reads it), even when
    --model_path is also given: then only --model_path's tokenizer files are used.
    """

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

    @property
    def name(self) -> str:
        """The model's name for the API: the GGUF's file stem or the HF directory's name."""
        return Path(self.gguf_path).stem if self.gguf_path else self.resolve_dir().name

    def config(self) -> ModelConfig:
        """The config alone (reports that load no weights); open() when the weights are needed too."""
        if self.gguf_path:
            from ktrans.weights.gguf_source import GGUFSource

            return GGUFSource(self.gguf_path).config
        return ModelConfig.from_json(self.resolve_dir() / "config.json")

    def open(self) -> "OpenedModel":
        """Config and memory-mapped weights (nothing is read yet); the tokenizer is built when first asked for."""
        if self.gguf_path:
            from ktrans.weights.gguf_source import GGUFSource

            gguf = GGUFSource(self.gguf_path)
            return OpenedModel(self, gguf.config, gguf)
        from ktrans.weights.hf import HFWeightSource

        model_dir = self.resolve_dir()
        config = ModelConfig.from_json(model_dir / "config.json")
        return OpenedModel(self, config, HFWeightSource(model_dir, config))


@dataclass
class OpenedModel:
    """A model's parts, from ModelSource.open()."""

    source: ModelSource
    config: ModelConfig
    weights: WeightSource

    @property
    def name(self) -> str:
        return self.source.name

    @cached_property
    def tokenizer(self):
        """--model_path's tokenizer files when it has them; else the GGUF's own vocabulary and chat template;
        else the built-in Qwen3 tokenizer."""
        from ktrans.tokenizer.tokenizer import Tokenizer

        src = self.source
        if src.gguf_path and not (src.model_path and (Path(src.model_path) / "tokenizer.json").is_file()):
            from ktrans.tokenizer.gguf import has_tokenizer, tokenizer_from_gguf

            meta = self.weights.metadata
            if has_tokenizer(meta):
                return tokenizer_from_gguf(meta, source=str(src.gguf_path))
            logging.getLogger(__name__).warning("%s has no tokenizer metadata; using the built-in Qwen3 tokenizer",
                                                src.gguf_path)
            return Tokenizer.default()
        model_dir = src.resolve_dir()
        if (model_dir / "tokenizer.json").is_file():
            return Tokenizer.from_hf_dir(model_dir)
        return Tokenizer.default()


def build_model(config: ModelConfig) -> Qwen3NextForCausalLM:
    """The module tree on the meta device: no memory until weights are loaded (ktrans.inject.load_model)."""
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    # Buffers are derived from the config, not the checkpoint: build them for real.
    model.model.rotary_emb = Qwen3NextRotaryEmbedding(config)
    return model
