"""The prefix cache with the scheduler, no model: a fake forward writes into the pools what a real one would depend
on (each KV row and each state slot get a fingerprint of the tokens up to there), so that every chunk can check
that the KV rows and the state it starts from are those of its own tokens, hit or miss. Random workloads of hits,
misses, aborts, evictions and preemptions then end, after a flush, with every page and slot free."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ktrans.config import ModelConfig
from ktrans.engine.cache import CacheManager
from ktrans.engine.prefix_cache import PrefixCache
from ktrans.engine.request import Request, RequestStatus
from ktrans.engine.sampler import SamplingParams
from ktrans.engine.scheduler import Scheduler, SchedulerConfig
from ktrans.model.tiny import preset_config
from ktrans.runtime.pools import KVPool, StatePool

from .test_scheduler import run_step

CONFIG = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
MOD = 1_000_003  # fingerprints stay exact in fp32 (< 2**24)


def fp(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 31 + t + 1) % MOD
    return h


class FakeModel:
    """Stands in for the forward: checks what a chunk starts from, then writes its tokens' fingerprints."""

    def __init__(self, cache: CacheManager):
        self.cache, self.P = cache, cache.page_size
        self.k, self.ssm = cache.kv.k[0], cache.states.ssm[0]
        self.computed = 0  # tokens computed, over all chunks

    def row(self, req: Request, t: int) -> int:
        return req.pages[t // self.P] * self.P + t % self.P

    def run(self, chunk) -> int:
        req, start, end = chunk.request, chunk.start, chunk.start + chunk.num_tokens
        toks = req.all_token_ids
        emitted = dict(chunk.emit)
        assert all(start < pos < end for pos in emitted), f"emits {emitted} outside the chunk {start}..{end}"
        state = 0 if start == 0 else int(self.ssm[req.slot, 0, 0, 0].item())
        assert state == fp(toks[:start]), f"{req.request_id} starts at {start} from a state of other tokens"
        for t in range(start):
            assert int(self.k[self.row(req, t), 0, 0].item()) == fp(toks[: t + 1]), f"KV row {t} is not its own"
        for t in range(start, end):
            state = (state * 31 + toks[t] + 1) % MOD
            self.k[self.row(req, t)].fill_(state)
            if t + 1 in emitted:  # the state after tokens [0, t + 1) also goes to a snapshot slot
                self.ssm[emitted[t + 1]].fill_(state)
        self.ssm[req.slot].fill_(state)
        self.computed += end - start
        return state % 50 + 1  # the "sampled" token: a function of the whole sequence, as greedy decoding is


def make(pages=32, slots=3, budget=16, page_size=4, snapshots=4, prefix=True, interval=0) -> Scheduler:
    """interval: --prefix_cache_snapshot_interval, aligned to the page size here (the engine: to 64 too)."""
    kv = KVPool(CONFIG, pages, page_size)
    states = StatePool(CONFIG, slots + (snapshots if prefix else 0))
    cache = CacheManager.from_pools(kv, states, snapshots if prefix else 0)
    pc = PrefixCache(cache, interval, align=page_size) if prefix else None
    return Scheduler(SchedulerConfig(slots, budget, page_size), cache, pc)


def req(name: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(name, list(tokens), SamplingParams(temperature=0), max_tokens)


def step(s: Scheduler, model: FakeModel) -> list[Request]:
    """One engine step; the requests that finished in it."""
    out = run_step(s, forward=model.run)
    return [c.request for c in out.chunks if c.request.is_finished]


def drain(s: Scheduler, model: FakeModel, limit: int = 2000) -> None:
    for _ in range(limit):
        if not s.has_work():
            return
        step(s, model)
    raise AssertionError("the workload did not finish")


def check_accounting(s: Scheduler) -> None:
    """Each page's refcount is its holders: running requests and the tree (node pages, snapshot tails)."""
    pc, cache = s.prefix, s.cache
    holders = [0] * cache.num_pages
    for r in s.running:
        for p in r.pages:
            holders[p] += 1
    if pc is not None:
        tree = [0] * cache.num_pages
        for n in pc._nodes():
            for p in n.pages:
                tree[p] += 1
            for snap in n.snapshots.values():
                if snap.page is not None:
                    tree[snap.page] += 1
                assert snap in pc._snapshots
        assert {p: k for p, k in enumerate(tree) if k} == dict(pc._refs)
        holders = [a + b for a, b in zip(holders, tree)]
        assert cache.num_snapshot_slots - cache.num_free_snapshot_slots == pc.num_snapshots
    assert holders == [cache.refcount(p) for p in range(cache.num_pages)]
    assert cache.num_slots - cache.num_free_slots == len(s.running)


def test_a_repeated_prompt_hits_below_its_end_and_decodes_the_same():
    s, outs = make(), []
    model = FakeModel(s.cache)
    prompt = list(range(1, 23))  # 22 tokens: 5 pages and 2
    for i in range(2):
        r = req(f"r{i}", prompt)
        s.add(r)
        drain(s, model)
        outs.append(r.output_ids)
    assert outs[0] == outs[1]
    # the first took snapshots at its chunk ends (16, 22) and reply end (25); the second resumed from 16 (22 is
    # its whole prompt, which must leave a token to compute)
    assert s.prefix.stats.hits == 1 and s.prefix.stats.hit_tokens == 16
    s.prefix.flush()
    assert s.cache.all_free


def test_a_chat_turn_hits_the_end_of_the_previous_reply_mid_page():
    s = make(budget=64)
    model = FakeModel(s.cache)
    first = req("t1", list(range(1, 11)), max_tokens=5)  # 10 + 5 tokens; the reply's end, 14, falls mid-page
    s.add(first)
    drain(s, model)
    nxt = req("t2", first.all_token_ids + [40, 41, 42])
    s.add(nxt)
    before = model.computed
    drain(s, model)
    assert nxt.num_cached_tokens == 14  # all but the reply's last token, whose KV and state were never computed
    assert model.computed - before == 4 + 3  # that token, the new turn, then 3 decode steps
    assert s.prefix.stats.hit_tokens == 14
    s.prefix.flush()
    assert s.cache.all_free


def test_requests_branching_off_a_cached_path_snapshot_the_branch_point():
    s = make(budget=64, snapshots=8)
    model = FakeModel(s.cache)
    system = list(range(1, 14))  # 13 shared tokens: the branch point is the page boundary at 12
    a = req("a", system + [30, 31, 32])
    s.add(a)
    drain(s, model)
    b = req("b", system + [40, 41])
    s.add(b)
    s.schedule()  # admission: KV matches to 12, no snapshot there yet, so the first chunk ends at 12
    assert b.num_cached_tokens == 0 and b.num_computed_tokens == 0
    drain(s, model)
    c = req("c", system + [50])
    s.add(c)
    drain(s, model)
    assert c.num_cached_tokens == 12
    assert b.output_ids != c.output_ids or b.all_token_ids[:14] != c.all_token_ids[:14]
    s.prefix.flush()
    assert s.cache.all_free


def test_eviction_under_pressure_takes_least_recently_used_leaves_and_spares_running_ones():
    s = make(pages=10, slots=2, budget=64, snapshots=8)
    model = FakeModel(s.cache)
    old = req("old", list(range(1, 18)), max_tokens=2)  # 19 tokens: 5 pages
    s.add(old)
    drain(s, model)
    assert s.prefix.num_pages >= 4 and s.cache.num_free_pages < 10
    big = req("big", list(range(100, 130)), max_tokens=6)  # 36 tokens: 9 pages, needs old's pages back
    s.add(big)
    drain(s, model)
    assert s.prefix.stats.evicted_pages > 0 and big.is_finished and big.num_preemptions == 0
    check_accounting(s)
    s.prefix.flush()
    assert s.cache.all_free


def test_a_locked_node_is_not_evicted():
    s = make(pages=12, slots=2, budget=64)
    model = FakeModel(s.cache)
    a = req("a", list(range(1, 18)), max_tokens=1)
    s.add(a)
    drain(s, model)
    other = req("other", list(range(60, 70)), max_tokens=1)
    s.add(other)
    drain(s, model)
    hit = req("hit", list(range(1, 18)) + [9, 9], max_tokens=20)
    s.add(hit)
    step(s, model)
    assert hit.num_cached_tokens == 17 and hit in s.running  # a's prompt end, mid-page
    locked = s.prefix._holds[hit]
    path = []
    n = locked
    while n.parent is not None:
        path.append(n)
        n = n.parent
    assert locked.lock == 1 and path
    assert s.prefix.evict_pages(s.cache.num_pages) == 0  # more than can be had: nothing is evicted
    freed = s.prefix.evict_pages(s.prefix.reclaimable_pages())
    assert freed > 0 and s.prefix.reclaimable_pages() == 0  # "other" went, the running request's path stayed
    assert all(n in s.prefix._nodes() for n in path) and s.prefix._holds[hit] is locked
    drain(s, model)
    check_accounting(s)
    s.prefix.flush()
    assert s.cache.all_free


def test_preempted_request_resumes_from_its_deepest_surviving_snapshot():
    """Under page pressure the preempted request's pages go to the tree, and the pages the running one still
    needs are taken back from its deepest leaf; it resumes from the snapshot that is left (its prompt's end), not
    from token 0, and decodes the same tokens."""
    runs = {}
    for prefix in (False, True):
        s = make(pages=8, slots=2, budget=64, page_size=4, prefix=prefix)
        model = FakeModel(s.cache)
        old, new = req("old", list(range(1, 9)), max_tokens=16), req("new", list(range(20, 28)), max_tokens=16)
        s.add(old)
        s.add(new)
        drain(s, model)
        assert new.num_preemptions == 1 and old.is_finished and new.is_finished
        runs[prefix] = (model.computed, old.output_ids, new.output_ids, s)
    (plain, *outs_plain, _), (cached, *outs_cached, s) = runs[False], runs[True]
    assert outs_plain == outs_cached
    assert s.prefix.stats.hits == 1 and s.prefix.stats.hit_tokens == 8  # new, resumed at its prompt's end
    assert plain - cached == 8
    s.prefix.flush()
    assert s.cache.all_free


def test_snapshots_inside_a_chunk_serve_shorter_prefixes_without_small_chunks():
    """With an interval of 8, one 30-token chunk leaves snapshots at 8, 16 and 24 besides its end: a later prompt
    sharing 20 tokens resumes from 16, one sharing 9 from 8; without the interval both would compute from 0."""
    for interval, want in ((8, (16, 8)), (0, (0, 0))):
        s = make(pages=40, budget=64, snapshots=8, interval=interval)
        model = FakeModel(s.cache)
        base = [(7 * i) % 9 + 1 for i in range(30)]
        first = req("first", base)
        s.add(first)
        out = s.schedule()
        assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 30)]  # one chunk: no cut at the interval
        assert [p for p, _ in out.chunks[0].emit] == ([8, 16, 24] if interval else [])
        for c in out.chunks:
            model.run(c)
            s.advance(c)
        drain(s, model)
        check_accounting(s)
        for name, shared, start in (("twenty", 20, want[0]), ("nine", 9, want[1])):
            r = req(name, base[:shared] + [9, 9, 9])
            s.add(r)
            out = s.schedule()
            assert out.chunks[0].start == start, (interval, name)
            for c in out.chunks:
                model.run(c)  # checks that the state it starts from is that of its own first `start` tokens
                s.advance(c)
            drain(s, model)
            check_accounting(s)
        s.prefix.flush()
        assert s.cache.all_free


