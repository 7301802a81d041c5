"""Tokenizers: byte-level BPE with chat templates, from an HF directory, a GGUF file's metadata or the built-in
Qwen3 vocabulary."""
from ktrans.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
