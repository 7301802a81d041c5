"""Request: one generation as the engine and scheduler see it (vLLM v1 style).

A request is its token list (prompt, then the outputs appended one by one) and `num_computed_tokens`, how many of
those tokens are already in its KV pages and DeltaNet state slot. There are no prefill and decode phases: every
step the scheduler hands it `num_tokens - num_computed_tokens` tokens or fewer (a prefill chunk, or the one token
sampled last step), and when a step brings it level with its tokens, a new token is sampled. Preemption lets go
of the pages (decref) and the slot and sets num_computed_tokens back to 0: the DeltaNet state cannot be rebuilt
from the KV pages, so the whole sequence, prompt and outputs so far, is recomputed when the request runs again, from the
deepest snapshot the prefix cache holds of it (the tokens themselves, and the prompt scores, are kept: see the
scheduler's note on preemption).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ktrans.engine.grammar import GrammarState
from ktrans.engine.sampler import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from scratch
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"  # the client went away or cancelled
    FINISHED_ERROR = "error"  # the step failed; the engine keeps going without it

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class TokenLogprob:
    """A token's logprob and the top alternatives (id -> logprob) at its position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: the engine fills in its default
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache (usage.cached_tokens)
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # for prompt tokens 1.. (token 0 has none)
    scheduled_time: float | None = None  # first admitted to the running batch (time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    grammar: GrammarState | None = None  # its structured output constraint, advanced by every sampled token

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_ids)

    # ---- derived ------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def needs_prompt_scores(self, start: int) -> bool:
        """Whether a chunk starting at `start` must return logits for every token, to score the prompt.

        Only the first computation scores; a recompute after preemption already has the scores."""
        want = self.params.prompt_logprobs is not None
        return want and start < self.num_prompt_tokens - 1 and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
