"""Structured outputs: a grammar per request that limits which tokens the sampler may draw, with llguidance.

A request asks for one constraint (vLLM's StructuredOutputsParams): a JSON schema, any JSON object, a regex, a
choice of strings, or a Lark / GBNF grammar. `GrammarCompiler` turns it into an llguidance grammar once (cached by
the constraint, so n choices and repeated schemas compile once), checks it, and hands each request its own
`GrammarState`, a copy of the compiled matcher. Every step the engine asks each constrained row for its mask (a
bitmask over the vocabulary, filled on the host by llguidance), the sampler applies the masks on the logits'
device, and the sampled token advances the state. When the grammar can take no more text, only EOS is allowed.

Thinking models: when the chat template opened `<think>` in the prompt, the grammar starts after the `</think>`
token (`start_after`), so the reasoning is free and the answer is constrained, as vLLM does with a reasoning parser.

llguidance is chosen because it has no runtime dependencies (one abi3 wheel, ~3 MB, ~8 MB installed) and builds
its tokenizer from the tokenizers JSON ktrans already has; xgrammar pulls in transformers, triton and
apache-tvm-ffi, and outlines-core compiles regexes to an index ahead of time (slow for large schemas).
doc/serving.md compares them.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # a project dependency; the import is guarded so a broken install fails structured requests, not the engine
    import llguidance
except ImportError:  # pragma: no cover
    llguidance = None  # type: ignore[assignment]

THINK_END = "</think>"
# JSON is written compactly (", " and ": ", no other whitespace) unless a schema's x-guidance says otherwise: with
# whitespace allowed anywhere, a weak model can spend every token on blanks between two keys and never finish.
JSON_OPTIONS = {"whitespace_flexible": False}
log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """The constraint cannot be compiled (HTTP 400); `param` names the request field it came from."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's output. Exactly one of json, json_object, regex, choice, grammar is set."""

    json: str | None = None          # a JSON schema, serialized (so the constraint hashes and caches)
    json_object: bool = False        # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None       # Lark (llguidance's dialect) or GBNF / EBNF
    start_after: str | None = None   # the grammar starts after this token (THINK_END for a thinking prompt)
    param: str | None = field(default=None, compare=False)  # the request field, for error messages

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k) not in
                 (None, False)]
        if len(kinds) != 1:
            raise GrammarError(f"give exactly one kind of structured output constraint, got "
                               f"{', '.join(kinds) or 'none'}", self.param)

    @classmethod
    def from_schema(cls, schema: Any, param: str | None = None, **kw) -> "StructuredOutputs":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema is an object (or true/false)", param)
        return cls(json=json.dumps(schema), param=param, **kw)  # key order kept: properties come out in it

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (JSON text); GrammarError if it cannot be one."""
        try:
            if self.json is not None or self.json_object:
                schema = self.json if self.json is not None else {"type": "object"}
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.regex is not None:
                return llguidance.grammar_from("regex", self.regex)
            if self.choice is not None:
                if not self.choice:
                    raise GrammarError("the choice list is empty", self.param)
                return llguidance.grammar_from("choice", list(self.choice))
            return llguidance.grammar_from("grammar", self.grammar or "")
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid structured output constraint: {e}", self.param) from None


class GrammarState:
    """One request's place in its grammar: an llguidance matcher, behind the `start_after` gate."""

    def __init__(self, matcher: Any, gate: int | None):
        self._matcher = matcher
        self._gate = gate
        self.error: str | None = None

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (the gate is passed and it has not failed)."""
        return self._gate is None and self.error is None

    @property
    def done(self) -> bool:
        """The grammar has ended (it took EOS, or can take nothing more), or failed: the request stops. A failure
        cannot come from a masked draw; it is logged, as a bug would be."""
        return self._gate is None and (self.error is not None or self._matcher.is_stopped())

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed tokens of the next step into `row`, int32 [ceil(V / 32)] on the host."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> None:
        """Advance by the sampled token (the engine calls it once per sampled token, in order)."""
        if self._gate is not None:
            if token == self._gate:
                self._gate = None
            return
        if self.error is None and not self._matcher.consume_token(token):
            self.error = f"the structured output grammar refused token {token}: {self._matcher.get_error()}"
            log.warning("%s", self.error)


class GrammarCompiler:
    """Compiles constraints against one tokenizer and vocabulary; thread-safe, so the API compiles off its loop."""

    CACHE_SIZE = 128

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()

    @property
    def lltokenizer(self) -> Any:
        return _lltokenizer(self._tokenizer, self.vocab_size)

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled matcher of a constraint (cached); GrammarError names the field when it does not compile."""
        if llguidance is None:  # pragma: no cover
            raise GrammarError("structured outputs need the llguidance package (pip install llguidance)", spec.param)
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        matcher = llguidance.LLMatcher(self.lltokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid structured output constraint: {matcher.get_error()}", spec.param)
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def state(self, spec: StructuredOutputs) -> GrammarState:
        """A fresh state for one request (a copy of the compiled matcher: copies do not share progress)."""
        gate = self._tokenizer.token_to_id(spec.start_after) if spec.start_after else None
        return GrammarState(self.compile(spec).deep_copy(), gate)


# id(tokenizers backend) -> (the backend, kept alive so the id stays its own; {vocab size: LLTokenizer})
_LLTOKENIZERS: dict[int, tuple[Any, dict[int, Any]]] = {}
_LLTOKENIZER_LOCK = threading.Lock()


def _lltokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the tokenizer (built once per tokenizer and vocabulary, ~1 s): from its tokenizers
    JSON, the model's vocabulary size (ids past the tokenizer's are never allowed) and its EOS ids."""
    backend = tokenizer.backend
    with _LLTOKENIZER_LOCK:
        per_vocab = _LLTOKENIZERS.setdefault(id(backend), (backend, {}))[1]
        if vocab_size not in per_vocab:
            eos = sorted(tokenizer.eos_token_ids) or None
            per_vocab[vocab_size] = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        return per_vocab[vocab_size]


def grammar_masks(states: list[GrammarState | None], vocab_size: int, pin: bool = False) -> torch.Tensor | None:
    """The bitmasks [N, ceil(V / 32)] int32 of a step's rows (all ones where a row is unconstrained), or None when
    no row is constrained. On the host; the sampler copies them to the logits' device."""
    if not any(s is not None and s.active for s in states):
        return None
    masks = torch.full((len(states), -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=pin)
    for i, s in enumerate(states):
        if s is not None and s.active:
            s.fill_mask(masks[i])
    return masks
