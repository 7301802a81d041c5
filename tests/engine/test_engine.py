"""The engine without HTTP, on the embedded default model: batched outputs equal one request alone (`ktrans
generate`'s one-request engine), prompt scores equal a direct forward, memory comes back."""
from __future__ import annotations

import pytest
import torch

from ktrans.engine.engine import Engine, EngineConfig, EngineOverloaded, InvalidRequest, collect, wait_idle
from ktrans.engine.sampler import SamplingParams

from ..model.helpers import generate, prompt_logprobs
from .conftest import pools_full

GREEDY = SamplingParams(temperature=0.0)


def prompts(tok, n: int = 6) -> list[list[int]]:
    return [tok.encode("The quick brown fox " * (k + 1) + str(k)) for k in range(n)]


@pytest.fixture()
def engine(tiny, request):
    model, tok = tiny
    kwargs = getattr(request, "param", {})
    e = Engine(model, tok, EngineConfig(**kwargs)).start()
    yield e
    e.stop()


@pytest.mark.parametrize("engine", [dict(chunk_size=5, max_batch_size=4),
                                    dict(chunk_size=16, max_batch_size=8, cache_lens=96, page_size=4)],
                         indirect=True, ids=["chunked", "preempting"])
def test_greedy_batch_equals_alone(engine, tiny, reference):
    _, tok = tiny
    ps = prompts(tok)
    streams = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in ps]
    outs = [collect(s) for s in streams]
    for p, o in zip(ps, outs):
        assert o.token_ids == reference(p, 12)
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    if engine.kv.page_size == 4:
        assert engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert wait_idle(engine) and pools_full(engine)


@pytest.mark.parametrize("engine", [dict(max_batch_size=2, chunk_size=8)], indirect=True)
def test_hundred_submitted_then_aborted_leave_pools_full(engine, tiny):
    _, tok = tiny
    streams = [engine.submit(tok.encode(f"request {i} " * (1 + i % 7)), SamplingParams(max_tokens=50))
               for i in range(100)]
    for s in streams:
        engine.abort(s.request_id)
    outs = [collect(s) for s in streams]
    assert all(o.finished for o in outs)
    assert {o.finish_reason for o in outs} <= {"abort", "length", "stop"}
    assert wait_idle(engine) and pools_full(engine)


def test_echo_scores_equal_a_direct_forward(engine, tiny):
    model, tok = tiny
    p = tok.encode("Scoring a prompt, token by token.")
    direct = prompt_logprobs(model, p)
    alone = generate(model, p, 3, GREEDY, tokenizer=tok, chunk_size=4)  # ktrans generate --chunk_size 4
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, logprobs=2)
    out = collect(engine.submit(p, params))
    assert len(out.prompt_logprobs) == len(p) - 1
    for mine, ref, tok_id in zip(out.prompt_logprobs, direct, p[1:]):
        assert mine.token_id == tok_id
        assert mine.logprob == pytest.approx(ref, abs=1e-4)
        assert len(mine.top) == 2 and max(mine.top.values()) >= mine.logprob - 1e-6
    assert [e.token_id for e in out.logprobs] == out.token_ids == alone.token_ids
    only = collect(engine.submit(p, SamplingParams(max_tokens=0, prompt_logprobs=0)))  # scoring only
    assert only.token_ids == [] and only.finish_reason == "length" and len(only.prompt_logprobs) == len(p) - 1


def test_seeded_sampling_is_reproducible_in_any_batch(engine, tiny):
    _, tok = tiny
    p = tok.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=10)
    alone = collect(engine.submit(p, params)).token_ids
    noise = [engine.submit(tok.encode("noise " * k), SamplingParams(temperature=1.0, max_tokens=15))
             for k in range(1, 5)]
    again = engine.submit(p, params)
    assert collect(again).token_ids == alone
    for s in noise:
        collect(s)


