"""Scheduler: which requests run this step, with how many tokens each, within the memory the pools have.

Pure Python over a page allocator and a slot allocator, so it is tested without a model. One step:

1. Running requests, oldest first, each get min(tokens left to compute, budget left) tokens: one for a decode,
   a chunk for a prompt. Their block tables grow to cover the new tokens. When no page is free, the newest
   running request is preempted (pages and slot back, recomputed later from scratch) until the page is found
   or the request itself was the newest.
2. If nothing was preempted, waiting requests are admitted first come first served while the budget, the batch
   size, a free state slot and pages for their first chunk allow. Admission stops at the first that does not
   fit (no overtaking), and keeps one free page per running request so that their next tokens fit.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ktrans.engine.request import Request, RequestStatus


class PageSource(Protocol):
    """runtime.pools.PageAllocator's interface."""

    num_pages: int

    @property
    def num_free(self) -> int: ...
    def can_allocate(self, n: int) -> bool: ...
    def alloc(self, n: int) -> list[int]: ...
    def free(self, pages: list[int]) -> None: ...


class SlotSource(Protocol):
    """runtime.pools.StatePool's allocator interface."""

    num_slots: int

    @property
    def num_free(self) -> int: ...
    def alloc(self) -> int: ...
    def free(self, slot: int) -> None: ...


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
    def __init__(self, config: SchedulerConfig, pages: PageSource, slots: SlotSource):
        self.config = config
        self.pages = pages
        self.slots = slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue --------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self.pages_for(req.num_prompt_tokens + req.max_tokens) > self.pages.num_pages:
            raise ValueError(f"request {req.request_id} needs {req.num_prompt_tokens + req.max_tokens} tokens of KV "
                             f"cache, more than the {self.pages.num_pages * self.config.page_size} there are")
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
            n = min(req.num_tokens_to_compute, budget)
            need = self.pages_for(n)
            reserve = len(self.running)  # one page each for the running requests' next tokens
            if self.slots.num_free == 0 or self.pages.num_free < need + reserve:
                break
            self.waiting.popleft()
            req.slot = self.slots.alloc()
            req.pages = self.pages.alloc(need)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:  # first admission: the end of its queue time
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n
        return out

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        if req.needs_prompt_scores(start):
            mode = "all"
        else:
            mode = "last" if start + n == req.num_tokens else "none"
        return ScheduledChunk(req, start, n, mode)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if not self.pages.can_allocate(need):
            return False
        req.pages.extend(self.pages.alloc(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # it was admitted before anything still waiting

    # ---- after the step -----------------------------------------------------------------------------
    def advance(self, chunk: ScheduledChunk) -> None:
        """The chunk's tokens are now in the request's KV pages and state slot."""
        chunk.request.num_computed_tokens = chunk.start + chunk.num_tokens

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (finished or aborted, running or waiting) and give back every page and its slot."""
        assert status.is_finished, status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = status

    def _release(self, req: Request) -> None:
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    # ---- numbers for /metrics and the startup summary -----------------------------------------------
    @property
    def kv_usage(self) -> float:
        return 1.0 - self.pages.num_free / self.pages.num_pages

    @property
    def slot_usage(self) -> float:
        return 1.0 - self.slots.num_free / self.slots.num_slots
