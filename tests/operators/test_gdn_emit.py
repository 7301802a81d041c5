"""States emitted inside a prefill chunk (SeqChunk.emit: the prefix cache's snapshots every
--prefix_cache_snapshot_interval tokens) equal the state of the same prefix computed alone, in both DeltaNet ops.

A 150-token prompt continuing a 37-token cached prefix emits at positions 64 and 128 (inside its chunk), beside a
sequence that emits nothing; the emitted conv windows and recurrent states of every DeltaNet layer are compared with
a fresh run of the first 64 and 128 tokens. fp32 on one device: the pieces sum in another order than one pass
(chunk boundaries move), so the states agree within 1e-4 of their largest value, not bitwise; the chunk's own
output and final state are those of an unsplit run within the same bound.
"""
from __future__ import annotations

import pytest
import torch

from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.runtime.pools import KVPool, StatePool

from ..inject.helpers import injected
from ..model.helpers import make_checkpoint
from .test_gdn_triton import SHAPE, default_rules

TOL = 1e-4
OPS = ["KGatedDeltaNetTorch", pytest.param("KGatedDeltaNetTriton", marks=pytest.mark.triton)]


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("op", OPS)
def test_emitted_states_equal_the_prefix_run_alone(tmp_path, op, triton_device):
    if op == "KGatedDeltaNetTriton":
        pytest.importorskip("triton")
    dev = str(triton_device) if op == "KGatedDeltaNetTriton" else "cpu"
    ckpt = make_checkpoint(tmp_path, "small", seed=3, **SHAPE)
    model, _ = injected(ckpt, default_rules(op), default_device=dev)
    cfg = model.config
    prompt = [(13 * i + 5) % 512 for i in range(37 + 150)]
    other = [(3 * i + 1) % 512 for i in range(23)]
    page = 8
    kv = KVPool(cfg, 4 * -(-len(prompt) // page), page, torch.float32, dev)
    states = StatePool(cfg, 8, torch.float32, dev)
    pages = list(range(-(-len(prompt) // page)))
    other_pages = list(range(len(pages), len(pages) + 3))
    alone_pages = list(range(len(pages) + 3, 2 * len(pages) + 3))

    def run(chunks):
        return model(ForwardBatch.build(chunks, kv, states, device=dev))

    run([SeqChunk(prompt[:37], 0, 0, pages)])
    with torch.no_grad():
        split = run([SeqChunk(prompt[37:], 37, 0, pages, logits="all", emit=((64, 4), (128, 5))),
                     SeqChunk(other, 0, 1, other_pages)])
    layers = list(states.layer_index)
    emitted = {slot: [tuple(t[slot].clone() for t in states.layer(l)) for l in layers] for slot in (4, 5, 0)}
    # unsplit: the same chunk without emits, from the same cached prefix (slot 2)
    run([SeqChunk(prompt[:37], 0, 2, alone_pages)])
    whole = run([SeqChunk(prompt[37:], 37, 2, alone_pages, logits="all")])
    assert _close(split[:-1], whole) < TOL  # the other sequence's row (its last token) comes last
    for l, (conv, ssm) in zip(layers, emitted[0]):
        c2, s2 = states.layer(l)
        assert _close(conv, c2[2]) < TOL and _close(ssm, s2[2]) < TOL
    # each emitted prefix computed alone, fresh, into slot 3
    for n, slot in ((64, 4), (128, 5)):
        run([SeqChunk(prompt[:n], 0, 3, alone_pages)])
        for l, (conv, ssm) in zip(layers, emitted[slot]):
            c3, s3 = states.layer(l)
            assert _close(conv, c3[3]) < TOL, f"{op}, layer {l}: conv window at {n}"
            assert _close(ssm, s3[3]) < TOL, f"{op}, layer {l}: recurrent state at {n}"


def test_emit_positions_are_checked():
    from ktrans.runtime.batch import flatten

    class _KV:
        page_size = 8

        @staticmethod
        def pages_for(n):
            return -(-n // 8)

    with pytest.raises(ValueError, match="outside the chunk"):
        flatten([SeqChunk([1] * 10, 5, 0, [0, 1], emit=((15, 3),))], _KV())
    flat = flatten([SeqChunk([1] * 3, 0, 0, [0]), SeqChunk([1] * 10, 5, 1, [0, 1], emit=((8, 3),))], _KV())
    assert flat.emits == [(), ((8, 3),)]
    assert flatten([SeqChunk([1] * 3, 0, 0, [0])], _KV()).emits is None