def test_stop_token_ids_eos_and_ignore_eos(engine, tiny, reference):
    _, tok = tiny
    p = tok.encode("stop here")
    ref = reference(p, 8)
    out = collect(engine.submit(p, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(ref[2],))))
    assert out.token_ids == ref[:3] and out.finish_reason == "stop" and out.stop_reason == ref[2]
    out = collect(engine.submit(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_invalid_requests_and_overload(tiny):
    model, tok = tiny
    e = Engine(model, tok, EngineConfig(max_model_len=64, cache_lens=64, max_queued_requests=0))
    with pytest.raises(InvalidRequest, match="maximum context length"):
        e.make_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        e.make_request([10**7], SamplingParams())
    with pytest.raises(InvalidRequest, match="empty"):
        e.make_request([], SamplingParams())
    assert e.make_request(list(range(60)), SamplingParams()).max_tokens == 4  # the default fills the context
    with pytest.raises(EngineOverloaded):
        e.submit([1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model, tok, EngineConfig(max_model_len=100, cache_lens=64))


def test_a_failing_step_fails_its_requests_not_the_engine(tiny, monkeypatch):
    model, tok = tiny
    e = Engine(model, tok, EngineConfig()).start()
    try:
        calls = {"n": 0}

        def flaky(real):  # the second forward fails, through whichever path runs it
            def run(batch):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("boom")
                return real(batch)
            return run

        e.runner.model = flaky(e.runner.model)
        flat = e.runner.cpu_decode  # the CPU placement's decode steps take the flat step (ktrans.engine.cpu_decode)
        if flat is not None:
            e.runner.cpu_decode = type("Flaky", (), {"takes": staticmethod(flat.takes),
                                                     "__call__": lambda self, batch, run=flaky(flat): run(batch)})()
        first = collect(e.submit(tok.encode("a b c"), SamplingParams(temperature=0.0, max_tokens=5)))
        assert first.finish_reason == "error" and "boom" in first.error
        assert wait_idle(e) and pools_full(e)
        second = collect(e.submit(tok.encode("a b c"), SamplingParams(temperature=0.0, max_tokens=5)))
        assert second.finish_reason == "length" and len(second.token_ids) == 5
    finally:
        e.stop()


def test_penalties_reach_the_sampler(engine, tiny):
    _, tok = tiny
    p = tok.encode("repeat repeat repeat")
    out = collect(engine.submit(p, SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=2.0,
                                                  presence_penalty=2.0, ignore_eos=True)))
    plain = collect(engine.submit(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    assert len(out.token_ids) == 12
    assert len(set(out.token_ids)) >= len(set(plain.token_ids))
    assert torch.tensor(out.token_ids).unique().numel() == len(out.token_ids)  # no token twice under the penalty


def test_cache_size_from_a_memory_fraction(tiny):
    from ktrans.runtime.pools import KVPool
    from ktrans.api.server import ServeOptions, cache_lens_for_fraction, engine_config

    model, _ = tiny
    tokens = cache_lens_for_fraction(model, 0.001, num_slots=4)
    assert tokens > 0 and tokens * KVPool.bytes_per_token(model.config, torch.float32) < 0.01 * 2**40
    assert engine_config(ServeOptions(cache_memory_fraction=0.001), model).cache_lens > 0
    with pytest.raises(ValueError, match="cache_memory_fraction"):
        cache_lens_for_fraction(model, 1.5, num_slots=4)


def test_warm_up_runs_every_step_kind_and_leaves_nothing(tiny, reference):
    # Engine.warm_up (what `ktrans serve` runs before it listens): a whole-chunk prompt, decodes beside an odd and
    # a whole-chunk mixed step. Afterwards the pools are full, the prefix cache holds nothing and counts nothing, the
    # step counter is back at 0, and a request's greedy tokens are what they are alone.
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(max_batch_size=2, chunk_size=48, cache_lens=256))
    seen = []
    real_step = engine.runner.step
    engine.runner.step = lambda chunks: (seen.append([len(c.token_ids) for c in chunks]), real_step(chunks))[1]
    done = engine.warm_up()
    assert done["steps"] == len(seen) > 0 and engine.num_steps == 0
    assert [48] in seen  # one prompt, a whole step
    mixed = [sum(s) for s in seen if len(s) == 2 and max(s) > 1]
    assert any(n % 16 for n in mixed) and 48 in mixed  # decode + odd chunk, decode + a chunk filling the step
    assert [1, 1] in seen  # decode at batch 2
    assert not any(s.count(1) == 2 and len(s) == 3 for s in seen)  # the batch holds two: no two-decode mixed step
    engine = Engine(model, tok, EngineConfig(max_batch_size=3, chunk_size=48, cache_lens=256))
    seen.clear()
    real_step = engine.runner.step
    engine.runner.step = lambda chunks: (seen.append([len(c.token_ids) for c in chunks]), real_step(chunks))[1]
    engine.warm_up()
    assert any(len(s) == 3 and s.count(1) == 2 and max(s) > 1 for s in seen)  # two decode rows beside a chunk
    assert [1, 1, 1] in seen  # decode at the batch's largest graph bucket (Triton's tiles change with the rows)
    engine = Engine(model, tok, EngineConfig(max_batch_size=5, chunk_size=48, cache_lens=256))
    seen.clear()
    real_step = engine.runner.step
    engine.runner.step = lambda chunks: (seen.append([len(c.token_ids) for c in chunks]), real_step(chunks))[1]
    engine.warm_up()
    assert [1] * 4 in seen and [1] * 5 in seen  # buckets 4 and 5 (= --max_batch_size)
    assert [1, 1, 1, 1, 21] in seen  # four decode rows beside a prompt: a slot was left
    assert [1, 1, 1, 1, 44] in seen  # and beside a prompt that fills the step (the prefill kernels' long class)
    s = engine.stats()
    assert s["kv_pages_free"] == s["kv_pages"] and s["slots_free"] == s["slots"]
    assert s["prefix_cache_hits"] == 0 and s["prefix_cache_snapshots"] == 0 and s["num_preemptions"] == 0
    prompt = list(range(3, 40))
    out, _ = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))
    assert out.token_ids == reference(prompt, 6)


def test_warm_up_pretunes_the_ops_that_can(tiny, monkeypatch):
    """After its steps the warm-up hands the first op with a `pretune` on each device (the Triton attention's decode
    autotuning of long contexts, whose tunings every layer shares) the engine's KV pool."""
    import ktrans.engine.warmup as warmup

    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(max_batch_size=2, chunk_size=32, cache_lens=128))
    got = []
    Op = type("Op", (), {"pretune": lambda self, kv: got.append((self.device, kv))})
    ops = [Op(), Op(), Op()]
    for op, dev in zip(ops, ("cuda:0", "cuda:0", "cuda:1")):
        op.device = torch.device(dev)
    monkeypatch.setattr(warmup, "operator_ops", lambda m, method: ops if method == "pretune" else [])
    engine.warm_up()
    assert got == [(torch.device("cuda:0"), engine.kv), (torch.device("cuda:1"), engine.kv)]  # once per device


