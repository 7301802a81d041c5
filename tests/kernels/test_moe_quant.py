"""The Triton MoE on packed GGUF experts (ktrans.kernels.triton.moe_quant) against the torch reference MoE
(ktrans.kernels.torch.moe.moe_experts) on gguf-py's dequantized weights, in float64: the per-pair path (3 tokens),
the sorted padded blocks (20 tokens: BM=16 integer-code dots; 80 for the bf16 dequant-tile path), with an expert
nobody routes to, a skipped slot (id -1) and a strided activation. Marked `triton` (interpreted without a GPU); on a
GPU also replayed from CUDA graphs.

Tolerance, relative Frobenius error: 2e-5 on the fp32 paths (up to 4 tokens, fp32 activations), 2e-2 where x and h
enter the tensor-core dot as bf16 (more tokens) or the output is bf16.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf.quants")
from ktrans.kernels.torch.moe import moe_experts  # noqa: E402
from ktrans.kernels.torch.quant import dequantize_packed  # noqa: E402
from ktrans.kernels.triton.quant_layout import concat_rows, repack  # noqa: E402
from tests.kernels.test_quant_layout import random_blocks  # noqa: E402

pytestmark = pytest.mark.triton
E, H, I, K = 6, 256, 256, 3


def _stack(qtype: str, rows: int, cols: int, seed: int, device):
    import numpy as np

    raw = np.stack([random_blocks(qtype, rows, cols, seed + e) for e in range(E)])
    return repack(torch.from_numpy(raw), qtype, (E, rows, cols), device)


def _layer(device, down_type: str = "Q6_K", h: int = H):
    gate, up = _stack("Q4_K", I, h, 0, device), _stack("Q4_K", I, h, 100, device)
    down = _stack(down_type, h, I, 200, device)
    ref = [dequantize_packed(w.to("cpu")).double() for w in (gate, up, down)]
    return concat_rows([gate, up]), down, ref


def _routing(t: int, device, seed: int | None = None):
    g = torch.Generator().manual_seed(t if seed is None else seed)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(t)])  # expert E-1: never routed
    weights = torch.rand(t, K, generator=g)
    return ids.to(device), weights.to(device)


def _err(y, ref) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("t", [3, 20])
def test_against_the_reference(t, triton_device, monkeypatch):
    """The tile path (the lanes path, which takes these sizes by default, has its own tests below)."""
    from ktrans.kernels.triton.moe_quant import moe_quant

    gate_up, down, (g, u, d) = _layer(triton_device)
    ids, weights = _routing(t, triton_device)
    ids[0, 1] = -1  # a skipped slot
    # x of a few units: the dequantized random blocks are large, keep silu away from overflow
    x = (torch.randn(t, 2 * H, device=triton_device) * 1e-3)[:, :H]
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    from ktrans.kernels.triton import moe_quant as mq

    monkeypatch.setitem(mq.LANES, "on", False)
    seen = []
    real = mq.align
    monkeypatch.setattr(mq, "align", lambda *a: seen.append(a[2]) or real(*a))  # the block height it took
    y = moe_quant(x, ids, weights, gate_up, down)
    assert seen == ([] if t <= mq.DIRECT_MAX_TOKENS else [16])
    assert y.shape == (t, H) and y.dtype == torch.float32
    assert _err(y, ref) < (2e-5 if t <= 4 else 2e-2), t


def test_prefill_tiles_and_bf16(triton_device):
    """80 tokens * 3 slots over 6 experts: 40 rows per expert, the BM=64 dequantize-to-bf16 path."""
    from ktrans.kernels.triton.moe_quant import align, moe_quant

    gate_up, down, (g, u, d) = _layer(triton_device, "Q8_0")
    ids, weights = _routing(80, triton_device)
    x = (torch.randn(80, H, device=triton_device) * 1e-3).to(torch.bfloat16)
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    y = moe_quant(x, ids, weights, gate_up, down)
    assert y.dtype == torch.bfloat16 and _err(y, ref) < 2e-2
    rows, bexp = align(ids, E, 64)
    valid = rows < ids.numel()
    assert sorted(rows[valid].tolist()) == list(range(ids.numel()))  # every pair exactly once
    per_block = rows.view(-1, 64)
    flat = ids.reshape(-1)
    for b, e in enumerate(bexp.tolist()):
        got = per_block[b][per_block[b] < ids.numel()].long()
        assert (e >= 0) == (got.numel() > 0) and bool((flat[got] == e).all())


@pytest.mark.gpu
@pytest.mark.parametrize("t, lanes", [(1, False), (16, False), (1, True), (16, True)])
def test_captured_in_a_cuda_graph(t, lanes, monkeypatch):
    """Both block paths (and the few-token lanes path) replay from a CUDA graph with new routing and activations
    written into the captured buffers, and give what an eager call gives (the captured call reads nothing back to
    the host)."""
    from ktrans.kernels.triton import moe_quant as mq
    from ktrans.kernels.triton.moe_quant import moe_quant

    monkeypatch.setitem(mq.LANES, "on", lanes)

    dev = torch.device("cuda")
    gate_up, down, _ = _layer(dev)
    ids, weights = _routing(t, dev)
    x = torch.randn(t, H, device=dev).to(torch.bfloat16) * 1e-3
    moe_quant(x, ids, weights, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_quant(x, ids, weights, gate_up, down)
    ids2, weights2 = _routing(t, dev, seed=t + 100)  # new routing, same shape
    ids.copy_(ids2)
    weights.copy_(weights2)
    x.copy_(torch.randn(t, H, device=dev).to(torch.bfloat16) * 1e-3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_quant(x, ids, weights, gate_up, down))


@pytest.mark.parametrize("down_type", ["Q6_K", "Q4_K", "Q8_0"])
def test_lanes_path_against_the_reference(down_type, triton_device, monkeypatch):
    """moe_quant.LANES: the few-token path through the GEMV's lane-wise decoding (3 tokens, a skipped slot, a
    strided activation), fp32 within 2e-5 of the reference, and within fp32 rounding of the per-pair tile path."""
    from ktrans.kernels.triton import moe_quant as mq

    gate_up, down, (g, u, d) = _layer(triton_device, down_type)
    ids, weights = _routing(3, triton_device, seed={"Q6_K": 1, "Q4_K": 2, "Q8_0": 3}[down_type])
    ids[1, 2] = -1
    x = (torch.randn(3, 2 * H, device=triton_device) * 1e-3)[:, :H]
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    monkeypatch.setitem(mq.LANES, "on", False)  # the per-pair tile path (the lanes path is the default)
    tiles = mq.moe_quant(x, ids, weights, gate_up, down)
    monkeypatch.setitem(mq.LANES, "on", True)
    y = mq.moe_quant(x, ids, weights, gate_up, down)
    assert y.shape == (3, H) and _err(y, ref) < 2e-5, down_type
    assert _err(y, tiles.double().cpu()) < 2e-5


@pytest.mark.parametrize("split", [None, 2, 3])
def test_lanes_split_k_and_fused_sums(split, triton_device, monkeypatch):
    """The few-token path's gate and up split over K (3 super-blocks of H: in 2 uneven parts, in 3, and as the
    launcher picks) and both fused sums (the splits', the top-k's): 2 tokens, one slot skipped, against the reference
    and the per-pair tile path; called twice, so the counters are back at zero after each kernel."""
    from ktrans.kernels.triton import moe_quant as mq
    from ktrans.kernels.triton.quant import counters

    h = 3 * 256
    gate_up, down, (g, u, d) = _layer(triton_device, "Q4_K", h=h)
    ids, weights = _routing(2, triton_device, seed=7)
    ids[1, 0] = -1
    x = torch.randn(2, h, device=triton_device) * 1e-3
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    monkeypatch.setitem(mq.LANES, "on", False)
    tiles = mq.moe_quant(x, ids, weights, gate_up, down)
    monkeypatch.setitem(mq.LANES, "on", True)
    monkeypatch.setitem(mq.LANES, "split", split)
    for _ in range(2):
        y = mq.moe_quant(x, ids, weights, gate_up, down)
        assert y.shape == (2, h) and _err(y, ref) < 2e-5 and _err(y, tiles.double().cpu()) < 2e-5
        assert not counters(x.device).any()


def test_lanes_pipelined_loops_change_no_bits(triton_device, monkeypatch):
    """LANES["pipe"]: gate and up's super-block loops pipelined (quant_gemv.row_dot PIPE) give the plain loops' bits
    at the same K split (3 super-blocks of H, whole and in 2 uneven parts), and the reference's values at the split
    the pipelined launch picks for itself (LANES["per_sm_pipe"]); gate's and up's rows in one pipelined loop
    (LANES["one_loop"]) give the two loops' values within 1e-6."""
    from ktrans.kernels.triton import moe_quant as mq

    h = 3 * 256
    gate_up, down, (g, u, d) = _layer(triton_device, "Q4_K", h=h)
    ids, weights = _routing(2, triton_device, seed=8)
    x = torch.randn(2, h, device=triton_device) * 1e-3
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    monkeypatch.setitem(mq.LANES, "on", True)
    runs = {}
    for pipe in (0, 3):
        monkeypatch.setitem(mq.LANES, "pipe", pipe)
        runs[pipe] = []
        for split in (1, 2):
            monkeypatch.setitem(mq.LANES, "split", split)
            runs[pipe].append(mq.moe_quant(x, ids, weights, gate_up, down))
    for got, want in zip(runs[3], runs[0]):
        assert torch.equal(got, want)
    monkeypatch.setitem(mq.LANES, "split", None)
    assert _err(mq.moe_quant(x, ids, weights, gate_up, down), ref) < 2e-5
    # gate's and up's rows in one loop (LANES["one_loop"]): each row's arithmetic as in two loops
    monkeypatch.setitem(mq.LANES, "one_loop", True)
    for split, want in zip((1, 2), runs[0]):
        monkeypatch.setitem(mq.LANES, "split", split)
        got = mq.moe_quant(x, ids, weights, gate_up, down)
        assert _err(got, want.double().cpu()) < 1e-6 and _err(got, ref) < 2e-5


