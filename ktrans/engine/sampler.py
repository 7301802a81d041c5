"""Token sampling with per-request parameters, batched on the logits' device.

One step samples every row at once, whatever the mix of parameters: the per-row parameters become [N] tensors
(built on the host, one small copy to the device), and the only copy back is the N sampled token ids. The order is
vLLM's: penalties on the raw logits (repetition over prompt and output, presence and frequency over the output),
then temperature, top-k (ties with the k-th kept), top-p (the smallest prefix whose mass reaches top_p, at least one
token) and min-p. One topk call finds every row's k-th value and, when some row uses top-p, one descending sort per
row serves top-p and min-p. temperature 0 is greedy: the argmax of the penalized logits, as before.

Seeded sampling does not depend on the batch: a row draws by an exponential race, argmax(log p_i - log E_i), with
E_i = -log(1 - U_i) and U_i a counter-based hash of (the request's seed, the index of the output token being
sampled, the vocabulary id i), computed on the device in int64 kept below 2**63, so it is exact on CPU and CUDA.
A request without a seed gets a random one when its SamplingParams is made (the engine makes a fresh copy per
request). Logprobs are always of the raw model distribution.

SamplingParams also carries what the engine needs to end a request (max_tokens, stop strings, stop token ids,
ignore_eos), what it reports (logprobs, prompt_logprobs) and the structured output constraint, like vLLM's class of
the same name. The constraint's token masks come to `sample` from the engine, which keeps each request's grammar
state (engine/grammar.py).
"""
from __future__ import annotations

import array
import itertools
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ktrans.engine.grammar import StructuredOutputs


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
    structured: StructuredOutputs | None = None  # a grammar the output must follow (engine/grammar.py)
    # accepted and ignored: callers still pass _generator=None to dataclasses.replace (there is no RNG object now)
    _generator: None = field(default=None, repr=False, compare=False)
    # drawn anew by every construction and dataclasses.replace: the seed of a request that gives none
    _random_seed: int = field(init=False, repr=False, compare=False)
    # draws made with these params by calls to `sample` that give no counter (offline loops): the next one's index
    _draws: int = field(default=0, init=False, repr=False, compare=False)

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
        self._random_seed = secrets.randbits(64)

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
    def sampling_seed(self) -> int:
        """The seed the draws come from: `seed`, or the random one drawn when these params were made."""
        return self._random_seed if self.seed is None else self.seed


History = tuple[list[int], list[int]]  # (prompt ids, output ids)

_M64 = (1 << 64) - 1
_M31 = (1 << 31) - 1
_MUL1, _MUL2 = 0x85EBCA6B, 0xC2B2AE35  # odd, < 2**32: a 31-bit value times one stays below 2**63


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _row_keys(seed: int, step: int) -> tuple[int, int]:
    """Two 31-bit keys for the draw of output token `step` of a request seeded with `seed` (host side)."""
    z = _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64))
    return z & _M31, (z >> 31) & _M31


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**31) (murmur3's finalizer on 31 bits), in int64 with every product below 2**63."""
    x = x ^ (x >> 16)  # a new tensor: the caller's is not touched; in place from here
    x.mul_(_MUL1).bitwise_and_(_M31)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_M31)
    return x.bitwise_xor_(x >> 16)


