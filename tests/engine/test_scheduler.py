"""The scheduler alone: pure Python over a CacheManager made from sizes (no tensors), no model."""
from __future__ import annotations

import random

import pytest

from ktrans.engine.cache import CacheManager
from ktrans.engine.request import Request, RequestStatus
from ktrans.engine.sampler import SamplingParams
from ktrans.engine.scheduler import Scheduler, SchedulerConfig


def make(pages=64, slots=4, budget=16, page_size=4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_batch_size=slots, token_budget=budget, page_size=page_size),
                     CacheManager(pages, page_size, slots))


def req(name: str, prompt_len: int, max_tokens: int = 8, **params) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, **params), max_tokens)


def run_step(s: Scheduler, token: int = 7, forward=None):
    """schedule, then what the engine does after the forward: advance, append a token when a chunk completes.
    `forward(chunk)`, when given, runs each chunk and returns its token."""
    out = s.schedule()
    for c in out.chunks:
        t = forward(c) if forward is not None else token
        s.advance(c)
        r = c.request
        if c.completes:
            r.append_token(t)
            if r.num_output_tokens >= r.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    return out


def test_fcfs_admission_within_budget_and_batch_size():
    s = make(slots=2, budget=100)
    for i in range(3):
        s.add(req(f"r{i}", 10))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]  # batch size 2
    assert [c.num_tokens for c in out.chunks] == [10, 10]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_chunked_prefill_mixes_with_decodes_under_the_budget():
    s = make(budget=8)
    s.add(req("a", 3))
    run_step(s)  # a: 3-token prefill, samples its first token
    s.add(req("b", 20))
    out = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]
    assert [c.logits for c in out.chunks] == ["last", "none"]  # b's chunk is not its last
    out = run_step(s)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 4, 1), ("b", 7, 7)]
    out = run_step(s)
    assert [(c.request.request_id, c.num_tokens, c.logits) for c in out.chunks] == [("a", 1, "last"), ("b", 6, "last")]
    assert s.running[1].num_output_tokens == 1


def test_no_overtaking_when_the_head_does_not_fit():
    s = make(pages=6, budget=64, page_size=4)
    s.add(req("big", 20, max_tokens=4))  # 5 pages for its prompt
    s.add(req("small", 2, max_tokens=4))
    run_step(s)
    s.add(req("big2", 20, max_tokens=4))
    s.add(req("small2", 2, max_tokens=4))
    out = s.schedule()
    ids = [c.request.request_id for c in out.chunks]
    assert "big2" not in ids and "small2" not in ids  # small2 would fit but waits behind big2


def test_preempts_the_newest_and_frees_its_memory():
    s = make(pages=6, slots=4, budget=64, page_size=4)
    s.add(req("old", 8, max_tokens=16))
    s.add(req("new", 8, max_tokens=16))
    run_step(s)  # both admitted with 2 pages each; 2 stay free, one reserved per running request
    assert [r.request_id for r in s.running] == ["old", "new"]
    history = [run_step(s) for _ in range(5)]  # positions 8..12: the third page each, then old needs a fourth
    assert [len(o.preempted) for o in history] == [0, 0, 0, 0, 1]
    new = history[-1].preempted[0]
    assert new.request_id == "new" and [c.request.request_id for c in history[-1].chunks] == ["old"]
    assert new.status is RequestStatus.PREEMPTED and new.pages == [] and new.slot is None
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1 and new.num_output_tokens == 5
    assert s.waiting[0] is new and s.cache.num_free_slots == 3 and s.cache.num_free_pages == 2
    while s.running:  # no admission while the old one needs the pages... until it finishes
        run_step(s)
    out = s.schedule()  # then the preempted one is recomputed from scratch: prompt and its outputs so far
    assert out.chunks[0].request is new and out.chunks[0].start == 0
    assert out.chunks[0].num_tokens == new.num_tokens == 13 and out.chunks[0].logits == "last"


def test_request_that_preempts_itself_when_it_is_the_newest():
    s = make(pages=4, slots=2, budget=64, page_size=4)
    s.add(req("a", 6, max_tokens=8))
    run_step(s)  # a: 2 pages
    s.add(req("b", 3, max_tokens=8))
    out = run_step(s)  # b fits with one page kept free for a
    assert [c.request.request_id for c in out.chunks] == ["a", "b"] and s.cache.num_free_pages == 1
    run_step(s)  # a at position 7, b at 3: no new pages
    out = run_step(s)  # a takes the last page for position 8; b needs one for position 4 and is the newest
    assert [c.request.request_id for c in out.chunks] == ["a"] and out.preempted[0].request_id == "b"
    steps = 0
    while s.has_work() and steps < 200:
        run_step(s)
        steps += 1
    assert not s.has_work() and s.num_preemptions == 1
    assert s.cache.num_free_pages == 4 and s.cache.num_free_slots == 2


