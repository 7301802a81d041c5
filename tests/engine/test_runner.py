"""ModelRunner: batches built into fixed buffers equal ForwardBatch.build's, run the same forward, and say why a
step does not fit."""
from __future__ import annotations

import os

import pytest
import torch

from ktrans.config import ModelConfig
from ktrans.engine.runner import ModelRunner
from ktrans.model.tiny import preset_config
from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.runtime.pools import KVPool, StatePool


@pytest.fixture(scope="module")
def pools():
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    return KVPool(config, num_pages=40, page_size=4), StatePool(config, num_slots=6)


def _runner(pools, **kw):
    kv, states = pools
    model = torch.nn.Linear(1, 1)  # prepare() needs only the pools and a device
    args = dict(max_num_seqs=5, max_num_tokens=23, max_pages_per_seq=9, device="cpu") | kw
    return ModelRunner(model, kv, states, **args)


CHUNKS = [SeqChunk([5, 6, 7], 0, 2, [3, 4]), SeqChunk([9], 6, 0, [0, 1], logits="last"),
          SeqChunk([1, 2, 3, 4, 5], 2, 4, [7, 8], logits="all"), SeqChunk([8], 13, 1, [10, 11, 12, 13])]


def test_prepare_equals_build(pools):
    kv, states = pools
    runner = _runner(pools)
    got = runner.prepare(CHUNKS)
    want = ForwardBatch.build(CHUNKS, kv, states)
    for f in ForwardBatch.INDEX_FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        if f == "block_tables":  # the runner's tables are full width, -1 past the end
            assert (g[:, : w.shape[1]] == w).all() and (g[:, w.shape[1]:] == -1).all()
        else:
            assert torch.equal(g, w), f
    assert got.seq_lens == want.seq_lens and got.cached_lens == want.cached_lens
    assert got.slots == [2, 0, 4, 1] and got.is_decode == want.is_decode is False
    assert torch.equal(got.cu_seqlens, want.cu_seqlens)
    assert got.kv_lens_t.tolist() == want.kv_lens == [3, 7, 7, 14]
    assert got.cu_seqlens_t.tolist() == got.cu_seqlens_host == [0, 3, 4, 9, 10]


def test_buffers_keep_their_addresses(pools):
    runner = _runner(pools)
    first = runner.prepare(CHUNKS)
    ptrs = {f: getattr(first, f).data_ptr() for f in ForwardBatch.INDEX_FIELDS}
    second = runner.prepare([SeqChunk([4], 3, 1, [2]), SeqChunk([2], 9, 0, [5, 6, 7])])
    assert second.is_decode
    for f in ForwardBatch.INDEX_FIELDS:
        assert getattr(second, f).data_ptr() == ptrs[f], f
    assert second.input_ids.tolist() == [4, 2] and second.slot_mapping.tolist() == [2 * 4 + 3, 7 * 4 + 1]


