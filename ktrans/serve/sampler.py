"""Token sampling with per-request parameters.

Each request owns a torch.Generator seeded from its `seed`, so its samples do not depend on what else is in the
batch. temperature 0 is greedy. Filters apply in the order users of vLLM expect: top-k, then top-p, then min-p.
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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


def sample(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """One token per row of fp32 logits [N, V]."""
    out = []
    for row, p in zip(logits, params):
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