def test_warm_up_past_the_queue_limit_and_after_a_failing_step(tiny, monkeypatch):
    # Its requests are not users': --max_queued_requests 0 (every user request refused) still warms up. A step that
    # raises inside it ends its requests, so the pools are full again and the error reaches the caller.
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(max_batch_size=2, chunk_size=32, cache_lens=128,
                                             max_queued_requests=0))
    assert engine.warm_up()["steps"] > 0
    # a context shorter than a step: every warm-up request still fits it (prompt plus its tokens), and several
    # prompts fill one step together (the step's token count is what ops switch kernels by)
    engine = Engine(model, tok, EngineConfig(max_batch_size=3, chunk_size=64, cache_lens=128, max_model_len=30))
    seen = []
    real_step = engine.runner.step
    engine.runner.step = lambda chunks: (seen.append([len(c.token_ids) for c in chunks]), real_step(chunks))[1]
    assert engine.warm_up()["steps"] > 0
    assert [28, 28, 8] in seen, seen  # three prompts of 28 tokens: a 64-token step, the third one chunked
    assert pools_full(engine)
    engine = Engine(model, tok, EngineConfig(max_batch_size=2, chunk_size=32, cache_lens=128))
    calls = []
    real_step = engine.runner.step

    def failing(chunks):
        calls.append(len(chunks))
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step(chunks)

    monkeypatch.setattr(engine.runner, "step", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.warm_up()
    assert pools_full(engine) and engine.num_steps == 0 and not engine._tracked


def test_sampled_rows_are_a_view_when_consecutive():
    """A decode step's due rows lie one after the other in the step's logits: sampled from a view of them (no copy
    of the vocabulary-wide rows); rows that do not (a prefill's last row between others) are copied, same values."""
    from ktrans.engine.engine import _gathered

    logits = torch.randn(5, 7)
    view = _gathered([logits[i:i + 1] for i in range(1, 4)])
    assert torch.equal(view, logits[1:4]) and view.data_ptr() == logits[1].data_ptr()
    picked = [logits[0:1], logits[2:3], logits[4:5]]
    copy = _gathered(picked)
    assert torch.equal(copy, torch.cat(picked)) and copy.data_ptr() != logits.data_ptr()