@pytest.mark.parametrize("chunks, match", [
    ([SeqChunk([1] * 24, 0, 0, list(range(6)))], "24 tokens in a step, the runner holds 23"),
    ([SeqChunk([1], 0, i, [i]) for i in range(6)], "6 sequences in a step, the runner holds 5"),
    ([SeqChunk([1], 0, 0, list(range(10)))], "10 KV pages, the runner's block tables hold 9"),
    ([SeqChunk([1, 2], 3, 0, [0])], "needs 2 KV pages for 5 tokens, has 1"),
    ([SeqChunk([], 0, 0, [0])], "no new tokens"),
    ([SeqChunk([1], 0, 0, [0], logits="some")], "logits must be"),
])
def test_what_does_not_fit_is_named(pools, chunks, match):
    with pytest.raises(ValueError, match=match):
        _runner(pools).prepare(chunks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_has_a_host_twin(pools):
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    kv, states = KVPool(config, 40, 4, device="cuda"), StatePool(config, 6, device="cuda")
    runner = ModelRunner(torch.nn.Linear(1, 1).cuda(), kv, states, 5, 23, 9)
    batch = runner.prepare(CHUNKS)
    host = batch.on("cpu")
    assert batch.input_ids.is_cuda and host.input_ids.device.type == "cpu" and host.input_ids.is_pinned()
    for f in ForwardBatch.INDEX_FIELDS:
        assert torch.equal(getattr(batch, f).cpu(), getattr(host, f)), f


def test_pad_rows_write_only_to_the_pad_page_and_slot(pools):
    kv, states = pools
    runner = _runner(pools)
    live = [SeqChunk([4], 3, 1, [2]), SeqChunk([2], 9, 0, [5, 6, 7])]
    batch = runner.prepare(live, pad_to=4, kv_len_bucket=16)
    assert batch.is_decode and batch.num_seqs == 4 and batch.num_live == 2
    assert batch.slots == [1, 0, states.pad_slot, states.pad_slot]
    pad_row = kv.pad_page * kv.page_size + 1  # position 1 of the pad page
    assert batch.slot_mapping.tolist() == [2 * 4 + 3, 7 * 4 + 1, pad_row, pad_row]
    assert batch.block_tables[2:, 0].tolist() == [kv.pad_page] * 2
    assert batch.max_kv_len == 16 and batch.logits_indices.tolist() == [0, 1, 2, 3]
    # the pools hold their pad page and slot beyond the usable ones
    assert kv.k[0].shape[0] == (kv.num_pages + 1) * kv.page_size and states.conv[0].shape[0] == states.num_slots + 1
    unpadded = runner.prepare(live)
    assert unpadded.num_live is None and unpadded.max_kv_len == 10


def test_buckets():
    from ktrans.engine.graphs import batch_buckets, kv_bucket

    assert batch_buckets(1) == [1] and batch_buckets(16) == [1, 2, 4, 8, 16] and batch_buckets(12) == [1, 2, 4, 8, 12]
    assert [kv_bucket(n, 4096) for n in (1, 128, 129, 1000, 4096)] == [128, 128, 256, 1024, 4096]
    assert kv_bucket(3000, 2048 + 16) == 3000  # capped by the tables, never below the longest sequence
    assert kv_bucket(100, 64) == 100


def test_padded_decode_equals_unpadded_on_the_live_rows():
    """The padding itself changes nothing for the live sequences beyond rounding (fp32 on the CPU, reference ops:
    matmuls of other sizes sum in other orders; measured 2.3e-5 at most on logits of magnitude ~1, bound 1e-4)."""
    from ktrans.inject import build_injected_model, pool_devices
    from ktrans.config import RULES_DIR
    from ktrans.model.tiny import random_state_dict
    from ktrans.weights.source import StateDictSource

    config = ModelConfig.from_hf_dict(preset_config("small"), source="small")
    model, _ = build_injected_model(config, RULES_DIR / "Qwen3Next-default.yaml",
                                    StateDictSource(random_state_dict(config, 1)), torch.float32)
    logits = []
    for pad in (None, 4):
        kv, states = KVPool(config, 8, 16), StatePool(config, 3)
        runner = ModelRunner(model, kv, states, max_num_seqs=4, max_num_tokens=32, max_pages_per_seq=4)
        prompts = [list(range(3, 14)), list(range(40, 47)), list(range(7, 30))]
        for slot, p in enumerate(prompts):
            runner.step([SeqChunk(p, 0, slot, [2 * slot, 2 * slot + 1])])
        chunks = [SeqChunk([5 + i], len(p), i, [2 * i, 2 * i + 1]) for i, p in enumerate(prompts)]
        steps = []
        for _ in range(3):
            out = runner.forward(runner.prepare(chunks, pad_to=pad, kv_len_bucket=64 if pad else 0))[:3]
            steps.append(out)
            chunks = [SeqChunk([int(o.argmax())], c.cached_len + 1, c.state_slot, c.pages) for o, c in zip(out, chunks)]
        logits.append(torch.stack(steps))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_cpu_modules_block_graphs():
    """A module computing on the CPU at decode would be skipped by a replay: the runner then decodes eagerly."""
    from ktrans.config import RULES_DIR
    from ktrans.engine.graphs import graph_blockers
    from ktrans.inject import build_injected_model
    from ktrans.model.tiny import random_state_dict
    from ktrans.weights.source import StateDictSource

    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    model, _ = build_injected_model(config, RULES_DIR / "Qwen3Next-cpu.yaml",
                                    StateDictSource(random_state_dict(config, 0)), torch.float32)
    blockers = graph_blockers(model)
    assert "model.embed_tokens" in blockers and "lm_head" in blockers


def test_decode_threads_hold_for_decode_steps_only(pools):
    """runner.decode_threads (the CPU placement's A/B of torch's threads at decode): the model runs a decode step
    with that many torch threads and a prefill step with torch's own; torch's setting is back after each, also
    when the forward raises."""
    seen, cpus = [], []

    class Model(torch.nn.Module):
        def forward(self, batch):
            seen.append(torch.get_num_threads())
            cpus.append(os.sched_getaffinity(0))
            if batch.input_ids.numel() > 3:
                raise RuntimeError("a failing step")
            return torch.zeros(batch.logits_indices.numel(), 4)

    kv, states = pools
    runner = ModelRunner(Model(), kv, states, max_num_seqs=5, max_num_tokens=23, max_pages_per_seq=9, device="cpu")
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner.decode_threads = 1
        runner.forward(runner.prepare([SeqChunk([5], 3, 0, [0, 1])]))  # decode
        runner.forward(runner.prepare([SeqChunk([5, 6], 0, 0, [0, 1])]))  # prefill
        with pytest.raises(RuntimeError, match="failing"):
            runner.forward(runner.prepare([SeqChunk([1], 3, 0, [0, 1]), SeqChunk([2], 3, 1, [2, 3]),
                                           SeqChunk([3], 3, 2, [4, 5]), SeqChunk([4], 3, 3, [6, 7])]))
        assert seen == [1, 2, 1] and torch.get_num_threads() == 2
        # runner.decode_cpu: the calling thread on that core during decode steps only, its cores back after
        allowed = os.sched_getaffinity(0)
        runner.decode_threads, runner.decode_cpu, one = None, min(allowed), min(allowed)
        cpus.clear()
        runner.forward(runner.prepare([SeqChunk([5], 3, 0, [0, 1])]))
        runner.forward(runner.prepare([SeqChunk([5, 6], 0, 0, [0, 1])]))
        assert cpus == [{one}, allowed] and os.sched_getaffinity(0) == allowed
    finally:
        torch.set_num_threads(was)
