"""Scheduler: which requests run this step, with how many tokens each, within the memory the CacheManager has.

Pure Python over a CacheManager (which can be made without tensors, unless a prefix cache copies states), so it
is tested without a model. One step:

1. Running requests, oldest first, each get min(tokens left to compute, budget left) tokens: one for a decode,
   a chunk for a prompt. Their block tables grow to cover the new tokens. When no page is free, cached prefixes
   are evicted, and if that is not enough the newest running request is preempted, until the page is found or
   the request itself was the newest.
2. If nothing was preempted, waiting requests are admitted first come first served while the budget, the batch
   size, a free state slot and pages for their first chunk allow. Admission stops at the first that does not
   fit (no overtaking), and keeps one free page per running request so that their next tokens fit.

Memory goes back through the CacheManager: a finished or preempted request drops its reference to each page
(`decref`: a page another holder shares survives) and frees its state slot.

Preemption keeps what can be reused: the request itself (its tokens, prompt and every output so far, never
re-sampled; its prompt scores, never recomputed: see Request.needs_prompt_scores; its sampling state and its
place at the head of the queue). Its KV pages and DeltaNet state slot are let go. Without a prefix cache it
resumes by recomputing its tokens from 0, as one prefill (its outputs are then prompt-like tokens): the state is
one point of a recurrence that cannot be rebuilt from KV pages, nor the KV from the state.

With a prefix cache (`ktrans/engine/prefix_cache.py`) the scheduler calls it at four points:
- admission: a request starts at its deepest cached snapshot (shared pages, its own copy of the state);
- chunk sizing: a chunk ends where the request branches off a cached path (`clip`), so a snapshot covers it;
- `advance`: a prefill chunk's end is snapshotted, and with --prefix_cache_snapshot_interval the states its
  forward emitted at each multiple of the interval inside it (`emits_for`, when the chunk is made);
- `_release` (finish, abort, preemption): before the decref, the tree takes its own reference to the pages
  and a snapshot of the state, so a preempted request resumes from where it was, and a chat's next turn from
  the end of this reply.
Cached pages no request holds are memory the scheduler may take back: when pages are short, it evicts them
(least recently used first) before it preempts anyone, and it admits a request if eviction makes room.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ktrans.engine.cache import CacheManager
from ktrans.engine.prefix_cache import Match, PrefixCache
from ktrans.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int  # running requests at most (each holds a DeltaNet state slot)
    token_budget: int  # tokens per step: decode tokens plus prefill chunks (--chunk_size)
    page_size: int

    def __post_init__(self) -> None:
        assert self.max_batch_size > 0, "max_batch_size must be positive"
        assert self.token_budget > 0, "token_budget (--chunk_size) must be positive"
        assert self.page_size > 0, "page_size must be positive"


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of a request's token list, to be computed this step."""

    request: Request
    start: int
    num_tokens: int
    logits: str  # "last", "all" (prompt scoring) or "none" (a prefill chunk that is not the last)
    emit: tuple[tuple[int, int], ...] = ()  # (position, snapshot slot): states the prefix cache snapshots inside it

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]

    @property
    def completes(self) -> bool:
        """After this chunk the request's tokens are all computed: its last logits give the next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, prefix: PrefixCache | None = None):
        if cache.page_size != config.page_size:
            raise ValueError(f"the cache has pages of {cache.page_size} tokens, the scheduler {config.page_size}")
        if prefix is not None and prefix.cache is not cache:
            raise ValueError("the prefix cache must be built on the scheduler's CacheManager")
        self.config = config
        self.cache = cache
        self.prefix = prefix
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue --------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self.pages_for(req.num_prompt_tokens + req.max_tokens) > self.cache.num_pages:
            raise ValueError(f"request {req.request_id} needs {req.num_prompt_tokens + req.max_tokens} tokens of KV "
                             f"cache, more than the {self.cache.num_pages * self.config.page_size} there are")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size)

    # ---- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_to_compute, budget)
            if self.prefix is not None:
                n = self.prefix.clip(req, n)
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the newest, nothing runs after it
            out.chunks.append(self._chunk(req, n))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size and not out.preempted:
            req = self.waiting[0]
            if self.cache.num_free_slots == 0:
                break
            match = self._lookup(req)
            if match is not None and self.prefix.waits_for_branch(req, match):
                break  # a running request is about to snapshot the prefix this one shares (no overtaking)
            start = match.num_tokens if match is not None else 0
            n = min(req.num_tokens - start, budget)
            if match is not None and (cut := match.cut(req.num_tokens)) is not None:
                n = min(n, cut - start)
            need = self.pages_for(start + n) - (len(match.pages) if match is not None else 0)
            reserve = len(self.running)  # one page each for the running requests' next tokens
            if match is not None:
                self.prefix.pin(match)  # making room below must not evict what it is about to share
            room = self._reserve(need + reserve)
            if match is not None:
                self.prefix.pin(match, -1)
            if not room:
                break
            self.waiting.popleft()
            req.slot = self.cache.alloc_slot()
            if match is not None:
                self.prefix.attach(req, match)  # req.pages: the shared ones first
            req.pages += self.cache.alloc_pages(need)
            if match is not None and match.is_hit:
                self.prefix.restore(req, match)  # its own copy of the state; computes from the hit on
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:  # first admission: the end of its queue time
                req.scheduled_time = time.monotonic()
                req.num_cached_tokens = start
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n
        return out

    def _lookup(self, req: Request) -> Match | None:
        """The prefix cache's match for a request being admitted; None without a cache, or when the request must
        score its whole prompt (prompt_logprobs), which a hit would skip."""
        if self.prefix is None or req.needs_prompt_scores(0):
            return None
        return self.prefix.lookup(req.all_token_ids, req.num_tokens)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        if req.needs_prompt_scores(start):
            mode = "all"
        else:
            mode = "last" if start + n == req.num_tokens else "none"
        emit = self.prefix.emits_for(req, start, start + n) if self.prefix is not None else ()
        return ScheduledChunk(req, start, n, mode, emit)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        req.pages.extend(self.cache.alloc_pages(need))
        return True

    def _reserve(self, n: int) -> bool:
        """Whether n pages are free, after evicting cached prefixes no request uses if that makes them so."""
        short = n - self.cache.num_free_pages
        if short > 0 and self.prefix is not None:
            self.prefix.evict_pages(short, slack=self.cache.num_pages // 64)  # a little ahead: fewer walks
        return self.cache.can_alloc_pages(n)

    def _preempt(self, req: Request) -> None:
        """Back to the head of the queue with its tokens; its pages and slot go back (see the module's note)."""
        self.running.remove(req)
        self._release(req, keep=True)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # no pages and no state of its own: from its deepest cached snapshot, or 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # it was admitted before anything still waiting

    # ---- after the step -----------------------------------------------------------------------------
    def advance(self, chunk: ScheduledChunk) -> None:
        """The chunk's tokens are now in the request's KV pages and state slot."""
        chunk.request.num_computed_tokens = chunk.start + chunk.num_tokens
        if self.prefix is not None:
            self.prefix.on_computed(chunk.request, chunk.start, chunk.start + chunk.num_tokens)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (finished or aborted, running, waiting or preempted): its references to its pages and
        its slot go back (what it computed stays in the prefix cache, unless its step failed)."""
        assert status.is_finished, status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req, keep=status is not RequestStatus.FINISHED_ERROR)
        req.status = status

    def _release(self, req: Request, keep: bool) -> None:
        """Drop the request's hold on its memory: decref, not free, so that pages another holder (a prefix-cache
        node, a request sharing the prefix) still reads stay allocated. With `keep`, the prefix cache first takes
        its pages and a snapshot of its state."""
        if self.prefix is not None:
            self.prefix.release(req, keep)
        if req.pages:
            self.cache.decref(req.pages)
            req.pages = []
        if req.slot is not None:
            self.cache.free_slot(req.slot)
            req.slot = None

    # ---- numbers for /metrics and the startup summary -----------------------------------------------
    @property
    def kv_usage(self) -> float:
        return self.cache.kv_usage

    @property
    def slot_usage(self) -> float:
        return self.cache.slot_usage
