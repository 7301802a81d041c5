"""The tokenizer and chat template of a GGUF, from its metadata alone, and the inverse (for the GGUF writer).

llama.cpp's converter (get_vocab_base / _set_vocab_gpt2 and gguf.SpecialVocab) stores a byte-level BPE
vocabulary as: tokenizer.ggml.model "gpt2", tokenizer.ggml.pre (the pre-tokenizer name; "qwen2" for Qwen),
tokenizer.ggml.tokens (every id up to the model's vocab_size, "[PAD<i>]" where the tokenizer has none),
tokenizer.ggml.token_type (1 normal, 3 control, 4 user-defined, 5 unused), tokenizer.ggml.merges ("a b"),
bos/eos/padding token ids, add_bos_token, and tokenizer.chat_template. An added token becomes CONTROL when the
HF tokenizer calls it special or it looks special (<|...|>), USER_DEFINED otherwise.

Rebuilt here as a Hugging Face `tokenizers.Tokenizer` (BPE over the normal tokens, control and user-defined
tokens as added tokens, Qwen2's NFC normalizer, split regex and byte-level mapping), it gives the same ids as
the HF tokenizer. One difference GGUF cannot avoid: it does not record HF's `special` flag, so an added token
that only looks special (<|fim_prefix|>) is special here, as it is in llama.cpp, and skip_special_tokens drops it.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import tokenizers

from ktrans.config import ModelConfig
from ktrans.tokenizer.tokenizer import QWEN2_PRETOKENIZE_REGEX, Tokenizer
from ktrans.weights.gguf import GGUFError
from ktrans.weights.gguf_writer import Typed

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
PRE_TOKENIZERS = {"qwen2": QWEN2_PRETOKENIZE_REGEX}  # llama.cpp's pre-tokenizer names ktrans can rebuild
K = "tokenizer.ggml."


def _looks_special(token: str) -> bool:
    # the converter's does_token_look_special, for the token shapes Qwen uses
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>")) or \
        (token.startswith("<\uff5c") and token.endswith("\uff5c>"))


def gguf_tokenizer_metadata(tok: Tokenizer, config: ModelConfig) -> dict[str, Any]:
    """The `tokenizer.*` keys llama.cpp's converter writes for this tokenizer and model config."""

    spec = json.loads(tok.backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers can be written to GGUF, not {model.get('type')}")
    reverse = {i: t for t, i in model["vocab"].items()}
    added = tok.backend.get_added_tokens_decoder()
    if tok.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                         f"{config.vocab_size}; the GGUF vocabulary would be cut short")
    tokens, types = [], []
    for i in range(config.vocab_size):
        if i in added:
            a = added[i]
            tokens.append(a.content)
            types.append(CONTROL if a.special or _looks_special(a.content) else USER_DEFINED)
        elif i in reverse:
            tokens.append(reverse[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    meta: dict[str, Any] = {
        K + "model": "gpt2",
        K + "pre": "qwen2",
        K + "tokens": tokens,
        K + "token_type": Typed(9, types),
        K + "merges": merges,
    }
    # gguf.SpecialVocab: ids from tokenizer_config's token strings, else config.json's *_token_id
    ids = {"bos": tok.token_to_id(tok.bos_token) if tok.bos_token else config.bos_token_id,
           "eos": tok.eos_token_id if tok.eos_token else (config.eos_token_id or (None,))[0],
           "padding": tok.pad_token_id if tok.pad_token else config.pad_token_id}
    meta.update({f"{K}{k}_token_id": v for k, v in ids.items() if v is not None})
    meta[K + "add_bos_token"] = False  # Qwen's tokenizer_config: add_bos_token false
    if tok.chat_template:
        meta["tokenizer.chat_template"] = tok.chat_template
    return meta


def has_tokenizer(meta: Mapping[str, Any]) -> bool:
    return K + "tokens" in meta


def tokenizer_from_gguf(meta: Mapping[str, Any], source: str = "GGUF") -> Tokenizer:
    """A ktrans Tokenizer (ids, chat template, eos/pad) from a GGUF's metadata."""
    kind = meta.get(K + "model")
    if kind is None or K + "tokens" not in meta:
        raise GGUFError(f"{source}: no tokenizer in the metadata ({K}model / {K}tokens are missing)")
    if kind != "gpt2":
        raise GGUFError(f"{source}: metadata {K}model is {kind!r}; ktrans rebuilds only 'gpt2' (byte-level BPE)")
    pre = meta.get(K + "pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{source}: metadata {K}pre is {pre!r}; ktrans knows {sorted(PRE_TOKENIZERS)}")
    tokens = meta[K + "tokens"]
    types = meta.get(K + "token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{source}: {K}token_type has {len(types)} entries for {len(tokens)} tokens")
    merges = []
    for m in meta.get(K + "merges", []):
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"{source}: {K}merges entry {m!r} is not two tokens separated by a space")
        merges.append(parts)

    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (NORMAL, BYTE, UNKNOWN)}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty == CONTROL}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    try:
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    except Exception as e:  # tokenizers raises a bare Exception on inconsistent vocab/merges
        raise GGUFError(f"{source}: the GGUF vocabulary does not form a BPE tokenizer: {e}") from e

    def token(key: str) -> str | None:
        i = meta.get(f"{K}{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    extra_eos = [meta[f"{K}{k}_token_id"] for k in ("eos", "eot") if isinstance(meta.get(f"{K}{k}_token_id"), int)]
    return Tokenizer(backend, chat_template=meta.get("tokenizer.chat_template"), eos_token=token("eos"),
                     pad_token=token("padding"), bos_token=token("bos") if meta.get(K + "add_bos_token") else None,
                     extra_eos_ids=extra_eos)
