"""The prefix cache in the engine, on the embedded default model: greedy outputs with the cache equal those of one
request alone without it (`reference`), in each case the issue names, and every page and slot comes back.

The engine is stepped on the test's thread (submit, then poll until idle), so which step admits what, and so
which request hits, is the same every run."""
from __future__ import annotations

import pytest

from ktrans.engine.engine import Engine, EngineConfig, collect
from ktrans.engine.sampler import SamplingParams

from .conftest import pools_full


def engine(tiny, **kw) -> Engine:
    model, tok = tiny
    return Engine(model, tok, EngineConfig(**kw))


def run(e: Engine, prompts: list[list[int]], n: int, abort_after: dict[int, int] | None = None) -> list:
    """Submit all, step until idle (aborting request i after abort_after[i] steps); the joined outputs."""
    streams = [e.submit(p, SamplingParams(temperature=0.0, max_tokens=n)) for p in prompts]
    steps = 0
    while e.poll():
        steps += 1
        for i, at in (abort_after or {}).items():
            if steps == at:
                e.abort(streams[i].request_id)
    return [collect(s) for s in streams]


def words(tok, text: str, n: int) -> list[int]:
    return tok.encode(" ".join(f"{text}{i}" for i in range(n)))


def test_ten_turn_chat_hits_every_turn_and_decodes_as_without_the_cache(tiny, reference):
    _, tok = tiny
    e = engine(tiny, page_size=16, chunk_size=64)
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    for turn in range(10):
        messages.append({"role": "user", "content": f"question {turn}: " + "more " * (turn % 3 + 1)})
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        out = run(e, [prompt], 4)[0]
        assert out.token_ids == reference(prompt, 4), f"turn {turn}"
        if turn:
            assert out.num_cached_tokens >= previous, f"turn {turn} did not hit the conversation before it"
        previous = len(prompt)
        messages.append({"role": "assistant", "content": tok.decode(out.token_ids, skip_special_tokens=True)})
    assert e.prefix_cache.stats.hits >= 9
    assert pools_full(e)


def test_system_prompt_shared_by_eight_concurrent_requests(tiny, reference):
    _, tok = tiny
    e = engine(tiny, page_size=8, chunk_size=2048, max_batch_size=8)  # a wave fits one step
    system = words(tok, "rule", 16)
    wave = lambda k: [system + words(tok, f"user{k}x{i}", 3) for i in range(8)]  # noqa: E731
    cached = []
    for k in range(2):
        prompts = wave(k)
        outs = run(e, prompts, 6)
        for p, o in zip(prompts, outs):
            assert o.token_ids == reference(p, 6)
        cached.append([o.num_cached_tokens for o in outs])
    # The first wave arrives at an empty cache: all compute. In the second, the first request finds the system
    # prompt's pages but no snapshot where the requests branch, so it ends a chunk there; the seven others wait
    # for that snapshot and hit it.
    branch = len(system) // 8 * 8
    assert cached[0] == [0] * 8 and cached[1][0] < branch and cached[1][1:] == [branch] * 7
    assert pools_full(e)


