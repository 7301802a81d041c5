"""Token sampling with per-request parameters.

Each request owns a torch.Generator seeded from its `seed`, so its samples do not depend on what else is in the
batch. temperature 0 is greedy. Penalties come first (on the raw logits, as in vLLM: repetition over prompt and
output, presence and frequency over the output), then temperature and the filters in the order users of vLLM
expect: top-k, then top-p, then min-p. Logprobs are always of the raw model distribution.

SamplingParams also carries what the engine needs to end a request (max_tokens, stop strings, stop token ids,
ignore_eos) and what it reports (logprobs, prompt_logprobs), like vLLM's class of the same name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int = 0       # top-K logprobs to return per generated token (0: none)
    return_logprobs: bool = False  # the sampled token's logprob even when logprobs is 0 (chat's logprobs=true)
    prompt_logprobs: int | None = None  # score the prompt too (echo): None off, else top-K alternatives
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = None   # None: the engine's default (--max_new_tokens, within the context length)
    stop: tuple[str, ...] = ()      # stop strings, matched across token boundaries and left out of the text
    stop_token_ids: tuple[int, ...] = ()  # always stop, ignore_eos or not
    ignore_eos: bool = False
    _generator: torch.Generator | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.return_logprobs or self.logprobs > 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator()
            if self.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.seed)
        return self._generator


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with the filtered-out tokens at -inf."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the first token)
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """vLLM's penalties on one row [V]: repetition divides positive (multiplies negative) logits of every token
    seen in prompt or output; presence subtracts a constant and frequency a multiple of the count per output token."""
    if not p.has_penalties:
        return logits
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.unique(torch.tensor(output_ids, dtype=torch.int64), return_counts=True)
        ids = ids.to(logits.device)
        logits[ids] -= p.frequency_penalty * counts.to(logits.device, logits.dtype) + p.presence_penalty
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           histories: list[tuple[list[int], list[int]] | None] | None = None) -> list[int]:
    """One token per row of fp32 logits [N, V]. histories[i] = (prompt ids, output ids) for the penalties."""
    if all(p.greedy and not p.has_penalties for p in params):  # the common case in one call
        return logits.argmax(dim=-1).tolist() if len(params) else []
    out = []
    for i, (row, p) in enumerate(zip(logits, params)):
        if histories is not None and histories[i] is not None and p.has_penalties:
            row = apply_penalties(row, p, *histories[i])
        if p.greedy:
            out.append(int(torch.argmax(row)))
            continue
        probs = torch.softmax(filter_logits(row.float(), p), dim=-1)
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=p.generator)))
    return out


def top_logprobs(logits: torch.Tensor, k: int) -> list[dict[int, float]]:
    """The k most likely tokens and their log-probabilities (of the raw model distribution) for each row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(logp, k, dim=-1)
    return [{int(i): float(v) for i, v in zip(r_ids, r_vals)} for r_ids, r_vals in zip(ids.tolist(), vals.tolist())]


def token_logprob(logits: torch.Tensor, token_ids: list[int]) -> list[float]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(token_ids)]
