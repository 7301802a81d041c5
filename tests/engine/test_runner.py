"""ModelRunner: batches built into fixed buffers equal ForwardBatch.build's, run the same forward, and say why a
step does not fit."""
from __future__ import annotations

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