@pytest.mark.parametrize("page_size,chunk_size", [(16, 512), (4, 8)], ids=["mid-page", "mid-chunk"])
def test_prefix_ending_mid_page_and_mid_chunk(tiny, reference, page_size, chunk_size):
    _, tok = tiny
    e = engine(tiny, page_size=page_size, chunk_size=chunk_size)
    shared = words(tok, "shared", 7)
    assert len(shared) % page_size, "the shared prefix should end mid-page"
    if chunk_size < len(shared):
        assert len(shared) % chunk_size, "the shared prefix should end mid-chunk"
    first = shared + words(tok, "alpha", 2)
    out1 = run(e, [first], 5)[0]
    assert out1.token_ids == reference(first, 5)
    follow = first + out1.token_ids + words(tok, "beta", 3)  # continues the first: hits where it stopped
    branch = [shared + words(tok, f"gamma{i}", 2) for i in range(2)]  # branch off mid-way through its chunks
    outs = run(e, [follow], 5) + run(e, [branch[0]], 5) + run(e, [branch[1]], 5)
    for p, o in zip([follow, *branch], outs):
        assert o.token_ids == reference(p, 5)
    assert outs[0].num_cached_tokens == len(first) + 4  # all of the first but its last token
    if page_size == 16:
        assert outs[0].num_cached_tokens % page_size, "the hit should fall mid-page (a copied partial page)"
    else:  # the first branch resumes at a chunk end and ends a chunk at the branch point; the second hits it
        assert [outs[1].num_cached_tokens, outs[2].num_cached_tokens] == [chunk_size, len(shared) // 4 * 4]
    assert pools_full(e)


def test_eviction_under_memory_pressure(tiny, reference):
    _, tok = tiny
    e = engine(tiny, page_size=4, chunk_size=32, cache_lens=96, max_batch_size=2, prefix_cache_max_snapshots=16)
    prompts = [words(tok, "common", 10) + words(tok, f"q{k}x", 4) for k in range(9)]
    for p in prompts:
        assert run(e, [p], 4)[0].token_ids == reference(p, 4)
    st = e.stats()
    assert st["prefix_cache_evicted_pages"] > 0 and st["prefix_cache_evicted_snapshots"] > 0
    assert st["prefix_cache_hits"] >= 7 and st["prefix_cache_snapshots"] <= 16
    assert pools_full(e)


def test_concurrent_hits_on_one_node_and_an_abort_during_a_hit(tiny, reference):
    _, tok = tiny
    e = engine(tiny, page_size=8, chunk_size=128, max_batch_size=5)
    base = words(tok, "context", 20)
    run(e, [base], 1)
    prompts = [base + words(tok, f"ask{i}", 2) for i in range(5)]
    outs = run(e, prompts, 10, abort_after={2: 3})  # request 2 hits, then goes away mid-decode
    assert outs[2].finish_reason == "abort"
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.num_cached_tokens > 0, f"request {i} did not hit"
        if i != 2:
            assert o.token_ids == reference(p, 10)
    snap = e.prefix_cache.lookup(prompts[0], len(prompts[0])).snapshot
    assert snap is not None and snap.node.lock == 0  # nobody runs: the node they shared is unlocked
    assert pools_full(e)


def test_preempted_request_resumes_from_a_snapshot(tiny, reference):
    _, tok = tiny
    e = engine(tiny, page_size=4, chunk_size=64, cache_lens=112, max_batch_size=3)
    prompts = [words(tok, f"long{i}", 8) for i in range(3)]
    outs = run(e, prompts, 24)
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference(p, 24)
    assert e.scheduler.num_preemptions > 0, "the small cache should have forced preemption"
    assert e.prefix_cache.stats.hits > 0, "a preempted request should have resumed from a snapshot"
    assert pools_full(e)


def test_cache_off_and_flush(tiny, reference):
    _, tok = tiny
    p = words(tok, "again", 10)
    off = engine(tiny, enable_prefix_cache=False)
    assert off.prefix_cache is None and off.states.num_slots == off.config.max_batch_size
    assert [o.num_cached_tokens for o in run(off, [p, p], 4)] == [0, 0]
    on = engine(tiny, prefix_cache_max_snapshots=5)
    assert on.states.num_slots == on.config.max_batch_size + 5
    outs = run(on, [p], 4) + run(on, [p], 4) + run(on, [p], 4)
    # the first has no snapshot below its prompt's end (a hit must leave a token to compute); the second ends a
    # chunk at the last page boundary its KV pages matched, and the third hits there
    assert [o.token_ids for o in outs] == [reference(p, 4)] * 3
    assert [o.num_cached_tokens for o in outs] == [0, 0, len(p) // 16 * 16]
    freed = on.flush_cache()
    assert freed["snapshots_freed"] > 0 and freed["pages_freed"] > 0 and on.cache.all_free
    assert run(on, [p], 4)[0].num_cached_tokens == 0  # nothing left to hit
    with pytest.raises(ValueError, match="prefix_cache_max_snapshots"):
        EngineConfig(prefix_cache_max_snapshots=0)


def test_snapshot_interval_serves_prefixes_inside_one_chunk(tiny, reference):
    """--prefix_cache_snapshot_interval 64: a 300-token prompt computed as one chunk leaves snapshots at 64, 128,
    192 and 256; prompts sharing its first 200 or 70 tokens resume from 192 and 64 and decode as alone. Without
    the interval they find no snapshot (the only one sits at 300) and compute from 0."""
    _, tok = tiny
    base = words(tok, "ctx", 200)[:300]
    assert len(base) == 300
    for interval, want in ((64, [192, 64]), (0, [0, 0])):
        e = engine(tiny, page_size=16, chunk_size=512, prefix_cache_snapshot_interval=interval)
        assert run(e, [base], 3)[0].token_ids == reference(base, 3)
        assert e.prefix_cache.stats.snapshots_taken >= (5 if interval else 1)
        for shared, start in zip((200, 70), want):
            prompt = base[:shared] + words(tok, "tail", 2)
            out = run(e, [prompt], 4)[0]
            assert out.num_cached_tokens == start, (interval, shared)
            assert out.token_ids == reference(prompt, 4), (interval, shared)
        e.prefix_cache.flush()
        assert pools_full(e)


def test_snapshot_interval_must_fit_the_kernels_and_pages(tiny):
    with pytest.raises(ValueError, match="prefix_cache_snapshot_interval"):
        engine(tiny, page_size=16, prefix_cache_snapshot_interval=100)
    with pytest.raises(ValueError, match="prefix_cache_snapshot_interval"):
        engine(tiny, page_size=48, prefix_cache_snapshot_interval=64)
