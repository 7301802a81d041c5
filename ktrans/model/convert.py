"""Whole-model GGUF files from an HF directory, with the tokenizer embedded as llama.cpp's converter does it.

The format itself (metadata, tensor types, writing) is ktrans.weights.gguf_writer; the vocabulary keys are
ktrans.tokenizer.gguf's. This module joins them, so neither of those imports the other.
"""
from __future__ import annotations

from pathlib import Path

from ktrans.config import ModelConfig
from ktrans.tokenizer.gguf import gguf_tokenizer_metadata
from ktrans.tokenizer.tokenizer import Tokenizer
from ktrans.weights.gguf_writer import GGUFWriter, model_metadata, write_gguf
from ktrans.weights.safetensors_mmap import SafetensorsCheckpoint


def write_vocab_gguf(path: str | Path, config: ModelConfig, tokenizer) -> Path:
    """A vocabulary-only GGUF (metadata, no tensors), like `convert_hf_to_gguf.py --vocab-only`."""
    w = GGUFWriter(path)
    w.metadata.update(model_metadata(config, "f32"))
    w.metadata.update(gguf_tokenizer_metadata(tokenizer, config))
    return w.write()


def convert_hf_dir(model_dir: str | Path, out: str | Path, quant: str = "f32", legacy_ssm_in: bool = False,
                   **kwargs) -> Path:
    """An HF directory (config.json, safetensors, optional tokenizer files) -> one GGUF file."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_json(model_dir)
    ckpt = SafetensorsCheckpoint(model_dir)
    state = {k: ckpt.get(k) for k in ckpt.keys()}
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None and (model_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_hf_dir(model_dir)
    if tokenizer is not None:
        kwargs["extra_metadata"] = {**gguf_tokenizer_metadata(tokenizer, config), **kwargs.get("extra_metadata", {})}
    return write_gguf(out, config, state, quant, legacy_ssm_in, **kwargs)