def test_lanes_path_past_four_tokens(triton_device, monkeypatch):
    """The lanes path at 9 tokens (LANES["max_tokens"] is 64), one slot skipped, against the reference and the tile
    path's 16-row blocks (tensor-core dots on bf16-rounded activations: 1e-2)."""
    from ktrans.kernels.triton import moe_quant as mq

    gate_up, down, (g, u, d) = _layer(triton_device, "Q4_K")
    ids, weights = _routing(9, triton_device, seed=11)
    ids[4, 1] = -1
    x = torch.randn(9, H, device=triton_device).to(torch.bfloat16).float() * 1e-3
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    monkeypatch.setitem(mq.LANES, "on", False)
    tiles = mq.moe_quant(x, ids, weights, gate_up, down)
    monkeypatch.setitem(mq.LANES, "on", True)
    y = mq.moe_quant(x, ids, weights, gate_up, down)
    assert y.shape == (9, H) and _err(y, ref) < 2e-5 and _err(y, tiles.double().cpu()) < 1e-2


@pytest.mark.parametrize("t, down_type", [(1, "Q6_K"), (5, "Q4_K")])
def test_lanes_path_with_an_extra_expert(t, down_type, triton_device, monkeypatch):
    """The shared expert as one more pair a token (id E, its own one-expert stacks, not in the routed stack): the
    fused launch equals routed + weight * shared (both references in float64) within the lanes path's 2e-5, with a
    skipped slot; a type or shape that differs from the stack's, and a step past the lanes path, are refused."""
    from ktrans.kernels.triton import moe_quant as mq
    from ktrans.kernels.triton.quant_layout import as_stack

    gate_up, down, (g, u, d) = _layer(triton_device, down_type)
    sg, su = _stack("Q4_K", I, H, 300, triton_device), _stack("Q4_K", I, H, 400, triton_device)
    sd = _stack(down_type, H, I, 500, triton_device)
    # expert 2 of other stacks as the shared expert: planes that lie anywhere, at offsets of either sign
    extra = (as_stack(concat_rows([sg, su]).expert(2)), as_stack(sd.expert(2)))
    ref_sh = [dequantize_packed(w.to("cpu")).double()[2:3] for w in (sg, su, sd)]
    ids, weights = _routing(t, triton_device, seed=11 + t)
    ids[0, 1] = -1
    gate_w = torch.rand(t, 1, device=triton_device)
    x = (torch.randn(t, 2 * H, device=triton_device) * 1e-3)[:, :H]
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d) + moe_experts(
        x.cpu().double(), torch.zeros(t, 1, dtype=torch.int64), gate_w.cpu().double(), *ref_sh)
    ids_x = torch.cat([ids, torch.full((t, 1), E, device=triton_device, dtype=ids.dtype)], 1)
    y = mq.moe_quant(x, ids_x, torch.cat([weights, gate_w], 1), gate_up, down, extra=extra)
    assert y.shape == (t, H) and _err(y, ref) < 2e-5
    with pytest.raises(ValueError, match="types or shapes differ"):
        mq.moe_quant(x, ids_x, torch.cat([weights, gate_w], 1), gate_up, down, extra=(extra[0], extra[0]))
    monkeypatch.setitem(mq.LANES, "max_tokens", t - 1)
    with pytest.raises(ValueError, match="lanes path only"):
        mq.moe_quant(x, ids_x, torch.cat([weights, gate_w], 1), gate_up, down, extra=extra)
