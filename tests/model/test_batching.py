"""Batch-agnostic forward: chunked prefill, mixed batches and decode steps equal one sequence in one pass."""
from __future__ import annotations

import pytest
import torch

from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.engine.cache import CacheManager

from .helpers import OTHER_SHAPE, load, make_checkpoint, pools, run_chunks

TOL = 1e-5  # fp32; relative to the largest logit


@pytest.fixture(scope="module", params=["small", "other"])
def model(request, tmp_path_factory):
    overrides = OTHER_SHAPE if request.param == "other" else {}
    return load(make_checkpoint(tmp_path_factory.mktemp(request.param), "small", seed=5, **overrides))


def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    err = (a - b).abs().max() / b.abs().max()
    assert err < tol, f"relative max error {err:.2e} >= {tol:.0e}"


def _states(states, slot: int):
    return [c[slot].clone() for c in states.conv], [s[slot].clone() for s in states.ssm]


def test_chunked_prefill_equals_one_pass(model):
    prompt = _ids(90, 1)
    (one,), st1, (s1,) = run_chunks(model, [prompt])
    # chunks of 1, 7 and 13 tokens, then the rest; with pages of 8 the chunks straddle page boundaries
    plan = [1, 7, 13, len(prompt) - 21]
    (chunked,), st2, (s2,) = run_chunks(model, [prompt], [plan])
    _close(chunked, one)
    conv1, ssm1 = _states(st1, s1)
    conv2, ssm2 = _states(st2, s2)
    for a, b in zip(conv1 + ssm1, conv2 + ssm2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_every_chunk_size_one(model):
    prompt = _ids(23, 2)
    (one,), _, _ = run_chunks(model, [prompt])
    (steps,), _, _ = run_chunks(model, [prompt], [[1] * len(prompt)])
    _close(steps, one)


def test_batch_of_four_equals_each_alone(model):
    prompts = [_ids(n, 10 + n) for n in (1, 9, 33, 70)]
    alone = [run_chunks(model, [p])[0][0] for p in prompts]
    together, _, _ = run_chunks(model, prompts)
    for a, b in zip(together, alone):
        _close(a, b)
    # and mixed: different chunk plans per sequence in the same steps (prefill next to one-token steps)
    plans = [[1], [4, 5], [1, 1, 31], [30, 1, 39]]
    mixed, _, _ = run_chunks(model, prompts, plans)
    for a, b in zip(mixed, alone):
        _close(a, b)


def test_decode_batch_equals_prefill(model):
    """Prefill 3 prompts, then decode each with one-token steps in a pure decode batch (is_decode path)."""
    prompts = [_ids(n, 40 + n) for n in (5, 12, 19)]
    cont = [_ids(6, 60 + i) for i in range(3)]
    full = [run_chunks(model, [p + c])[0][0] for p, c in zip(prompts, cont)]

    kv, states = pools(model, 3, 32)
    cache = CacheManager.from_pools(kv, states)
    pages = [cache.alloc_pages(kv.pages_for(32)) for _ in prompts]
    slots = [cache.alloc_slot() for _ in prompts]
    model(ForwardBatch.build([SeqChunk(p, 0, s, pg) for p, s, pg in zip(prompts, slots, pages)], kv, states))
    for step in range(6):
        chunks = [SeqChunk([c[step]], len(p) + step, s, pg) for p, c, s, pg in zip(prompts, cont, slots, pages)]
        batch = ForwardBatch.build(chunks, kv, states)
        assert batch.is_decode
        out = model(batch)
        for i in range(3):
            _close(out[i], full[i][len(prompts[i]) + step])


def test_slot_reuse_starts_from_zero_state(model):
    """A slot that held another request's state must not leak into a new request (cached_len 0)."""
    a, b = _ids(20, 7), _ids(15, 8)
    (ref,), _, _ = run_chunks(model, [b])
    kv, states = pools(model, 1, 20)
    cache = CacheManager.from_pools(kv, states)
    pages = cache.alloc_pages(kv.pages_for(20))
    slot = cache.alloc_slot()
    model(ForwardBatch.build([SeqChunk(a, 0, slot, pages)], kv, states))
    out = model(ForwardBatch.build([SeqChunk(b, 0, slot, pages, logits="all")], kv, states))
    _close(out, ref)


def test_bfloat16_no_worse_than_transformers_bfloat16(tmp_path):
    """bf16 drifts from fp32 (rms ~4% of the logit scale on this model); ours must drift no more than HF's."""
    transformers = pytest.importorskip("transformers")
    path = make_checkpoint(tmp_path, "small", seed=9)
    prompt = _ids(40, 3)
    ref = run_chunks(load(path), [prompt])[0][0]
    got = run_chunks(load(path, torch.bfloat16), [prompt], [[17, 23]])[0][0]
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt])).logits[0].float()

    def rms_err(x):
        return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()

    assert rms_err(got) < 1.5 * rms_err(hf_logits), (rms_err(got), rms_err(hf_logits))
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
