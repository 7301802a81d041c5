"""CUDA-graph decode (ktrans.engine.graphs) and the CPU experts on the CUDA stream (needs CUDA; skipped without).

- Replay against eager at the same padded bucket: the same kernels on the same shapes, so the greedy tokens must be
  identical, over 64 steps at batch 1, 3 and 8 with mixed prompt lengths, a request that joins and requests that
  leave between replays, under the gpu placement (reference ops) and the serve placement (CPU experts in the graph).
- Against the unpadded eager step, teacher-forced (the eager step's greedy tokens fed to both for 64 steps): logits
  within TOL and the same argmax wherever the reference's top-2 margin exceeds 2 TOL.
- The CPU experts on the stream give bitwise the blocking path's logits (both compute fp32 from the same bf16 rows).
"""
from __future__ import annotations

import pytest
import torch

from ktrans.engine.engine import Engine, EngineConfig
from ktrans.engine.sampler import SamplingParams
from ktrans.kernels import cpu_stream
from ktrans.runtime.batch import SeqChunk

from tests.engine.test_no_host_sync import _model
from tests.model.helpers import default_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PLACEMENTS = ["Qwen3Next-gpu.yaml", "Qwen3Next-serve-cpuexperts.yaml"]
TOL = 0.08  # bf16 logits of the `small` model (|logits| up to ~5): other matmul shapes round differently
PROMPT_LENS = [5, 40, 17, 131, 9, 64, 23, 3]


@pytest.fixture(scope="module", params=PLACEMENTS)
def model(request):
    return _model(request.param)[0]


def _serve(model, n: int, capture: bool) -> tuple[list[list[int]], int]:
    """n requests of mixed lengths (request 0 runs 64 steps, the others leave earlier), plus one that joins after
    10 steps when n > 1; greedy. Returns every request's tokens and the number of graph replays."""
    engine = Engine(model, default_tokenizer(), EngineConfig(max_batch_size=8, chunk_size=256, cache_lens=4096,
                                                             use_cuda_graph=True))
    engine.runner.graphs.capture = capture
    gen = torch.Generator().manual_seed(n)

    def submit(i: int, max_tokens: int):
        prompt = torch.randint(0, 1000, (PROMPT_LENS[i % len(PROMPT_LENS)],), generator=gen).tolist()
        return engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    streams = [submit(i, 64 if i == 0 else 20 + 7 * i) for i in range(n)]
    polls = 0
    while engine.poll():
        polls += 1
        if polls == 10 and n > 1:
            streams.append(submit(n, 30))
    outs = [[t for o in s.drain() for t in o.token_ids] for s in streams]
    return outs, engine.runner.graphs.num_replays


@pytest.mark.parametrize("n", [1, 3, 8])
def test_replay_equals_eager_at_the_same_bucket(model, n):
    replayed, replays = _serve(model, n, capture=True)
    eager, none = _serve(model, n, capture=False)
    assert replays > 0 and none == 0
    assert [len(o) for o in replayed] == [len(o) for o in eager] and len(replayed[0]) == 64
    assert replayed == eager


def test_replay_against_unpadded_eager_teacher_forced(model):
    """Three sequences (a 3-row batch pads to the 4 bucket), 64 steps fed the unpadded eager step's tokens."""
    runners = [_model_runner(model, graphs) for graphs in (False, True)]
    prompts = [list(range(3, 14)), list(range(40, 87)), list(range(7, 30))]
    pages = [[4 * i + j for j in range(4)] for i in range(3)]
    decode_teacher_forced(runners, prompts, pages, TOL, "eager")


def prefill(runners, prompts, pages) -> None:
    """Each prompt in one step on every runner, slot i for prompt i."""
    for r in runners:
        for slot, (p, pg) in enumerate(zip(prompts, pages)):
            r.step([SeqChunk(p, 0, slot, pg)])


def forced_decode(runners, prompts, pages, steps: int):
    """After the prompts' prefill: `steps` decode steps on every runner, all fed the first runner's greedy tokens;
    yields each step's fp32 logits, one tensor a runner."""
    lens, tokens = [len(p) for p in prompts], [p[-1] for p in prompts]
    for _ in range(steps):
        chunks = [SeqChunk([t], n, i, pages[i]) for i, (t, n) in enumerate(zip(tokens, lens))]
        logits = [r.step(chunks).float() for r in runners]
        yield logits
        tokens = logits[0].argmax(-1).tolist()
        lens = [n + 1 for n in lens]