def test_finish_and_abort_return_everything():
    s = make(pages=16, slots=2)
    a, b, c = req("a", 9), req("b", 5), req("c", 5)
    for r in (a, b, c):
        s.add(r)
    run_step(s)
    s.finish(b, RequestStatus.FINISHED_ABORTED)  # running
    s.finish(c, RequestStatus.FINISHED_ABORTED)  # still waiting
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert s.cache.num_free_pages == 16 and s.cache.num_free_slots == 2 and not s.has_work()
    assert a.pages == [] and a.slot is None and c.status is RequestStatus.FINISHED_ABORTED


def test_prompt_scoring_chunks_return_all_logits_once():
    s = make(budget=4)
    r = req("echo", 10, max_tokens=2, prompt_logprobs=1)
    s.add(r)
    modes = []
    while s.has_work():
        out = s.schedule()
        for c in out.chunks:
            modes.append((c.start, c.logits))
            if c.logits == "all":  # what the engine records: scores for positions up to the prompt's end
                r.prompt_logprobs.extend([None] * (min(c.start + c.num_tokens, 9) - len(r.prompt_logprobs)))
        for c in out.chunks:
            s.advance(c)
            if c.completes:
                c.request.append_token(1)
                if c.request.num_output_tokens >= 2:
                    s.finish(c.request, RequestStatus.FINISHED_LENGTH)
    assert modes == [(0, "all"), (4, "all"), (8, "all"), (10, "last")]


def test_add_refuses_what_can_never_fit():
    s = make(pages=4, page_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        s.add(req("huge", 10, max_tokens=7))
    s.add(req("fits", 10, max_tokens=6))


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_finishes_with_pools_full(seed):
    rnd = random.Random(seed)
    s = make(pages=rnd.choice([8, 12, 40]), slots=rnd.choice([1, 3, 6]), budget=rnd.choice([1, 5, 32]),
             page_size=rnd.choice([1, 4]))
    total_tokens = s.cache.num_pages * s.config.page_size
    reqs = []
    for i in range(12):
        n = rnd.randint(1, total_tokens // 2)
        reqs.append(req(f"r{i}", n, max_tokens=rnd.randint(1, total_tokens - n)))
    pending = list(reqs)
    for step in range(5000):
        if pending and rnd.random() < 0.3:
            s.add(pending.pop(0))
        if rnd.random() < 0.01 and s.running:
            s.finish(rnd.choice(s.running), RequestStatus.FINISHED_ABORTED)
        out = run_step(s)
        used = [p for r in s.running for p in r.pages]
        assert len(used) == len(set(used)) == s.cache.num_pages - s.cache.num_free_pages
        assert out.num_tokens <= s.config.token_budget and len(s.running) <= s.config.max_batch_size
        for r in s.running:
            assert len(r.pages) * s.config.page_size >= r.num_computed_tokens
        if not pending and not s.has_work():
            break
    assert not s.has_work(), "the workload did not finish"
    assert s.cache.num_free_pages == s.cache.num_pages and s.cache.num_free_slots == s.cache.num_slots
    for r in reqs:
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens


def test_preemption_and_finish_decref_so_shared_pages_survive():
    """A page another holder (a future prefix-cache node) shares stays allocated when its request is preempted or
    finishes; the request keeps its tokens and recomputes them."""
    s = make(pages=6, slots=4, budget=64, page_size=4)
    old, new = req("old", 8, max_tokens=16), req("new", 8, max_tokens=16)
    s.add(old)
    s.add(new)
    run_step(s)
    held = list(new.pages)
    s.cache.incref(held)  # a second holder of new's pages
    tokens = None
    for _ in range(10):
        tokens = list(new.all_token_ids)
        out = run_step(s)
        if out.preempted:
            break
    assert out.preempted == [new] and new.pages == [] and new.slot is None
    assert new.all_token_ids == tokens and new.num_computed_tokens == 0  # its tokens are kept, to be recomputed
    assert [s.cache.refcount(p) for p in held] == [1, 1]  # dropped its reference; the other holder's survive
    s.finish(new, RequestStatus.FINISHED_ABORTED)  # preempted, then aborted: nothing more to give back
    s.finish(old, RequestStatus.FINISHED_ABORTED)
    assert s.cache.num_free_pages == 4 and s.cache.num_free_slots == 4
    assert s.cache.decref(held) == held and s.cache.all_free


def test_scheduler_and_cache_page_sizes_agree():
    with pytest.raises(ValueError, match="pages of 8"):
        Scheduler(SchedulerConfig(max_batch_size=2, token_budget=8, page_size=4), CacheManager(4, 8, 2))