def _exponential_noise(ids: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws [N, V] float32 from the hash of (row keys [N], vocabulary ids [N, V]); always > 0."""
    h = _mix31(_mix31(ids ^ k0[:, None]).bitwise_xor_(k1[:, None]))
    u = h.float().add_(0.5).mul_(-(2.0**-31))  # -U, U uniform in (0, 1]; U = 1 gives E = inf: it cannot win
    return u.log1p_().neg_()


@dataclass
class _Batch:
    """The per-row parameters of one step, on the device, and what the batch as a whole needs."""

    temperature: torch.Tensor  # [N] float32, 1 on greedy rows
    top_k: torch.Tensor        # [N] int64 in [1, V]: V is off
    top_p: torch.Tensor        # [N] float32
    min_p: torch.Tensor        # [N] float32
    k0: torch.Tensor           # [N] int64 keys of the noise
    k1: torch.Tensor
    greedy: torch.Tensor       # [N] bool
    all_greedy: bool
    top_k_max: int             # the largest top-k in use (0: none), the width of the one topk call
    narrow: bool               # on the CPU, every sampled row has a top-k: work on the top top_k_max columns
    any_top_p: bool            # then one descending sort per row, unless narrow
    any_min_p: bool
    penalties: tuple | None    # (rows [P], repetition, presence, frequency [P], seen [P, V] bool, counts [P, V])

    @classmethod
    def build(cls, params: list[SamplingParams], histories: list[History | None] | None, steps: list[int],
              vocab: int, device: torch.device, dtype: torch.dtype) -> _Batch:
        n = len(params)
        # a float64 table [N, 10]: every column is exact in float64 (keys < 2**31, top_k <= V)
        table = torch.tensor([[1.0 if p.greedy else p.temperature,
                               1 if p.greedy else p.top_k if 0 < p.top_k < vocab else vocab,
                               p.top_p, p.min_p, *_row_keys(p.sampling_seed, s), float(p.greedy),
                               p.repetition_penalty, p.presence_penalty, p.frequency_penalty]
                              for p, s in zip(params, steps)], dtype=torch.float64)
        rows = [i for i, p in enumerate(params) if p.has_penalties and histories is not None
                and histories[i] is not None]
        prompts, outputs = [histories[i][0] for i in rows], [histories[i][1] for i in rows]
        # the histories flat: rows, prompt lengths, output lengths, prompt ids, output ids; with the table's bits,
        # one int64 tensor and one copy to the device
        flat = array.array("q", itertools.chain(rows, map(len, prompts), map(len, outputs), *prompts, *outputs))
        flat = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
        both = torch.cat([table.view(torch.int64).flatten(), flat]).to(device)
        table, flat = both[: n * 10].view(torch.float64).view(n, 10), both[n * 10:]
        penalties = None
        if rows:
            idx = flat[: len(rows)]
            pen = table.index_select(0, idx)
            lens = flat[len(rows): 3 * len(rows)].view(2, len(rows))
            total = [sum(map(len, prompts)), sum(map(len, outputs))]
            ids = flat[3 * len(rows):].split(total)
            penalties = (idx, pen[:, 7], pen[:, 8], pen[:, 9], *_histogram(ids, lens, total, vocab, dtype))
        sampled = [p for p in params if not p.greedy]
        return cls(temperature=table[:, 0].float(), top_k=table[:, 1].long(), top_p=table[:, 2].float(),
                   min_p=table[:, 3].float(), k0=table[:, 4].long(), k1=table[:, 5].long(), greedy=table[:, 6] > 0,
                   all_greedy=all(p.greedy for p in params),
                   top_k_max=max((p.top_k for p in sampled if 0 < p.top_k < vocab), default=0),
                   narrow=device.type == "cpu" and all(0 < p.top_k < vocab for p in sampled),
                   any_top_p=any(p.top_p < 1.0 for p in sampled), any_min_p=any(p.min_p > 0.0 for p in sampled),
                   penalties=penalties)


def _histogram(ids: tuple[torch.Tensor, torch.Tensor], lens: torch.Tensor, total: list[int], vocab: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen in prompt or output [P, V] bool, count in the output [P, V]) from the flat ids and lengths per row."""
    p = lens.shape[1]
    rows = torch.arange(p, device=lens.device)
    # which row each id is in: no copy back, the totals are known on the host
    prompt_at = rows.repeat_interleave(lens[0], output_size=total[0]) * vocab + ids[0]
    output_at = rows.repeat_interleave(lens[1], output_size=total[1]) * vocab + ids[1]
    counts = torch.zeros(p * vocab, dtype=dtype, device=lens.device)
    counts = counts.scatter_add_(0, output_at, torch.ones(total[1], dtype=dtype, device=lens.device)).view(p, vocab)
    seen = torch.zeros(p * vocab, dtype=torch.bool, device=lens.device).scatter_(0, prompt_at, True).view(p, vocab)
    return seen | (counts > 0), counts


def _penalize(logits: torch.Tensor, penalties: tuple | None) -> torch.Tensor:
    """vLLM's penalties on the rows that have them; the others are left as they are. Not in place."""
    if penalties is None:
        return logits
    idx, rep, pres, freq, seen, counts = penalties
    x = logits.index_select(0, idx)
    rep, pres, freq = rep.to(x.dtype)[:, None], pres.to(x.dtype)[:, None], freq.to(x.dtype)[:, None]
    # repetition divides positive logits and multiplies negative ones, of every token seen in prompt or output
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    # presence subtracts a constant and frequency a multiple of the count, per token of the output
    x = x - (freq * counts + pres * (counts > 0).to(x.dtype))
    return logits.index_copy(0, idx, x)


def _filtered(logits: torch.Tensor, b: _Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature-scaled logits with the filtered-out tokens at -inf, and their vocabulary ids: sorted descending
    per row when a row uses top-p (one sort serves all the filters), else in vocabulary order (ids None). On the
    CPU, when every sampled row has a top-k, only the top top_k_max columns (sorted), unless ties at a row's k-th
    value reach past them (a check that costs no sync there); on the GPU the full sort is cheap and needs none."""
    x = logits.float() / b.temperature[:, None]
    ids = kth = None
    if b.top_k_max:  # the k-th largest from one topk as wide as the largest k; ties with it are kept
        top, top_ids = x.topk(b.top_k_max, dim=-1)
        kth = top.gather(1, (b.top_k.clamp(max=b.top_k_max) - 1)[:, None])
        kth = kth.masked_fill((b.top_k == x.shape[-1])[:, None], float("-inf"))  # rows without top-k keep all
        if b.narrow and not bool(((x >= kth).sum(dim=-1) > b.top_k_max).any()):
            x, ids = top, top_ids
    if b.any_top_p and ids is None:
        x, ids = x.sort(dim=-1, descending=True)
    if kth is not None:
        x = x.masked_fill(x < kth, float("-inf"))
    if b.any_top_p:
        p = x.softmax(dim=-1)
        drop = (p.cumsum(dim=-1) - p >= b.top_p[:, None]) & (b.top_p < 1.0)[:, None]
        x = x.masked_fill(drop, float("-inf"))
    if b.any_min_p:
        p = x.softmax(dim=-1)
        top = p[:, :1] if ids is not None else p.amax(dim=-1, keepdim=True)
        x = x.masked_fill(p < b.min_p[:, None] * top, float("-inf"))
    return x, ids


def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] with -inf where a row's bitmask [N, ceil(V / 32)] int32 (bit j of word w: token 32 w + j,
    llguidance's layout) forbids the token. The masks go to the logits' device in one copy and are unpacked there.
    Not in place."""
    n, vocab = logits.shape
    m = masks.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((m[:, :, None] >> shifts) & 1).view(n, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams], histories: list[History | None] | None = None,
           steps: list[int] | None = None, masks: torch.Tensor | None = None) -> list[int]:
    """One token per row of logits [N, V], on their device; only the N token ids come back to the host.

    histories[i] = (prompt ids, output ids) for the penalties (None where a row has none). steps[i] is the index
    of the output token being sampled, the counter of the seeded noise (the engine passes the request's output
    count); without it each SamplingParams counts its own draws, so a loop that reuses one params object draws
    a new token each call, as from a generator. masks: the structured-output bitmasks (`apply_token_masks`), applied
    before anything else, so penalties, filters and greedy choose among allowed tokens only."""
    if not params:
        return []
    if masks is not None:
        logits = apply_token_masks(logits, masks)
    if all(p.greedy and not p.has_penalties for p in params):  # the common case in one call
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
            # numpy's row argmax: ~12 us over 151,936 logits against ~320 us for torch's on the CPU (2-core Zen 4);
            # the same first-maximum rule, NaN counting as the maximum in both
            return logits.detach().numpy().argmax(axis=-1).tolist()
        return logits.argmax(dim=-1).tolist()
    if steps is None:
        steps = []
        for p in params:
            steps.append(p._draws)
            p._draws += 1
    b = _Batch.build(params, histories, steps, logits.shape[-1], logits.device, logits.dtype)
    logits = _penalize(logits, b.penalties)
    greedy = logits.argmax(dim=-1)
    if b.all_greedy:
        return greedy.tolist()
    x, ids = _filtered(logits, b)
    vocab_ids = ids if ids is not None else torch.arange(x.shape[-1], device=x.device)[None, :]
    score = _exponential_noise(vocab_ids, b.k0, b.k1).log_().neg_().add_(x)  # log p - log E, up to a constant
    pos = score.argmax(dim=-1, keepdim=True)
    token = ids.gather(1, pos)[:, 0] if ids is not None else pos[:, 0]
    return torch.where(b.greedy, greedy, token).tolist()


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[History | None] | None = None) -> torch.Tensor:
    """The logits [N, V] that `sample` draws from (softmax of a row is its distribution): penalized, scaled and
    filtered, -inf where a token cannot be drawn; a greedy row is 0 at its argmax and -inf elsewhere."""
    b = _Batch.build(params, histories, [0] * len(params), logits.shape[-1], logits.device, logits.dtype)
    logits = _penalize(logits, b.penalties)
    x, ids = _filtered(logits, b)
    if ids is not None:
        x = torch.full_like(logits, float("-inf"), dtype=torch.float32).scatter_(1, ids, x)
    onehot = torch.full_like(x, float("-inf")).scatter_(1, logits.argmax(dim=-1, keepdim=True), 0.0)
    return torch.where(b.greedy[:, None], onehot, x)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """vLLM's penalties on one row [V] (see `_penalize`). Not in place."""
    if not p.has_penalties:
        return logits
    b = _Batch.build([p], [(prompt_ids, output_ids)], [0], logits.shape[-1], logits.device, logits.dtype)
    return _penalize(logits[None], b.penalties)[0]


def top_logprobs(logits: torch.Tensor, k: int) -> list[dict[int, float]]:
    """The k most likely tokens and their log-probabilities (of the raw model distribution) for each row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(logp, k, dim=-1)
    both = torch.stack([ids.double(), vals.double()]).tolist()  # one copy back; ids < 2**53 are exact
    return [{int(i): v for i, v in zip(r_ids, r_vals)} for r_ids, r_vals in zip(*both)]


def token_logprob(logits: torch.Tensor, token_ids: list[int]) -> list[float]:
    """The log-probability of token_ids[i] under row i (of the raw model distribution)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64).to(logp.device)
    return logp.gather(1, ids[:, None])[:, 0].tolist()