def teacher_forced_steps(runners, prompts, pages, tol: float, steps: int = 64) -> tuple[float, list[int]]:
    """After the prompts' prefill on both runners: `steps` decode steps fed the first (reference) runner's greedy
    tokens. Returns the largest |logits difference| and the steps where the argmax differs although the reference's
    top-2 margin exceeds 2 tol."""
    worst, disagreements = 0.0, []
    for step, (ref, got) in enumerate(forced_decode(runners, prompts, pages, steps)):
        # a NaN would compare as no difference (max(0.0, nan) is 0.0): non-finite logits are the worst case
        finite = bool(torch.isfinite(ref).all() and torch.isfinite(got).all())
        worst = max(worst, float((got - ref).abs().max()) if finite else float("inf"))
        top2 = ref.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * tol
        if not torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure]):
            disagreements.append(step)
    return worst, disagreements


def decode_teacher_forced(runners, prompts, pages, tol: float, what: str) -> None:
    """Prefill each prompt on both runners (reference first, graphs second), then 64 decode steps fed the
    reference's tokens: logits within `tol`, the same argmax wherever the reference's top-2 margin exceeds 2 tol,
    and the second runner replayed its graphs."""
    prefill(runners, prompts, pages)
    worst, disagreements = teacher_forced_steps(runners, prompts, pages, tol)
    assert runners[1].graphs.num_replays >= 60
    assert worst <= tol, f"max |logits - {what}| = {worst:.4f} over 64 steps"
    assert not disagreements, f"argmax differs where the margin exceeds {2 * tol}: steps {disagreements}"


def noise_floor_teacher_forced(oracle, reference, candidate, prompts, pages, steps: int = 64
                               ) -> tuple[list[float], list[float], list[int]]:
    """For ops that differ in a dtype whose rounding a random model amplifies past any fixed bound: prefill each
    prompt on the three runners, then `steps` decode steps fed the oracle's (fp32) greedy tokens. Returns, per step,
    max |reference - oracle| (the reference op's own rounding error in the low dtype: the noise floor), max
    |candidate - oracle|, and the steps where the candidate's argmax differs from the oracle's although the
    oracle's top-2 margin exceeds twice that step's noise floor."""
    runners = (oracle, reference, candidate)
    prefill(runners, prompts, pages)
    floor, errs, disagreements = [], [], []
    for step, (want, ref, got) in enumerate(forced_decode(runners, prompts, pages, steps)):
        floor.append(float((ref - want).abs().max()))
        errs.append(float((got - want).abs().max()) if torch.isfinite(got).all() else float("inf"))
        top2 = want.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * floor[-1]
        if not torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure]):
            disagreements.append(step)
    return floor, errs, disagreements


def _model_runner(model, graphs: bool, max_num_tokens: int = 64, max_pages_per_seq: int = 4,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cuda"):
    from ktrans.engine.runner import ModelRunner
    from ktrans.inject import pool_devices
    from ktrans.runtime.pools import KVPool, StatePool

    kv_dev, state_dev = pool_devices(model)
    kv = KVPool(model.config, 16, 32, dtype, kv_dev)
    states = StatePool(model.config, 4, dtype, state_dev)
    return ModelRunner(model, kv, states, max_num_seqs=4, max_num_tokens=max_num_tokens,
                       max_pages_per_seq=max_pages_per_seq, device=device, cuda_graph=graphs)


def test_cpu_experts_on_the_stream_equal_the_blocking_path(monkeypatch):
    model = _model("Qwen3Next-serve-cpuexperts.yaml")[0]
    outs = []
    for stream in (True, False):
        if not stream:
            monkeypatch.setattr(cpu_stream, "available", lambda: (False, "disabled by the test"))
        runner = _model_runner(model, graphs=False)
        logits = [runner.step([SeqChunk(list(range(5, 40)), 0, 0, [0, 1])])]
        logits.append(runner.step([SeqChunk([9], 35, 0, [0, 1])]))
        outs.append(torch.cat(logits))
    assert torch.equal(outs[0], outs[1])


def test_no_garbage_collection_inside_a_capture(model, monkeypatch):
    """A collection inside a capture may free a dropped engine's pinned or registered host memory, which is illegal
    while capturing and invalidates the capture (session 19: the prefix cache's reference engine under the serve
    rules). DecodeGraphs turns the collector off for the capture and back on after it: with a threshold that would
    collect at every allocation, no collection starts while a capture is under way, and the collector is on after."""
    import gc

    starts = []

    def watch(phase, info):
        if phase == "start":
            starts.append(torch.cuda.is_current_stream_capturing())

    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1)  # a generation-0 collection at (nearly) every allocation, as a busy server's heap may see
    try:
        tokens, replays = _serve(model, 1, capture=True)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert replays > 0 and len(tokens[0]) == 64
    assert starts and not any(starts), "a garbage collection started during a CUDA graph capture"
    assert gc.isenabled()
