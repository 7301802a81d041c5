"""A decode step: logits against transformers step by step, and a forward that reads nothing back from the device.

The decode path differs from prefill (the batched decode attention kernel, experts gathered per token instead of
grouped per expert, DeltaNet's batched one-token kernels), so it is checked on its own against transformers'
Qwen3NextForCausalLM: prefill two prompts together, then feed transformers' own continuation one token per step in
pure decode batches, every step's logits within the parity tolerance. After `plan_model`, the forward of a
decode-only step must not call tolist/item/int/bool/float/index on a tensor, nor unique/nonzero/cpu/numpy or a
synchronize: on a GPU each of those is a device->host wait. (On the CPU no call can be told apart by device, so
none is allowed at all; the GPU test of the runner checks the CUDA side.)
"""
from __future__ import annotations

import traceback

import pytest
import torch

from ktrans.model.qwen3_next import Qwen3NextAttention, Qwen3NextForCausalLM, Qwen3NextSparseMoeBlock
from ktrans.operators.base import plan_model
from ktrans.runtime.batch import ForwardBatch, SeqChunk

from .helpers import OTHER_SHAPE, load, make_checkpoint, pools

SHAPES = {"small": {}, "other": OTHER_SHAPE}
PROMPTS, STEPS = (5, 12), 6


@pytest.fixture(scope="module", params=list(SHAPES))
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), "small", seed=5, **SHAPES[request.param])


@pytest.fixture(scope="module")
def model(ckpt):
    return load(ckpt)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefilled(model, prompts: list[list[int]], tokens: int):
    """Pools with the prompts prefilled (one batch); returns (kv, states, pages, slots)."""
    kv, states = pools(model, len(prompts), tokens)
    pages = [list(range(i * kv.pages_for(tokens), (i + 1) * kv.pages_for(tokens))) for i in range(len(prompts))]
    slots = list(range(len(prompts)))
    model(ForwardBatch.build([SeqChunk(p, 0, s, pg) for p, s, pg in zip(prompts, slots, pages)], kv, states))
    return kv, states, pages, slots


def _decode_batch(step: int, prompts, conts, kv, states, pages, slots) -> ForwardBatch:
    chunks = [SeqChunk([c[step]], len(p) + step, s, pg) for p, c, s, pg in zip(prompts, conts, slots, pages)]
    batch = ForwardBatch.build(chunks, kv, states)
    assert batch.is_decode
    return batch


def test_decode_steps_match_transformers(ckpt, model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompts = [_ids(n, 30 + n) for n in PROMPTS]
    conts = [_ids(STEPS, 40 + i) for i in range(len(prompts))]
    with torch.no_grad():
        refs = [hf(torch.tensor([p + c])).logits[0].float() for p, c in zip(prompts, conts)]
    kv, states, pages, slots = _prefilled(model, prompts, max(PROMPTS) + STEPS)
    for step in range(STEPS):
        batch = _decode_batch(step, prompts, conts, kv, states, pages, slots)
        plan_model(model, batch)
        got = model(batch)
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            want = ref[len(p) + step]
            err = ((got[i] - want).abs().max() / ref.abs().max()).item()
            assert err < 1e-4, f"decode step {step}, sequence {i}: max |ktrans - HF| / max |HF| = {err:.2e}"


class _Reads:
    """Patches every way a forward can read a tensor back to the host and records who did."""

    TENSOR = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__", "nonzero", "unique", "cpu", "numpy")
    TORCH = ("unique", "nonzero", "unique_consecutive", "bincount")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.TENSOR:
            monkeypatch.setattr(torch.Tensor, name, self._spy(f"Tensor.{name}", getattr(torch.Tensor, name)))
        for name in self.TORCH:
            monkeypatch.setattr(torch, name, self._spy(f"torch.{name}", getattr(torch, name)))
        monkeypatch.setattr(torch.cuda, "synchronize", self._spy("torch.cuda.synchronize", torch.cuda.synchronize))
        self.armed = False

    def _spy(self, what, fn):
        def spy(*args, **kwargs):
            if self.armed:
                where = traceback.extract_stack(limit=2)[0]  # the caller
                self.calls.append(f"{what} at {where.filename.rsplit('/', 2)[-2:]}:{where.lineno}")
            return fn(*args, **kwargs)

        return spy


def test_decode_forward_reads_nothing_back(model, monkeypatch):
    prompts = [_ids(n, 50 + n) for n in (3, 9, 1)]
    conts = [_ids(3, 60 + i) for i in range(len(prompts))]
    kv, states, pages, slots = _prefilled(model, prompts, 16)
    reads = _Reads(monkeypatch)
    for step in range(3):
        batch = _decode_batch(step, prompts, conts, kv, states, pages, slots)
        plan_model(model, batch)  # plan reads host lists; excluded
        reads.armed = True
        model(batch)
        reads.armed = False
    assert reads.calls == []


def test_unplanned_forward_plans_itself(model):
    """A direct model call (no plan_model) gives the same logits: each op plans the step it was not planned for."""
    prompts = [_ids(n, 70 + n) for n in (4, 7)]
    conts = [_ids(2, 80 + i) for i in range(len(prompts))]
    out = []
    for planned in (True, False):
        kv, states, pages, slots = _prefilled(model, prompts, 12)
        for step in range(2):
            batch = _decode_batch(step, prompts, conts, kv, states, pages, slots)
            if planned:
                plan_model(model, batch)
            out.append(model(batch))
    n = len(out) // 2
    for a, b in zip(out[:n], out[n:]):
        assert torch.equal(a, b)


def test_the_skeleton_does_not_run(ckpt):
    """Without injection the HF-named tree has no math: calling a layer says what to do."""
    from ktrans.config import ModelConfig

    config = ModelConfig.from_json(ckpt / "config.json")
    with torch.device("meta"):
        tree = Qwen3NextForCausalLM(config)
    layer = next(m for m in tree.modules() if isinstance(m, (Qwen3NextAttention, Qwen3NextSparseMoeBlock)))
    with pytest.raises(RuntimeError, match="its math is its operator's. Load the model with ktrans.inject.load_model"):
        layer(torch.zeros(1, config.hidden_size, device="meta"))
