"""The Triton quantized GEMV / GEMM (ktrans.kernels.triton.quant) against the torch reference (dequantize the packed
planes, multiply in float64) for every packed type, at awkward shapes: N not a multiple of any row tile, M across the
three multiply paths, with and without split K. Interpreted without a GPU (marked `triton`).

Tolerances, relative Frobenius error against the float64 reference on the same (bf16-rounded) activations (and, read
back through one-hot activations, the kernel's weights are gguf-py's within one fp32 rounding):
- M <= 32 (fp32 products of the integer codes, scales applied in fp32): 2e-5 with fp32 out, 1e-2 with bf16 out
  (the output rounding);
- M > 32 (weights rounded to bf16 inside the tile): 1e-2.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf.quants")
from ktrans.kernels.torch.quant import dequantize_packed, quant_linear  # noqa: E402
from ktrans.kernels.triton.quant_layout import TYPES, repack  # noqa: E402
from tests.kernels.test_quant_layout import random_blocks  # noqa: E402

pytestmark = pytest.mark.triton


def _weight(qtype: str, n: int, k: int, device, seed: int = 0):
    return repack(torch.from_numpy(random_blocks(qtype, n, k, seed)), qtype, (n, k), device)


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_every_type(qtype, triton_device):
    from ktrans.kernels.triton.quant import qlinear

    n, k = 272, 512
    w = _weight(qtype, n, k, triton_device)
    for m, split in ((1, None), (3, 1)):
        x = torch.randn(m, k, device=triton_device).to(torch.bfloat16).float()
        y = qlinear(x, w, split=split)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert _err(y, quant_linear(x, w)) < 2e-5, (qtype, m)


@pytest.mark.parametrize("m", [1, 17])
def test_bf16_activations_and_split_k(m, triton_device):
    from ktrans.kernels.triton.quant import qlinear

    n, k = 528, 768
    w = _weight("Q4_K", n, k, triton_device, seed=1)
    x = torch.randn(m, k, device=triton_device).to(torch.bfloat16)
    ref = quant_linear(x, w)
    for split in (1, 3):
        y = qlinear(x, w, split=split)
        assert y.dtype == torch.bfloat16 and _err(y, ref) < 1e-2, (m, split)


def test_no_rows(triton_device):
    """A prefill chunk that returns no logits gives lm_head zero rows: an empty result, no launch."""
    from ktrans.kernels.triton.quant import qlinear

    w = _weight("Q6_K", 48, 256, triton_device, seed=3)
    y = qlinear(torch.zeros(0, 256, device=triton_device, dtype=torch.bfloat16), w)
    assert y.shape == (0, 48) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gemm_prefill_tile(qtype, triton_device):
    """M = 67: the bf16 tensor-core path, two row tiles of 64 (one partial), on a strided activation."""
    from ktrans.kernels.triton.quant import qlinear

    n, k, m = 136, 256, 67
    w = _weight(qtype, n, k, triton_device, seed=2)
    x = torch.randn(m, 2 * k, device=triton_device).to(torch.bfloat16)[:, :k]
    y = qlinear(x, w)
    assert y.shape == (m, n) and _err(y, quant_linear(x, w)) < 1e-2
    assert torch.isfinite(dequantize_packed(w.to("cpu"))).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fused_sum", [False, True])
@pytest.mark.parametrize("m", [1, 16])
def test_gemv_captured_in_a_cuda_graph(fused_sum, m, monkeypatch):
    """The split-K GEMV (one row) and tile path (16 rows: a 16-request decode step's projections) replay from a
    CUDA graph on new activations as an eager call computes them (with the fused sum: the per-tile counters are
    back at zero after every replay)."""
    from ktrans.kernels.triton import quant
    from ktrans.kernels.triton.quant import qlinear

    monkeypatch.setitem(quant.GEMV, "fused_sum", fused_sum)
    monkeypatch.setitem(quant.GEMV, "tile_fused_sum", fused_sum)
    dev = torch.device("cuda")
    w = _weight("Q4_K", 2048, 2048, dev)
    x = torch.randn(m, 2048, device=dev).to(torch.bfloat16)
    qlinear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qlinear(x, w)
    for _ in range(2):
        x.copy_(torch.randn(m, 2048, device=dev).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, qlinear(x, w)) and _err(y, quant_linear(x, w)) < 1e-2
    assert not fused_sum or not quant.counters(dev).any()  # `cuda`: the same counts as x.device's `cuda:0`


@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_weights_are_gguf_py_values(qtype, triton_device):
    """One-hot activations through the fp32 path read single weights back out of the kernel: gguf-py's dequantized
    values, within one fp32 rounding (the kernel's s*q - m may fuse into one multiply-add)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from ktrans.kernels.triton.quant import qlinear
    from tests.kernels.test_quant_layout import ROWS

    k, cols = 512, [0, 37, 300, 511]
    raw = random_blocks(qtype, ROWS, k, seed=9)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))[:, cols].T
    w = repack(torch.from_numpy(raw), qtype, (ROWS, k), triton_device)
    x = torch.zeros(len(cols), k, device=triton_device)
    x[torch.arange(len(cols)), cols] = 1.0
    got = qlinear(x, w).cpu()
    assert torch.allclose(got, want, rtol=2 ** -22, atol=2 ** -22 * float(want.abs().max()))
    one_row = torch.cat([qlinear(x[i:i + 1], w) for i in range(len(cols))]).cpu()  # the GEMV kernel's decoding
    assert torch.allclose(one_row, want, rtol=2 ** -22, atol=2 ** -22 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("tiling", [{"bn": 64, "warps": 8, "per_sm": 1}, {"bn": 16, "warps": 2, "per_sm": 16},
                                    {"bn": 16, "per_sm": 16, "stages": 1}])
def test_gemv_tilings(qtype, tiling, triton_device, monkeypatch):
    """The one-row GEMV under other tilings scripts/gemv_sweep.py tries: wider and narrower row tiles, split less
    and more along K, other pipelining stages (N = 200: a partial last tile; K = 768: three super-blocks, so a split
    leaves one program a single super-block)."""
    from ktrans.kernels.triton import quant

    for key, value in tiling.items():
        monkeypatch.setitem(quant.GEMV, key, value)
    n, k = 200, 768
    w = _weight(qtype, n, k, triton_device, seed=3)
    x = torch.randn(1, k, device=triton_device).to(torch.bfloat16).float()
    for split in (None, 1, 2):
        assert _err(quant.qlinear(x, w, split=split), quant_linear(x, w)) < 2e-5, (qtype, split)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_fused_split_sum_equals_two_launches(qtype, triton_device, monkeypatch):
    """GEMV["fused_sum"]: the last program of each row tile sums the split partials in order, as the separate sum
    kernel does, so the outputs are equal, not just close; three calls in a row find the counters zero again."""
    from ktrans.kernels.triton import quant

    n, k = 200, 768
    w = _weight(qtype, n, k, triton_device, seed=4)
    x = torch.randn(1, k, device=triton_device).to(torch.bfloat16).float()
    monkeypatch.setitem(quant.GEMV, "fused_sum", False)  # the two-launch form (the default is fused)
    want = {split: quant.qlinear(x, w, split=split) for split in (2, 3)}
    monkeypatch.setitem(quant.GEMV, "fused_sum", True)
    for _ in range(3):
        for split, y in want.items():
            assert torch.equal(quant.qlinear(x, w, split=split), y), (qtype, split)
    assert not quant.counters(x.device).any()


@pytest.mark.parametrize("m", [3, 16, 40])
def test_tile_path_fused_split_sum_equals_two_launches(m, triton_device, monkeypatch):
    """The few-row and tile paths (3 rows: fp32 products; 16: tensor-core code dots; 40: bf16 tiles) sum their split
    partials in the tile's last program too (GEMV["tile_fused_sum"]): in order, so the outputs equal the separate sum
    kernel's, bf16 and fp32 out; the counters are zero after each call, so repeated calls (a graph's replays) agree."""
    from ktrans.kernels.triton import quant

    n, k = 200, 1536  # six super-blocks: splits of three and of two
    for qtype, dtype in (("Q4_K", torch.bfloat16), ("Q6_K", torch.float32)):
        w = _weight(qtype, n, k, triton_device, seed=5)
        x = torch.randn(m, k, device=triton_device).to(torch.bfloat16).to(dtype)
        monkeypatch.setitem(quant.GEMV, "tile_fused_sum", False)
        want = {split: quant.qlinear(x, w, split=split) for split in (2, 3)}
        monkeypatch.setitem(quant.GEMV, "tile_fused_sum", True)
        for _ in range(2):
            for split, y in want.items():
                assert torch.equal(quant.qlinear(x, w, split=split), y), (qtype, m, split)
                assert not quant.counters(x.device).any()
        tol = 2e-5 if m <= 32 and dtype == torch.float32 else 1e-2
        assert _err(want[3], quant_linear(x, w)) < tol, (qtype, m)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_pipelined_loop_changes_no_bits(qtype, triton_device, monkeypatch):
    """GEMV["pipe"]: the super-block loop as tl.range(num_stages=...) moves the weights' loads (into shared memory,
    ahead of the arithmetic), not the arithmetic: the same bits as the plain loop, alone and paired, at K splits that
    leave a program one to five super-blocks (N = 200: a partial last tile; K = 1280), and at the split the pipelined
    launch picks for itself (GEMV["per_sm_pipe"]) within fp32 rounding of the plain one's."""
    from ktrans.kernels.triton import quant

    n, k = 200, 5 * 256
    w, wb = _weight(qtype, n, k, triton_device, seed=5), _weight(qtype, 40, k, triton_device, seed=6)
    x = torch.randn(1, k, device=triton_device).to(torch.bfloat16)
    runs = {}
    for pipe in (0, 3):
        monkeypatch.setitem(quant.GEMV, "pipe", pipe)
        runs[pipe] = [quant.qlinear(x, w, split=s) for s in (1, 2, 5)] + list(quant.qlinear_pair(x, w, wb, split=2))
        runs[pipe].append(quant.qlinear(x, w))
    for got, want in zip(runs[3][:-1], runs[0][:-1]):
        assert torch.equal(got, want), qtype
    assert _err(runs[3][-1], quant_linear(x, w)) < 1e-2 and _err(runs[0][-1], quant_linear(x, w)) < 1e-2


@pytest.mark.parametrize("qtype, split", [("Q4_K", 1), ("Q4_K", 2), ("Q6_K", 3), ("Q8_0", None)])
def test_gemv_pair_equals_two_gemvs(qtype, split, triton_device):
    """qlinear_pair (one launch over two matrices of one type and width, e.g. in_proj_qkvz and in_proj_ba): each
    output bitwise what qlinear gives at the same K split; rows that fill no whole tile; mismatched matrices refused."""
    from ktrans.kernels.triton.quant import qlinear, qlinear_pair

    k = 3 * 256
    wa, wb = _weight(qtype, 96 + 5, k, triton_device, seed=1), _weight(qtype, 24, k, triton_device, seed=2)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16).to(triton_device)
    s = split or 2
    ya, yb = qlinear_pair(x, wa, wb, split=s)
    assert ya.shape == (1, wa.n) and yb.shape == (1, wb.n)
    assert torch.equal(ya, qlinear(x, wa, split=s)) and torch.equal(yb, qlinear(x, wb, split=s))
    if split is None:  # the default split: within fp32 rounding of the single launches' own splits
        ya, yb = qlinear_pair(x, wa, wb)
        torch.testing.assert_close(ya.float(), qlinear(x, wa).float(), rtol=1e-2, atol=1e-2)
    other = _weight("Q6_K" if qtype != "Q6_K" else "Q4_K", 24, k, triton_device, seed=2)
    with pytest.raises(ValueError, match="one type and width"):
        qlinear_pair(x, wa, other)
    with pytest.raises(ValueError, match="one row"):
        qlinear_pair(x.expand(2, k), wa, wb)