def test_a_failed_step_gives_its_emitted_slots_back():
    s = make(pages=40, budget=64, snapshots=4, interval=4)
    r = req("r", list(range(1, 20)))
    s.add(r)
    out = s.schedule()
    assert len(out.chunks[0].emit) == 4 and s.cache.num_free_snapshot_slots == 0
    s.finish(r, RequestStatus.FINISHED_ERROR)  # the forward failed: nothing was written to those slots
    assert s.cache.num_free_snapshot_slots == 4 and s.prefix.num_snapshots == 0
    s.prefix.flush()
    assert s.cache.all_free


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), page_size=st.sampled_from([1, 2, 4]), pages=st.integers(10, 40),
       slots=st.integers(1, 4), budget=st.sampled_from([1, 3, 8, 32]), snapshots=st.integers(1, 6),
       interval_pages=st.sampled_from([0, 0, 1, 3]))
def test_random_workloads_compute_their_own_tokens_and_leak_nothing(seed, page_size, pages, slots, budget,
                                                                    snapshots, interval_pages):
    rnd = random.Random(seed)
    s = make(pages=pages, slots=slots, budget=budget, page_size=page_size, snapshots=snapshots,
             interval=interval_pages * page_size)
    model = FakeModel(s.cache)
    capacity = pages * page_size
    bases = [[rnd.randint(1, 9) for _ in range(rnd.randint(1, capacity // 3))] for _ in range(3)]
    finished: list[Request] = []
    outputs: dict[tuple, list[int]] = {}  # the same prompt always decodes the same tokens
    for i in range(rnd.randint(4, 14)):
        kind = rnd.random()
        if kind < 0.3 and finished:  # a chat's next turn: a finished request's tokens and more
            prompt = rnd.choice(finished).all_token_ids + [rnd.randint(1, 9) for _ in range(rnd.randint(1, 4))]
        elif kind < 0.8:  # a shared prefix (or all of it) and a suffix
            base = rnd.choice(bases)
            prompt = base[: rnd.randint(1, len(base))] + [rnd.randint(1, 9) for _ in range(rnd.randint(0, 3))]
        else:
            prompt = [rnd.randint(1, 9) for _ in range(rnd.randint(1, capacity // 2))]
        prompt = prompt[: capacity // 2]
        r = req(f"r{i}", prompt, max_tokens=rnd.randint(1, max(1, min(8, capacity - len(prompt)))))
        s.add(r)
        for _ in range(rnd.randint(0, 6)):
            for done in step(s, model):
                finished.append(done)
                key = tuple(done.prompt_ids)
                assert outputs.setdefault(key, done.output_ids[:1]) == done.output_ids[:1]
            if rnd.random() < 0.1 and s.running:
                s.finish(rnd.choice(s.running), RequestStatus.FINISHED_ABORTED)
            if rnd.random() < 0.05:
                s.prefix.flush()
            check_accounting(s)
    drain(s, model)
    check_accounting(s)
    s.prefix.flush()
    assert s.cache.all_free and s.prefix.num_snapshots == 0 and not s.prefix.root.children
