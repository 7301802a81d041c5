"""The one-row GEMV's row-owning form (GEMV["rows"], ktrans.kernels.triton.quant_gemv._row_dot_rows: each thread
reads whole rows, x as bf16 pairs) against the float64 reference and against the lane-group form, for every K-quant
type, at awkward shapes: N = 200 (a partial last row tile), K = 768 (three super-blocks: a split leaves a program
one), split K or not, and as a pair of matrices in one launch. Interpreted without a GPU (marked `triton`).

Tolerance: y is bf16 (x's dtype), so each output is the float64 product rounded once to bf16 (half an ulp, 2^-9
relative, on a GPU; Triton 3.9's interpreter truncates, a whole ulp) up to fp32 summation error: |y - ref| <= 2^-7
|ref| + 1e-5 max|ref|.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf.quants")
from ktrans.kernels.torch.quant import quant_linear  # noqa: E402
from tests.kernels.test_quant_triton import _weight  # noqa: E402

pytestmark = pytest.mark.triton
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    ref = ref.double().cpu()
    err = (y.double().cpu() - ref).abs()
    return bool((err <= 2.0 ** -7 * ref.abs() + 1e-5 * ref.abs().max()).all())


@pytest.fixture
def rows(monkeypatch):
    from ktrans.kernels.triton import quant

    monkeypatch.setitem(quant.GEMV, "rows", 1)
    monkeypatch.setitem(quant.GEMV, "rows_bn", 64 if torch.cuda.is_available() else 128)
    monkeypatch.setitem(quant.GEMV, "rows_warps", 2 if torch.cuda.is_available() else 4)
    return quant


@pytest.mark.parametrize("qtype, h", [("Q4_K", 1), ("Q5_K", 1), ("Q6_K", 1), ("Q4_K", 2), ("Q6_K", 4),
                                      ("Q5_K", 8)])
def test_rows_gemv_matches_reference(qtype, h, rows, triton_device, monkeypatch):
    """H threads a row (the largest H each type takes: 8, Q6_K's half super-blocks 4)."""
    monkeypatch.setitem(rows.GEMV, "rows", h)
    n, k = 200, 768
    w = _weight(qtype, n, k, triton_device, seed=5)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(7)) * 0.5).to(torch.bfloat16).to(triton_device)
    assert rows.gemv_rows(x, qtype) == h
    ref = quant_linear(x, w)
    for split in (None, 1, 2, 3):
        y = rows.qlinear(x, w, split=split)
        assert y.dtype == torch.bfloat16 and y.shape == (1, n)
        assert _close(y, ref), (qtype, split)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_rows_pair_is_two_rows_gemvs(qtype, rows, triton_device):
    """Both matrices in one launch: each output bitwise the row-owning GEMV's at the same split."""
    k = 3 * 256
    wa, wb = _weight(qtype, 96 + 5, k, triton_device, seed=1), _weight(qtype, 24, k, triton_device, seed=2)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16).to(triton_device)
    ya, yb = rows.qlinear_pair(x, wa, wb, split=2)
    assert torch.equal(ya, rows.qlinear(x, wa, split=2)) and torch.equal(yb, rows.qlinear(x, wb, split=2))
    assert _close(ya, quant_linear(x, wa)) and _close(yb, quant_linear(x, wb))


def test_rows_form_only_where_it_applies(rows, triton_device):
    """fp32 x, Q8_0 and an x row that starts between int32 words take the lane-group kernel (ROWS 0), still right."""
    k = 512
    x = torch.randn(1, k + 1).to(torch.bfloat16).to(triton_device)
    odd = x[:, 1:]  # starts one bf16 into the buffer
    assert rows.gemv_rows(odd, "Q4_K") == 0 and rows.gemv_rows(x[:, :k], "Q8_0") == 0
    assert rows.gemv_rows(x[:, :k].float(), "Q4_K") == 0 and rows.gemv_rows(x[:, :k], "Q4_K") == 1
    w = _weight("Q4_K", 72, k, triton_device, seed=6)
    assert _close(rows.qlinear(odd, w), quant_linear(odd, w))
    # an H the type's super-block cannot give four code words a thread, or not a power of two: the lane groups
    for h, qtype in ((8, "Q6_K"), (16, "Q4_K"), (3, "Q4_K")):
        rows.GEMV["rows"] = h
        assert rows.gemv_rows(x[:, :k], qtype) == 0, (h, qtype)
    rows.GEMV["rows"] = 1
    rows.GEMV["rows_bn"] = 96
    assert rows.gemv_rows(x[:, :k], "Q4_K") == 0


@pytest.mark.parametrize("t, down_type", [(1, "Q6_K"), (2, "Q4_K"), (2, "Q8_0")])
def test_rows_moe_lanes_path(t, down_type, rows, triton_device, monkeypatch):
    """The MoE's few-token path with the row-owning row_dot (gate and up split over K, down on the bf16 h; a Q8_0
    down keeps the lane-group form): bf16 x and output, a skipped slot, within the bf16 output's rounding of the
    float64 reference (relative Frobenius 1e-2) and of the lane-group form's output."""
    from ktrans.kernels.triton import moe_quant as mq
    from tests.kernels.test_moe_quant import _err, _layer, _routing
    from ktrans.kernels.torch.moe import moe_experts

    monkeypatch.setitem(mq.LANES, "on", True)  # the few-token path, whatever KTRANS_MOE_LANES says
    monkeypatch.setitem(mq.LANES, "reg", 0)  # the lanes kernel's own form (bf16 x would take the register kernel)
    gate_up, down, (g, u, d) = _layer(triton_device, down_type, h=3 * 256)
    ids, weights = _routing(t, triton_device, seed=20 + t)
    ids[0, 1] = -1
    x = (torch.randn(t, 3 * 256, generator=torch.Generator().manual_seed(t)) * 0.05).to(torch.bfloat16)
    x = x.to(triton_device)
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    y = mq.moe_quant(x, ids, weights, gate_up, down)
    rows.GEMV["rows"] = 0
    lanes = mq.moe_quant(x, ids, weights, gate_up, down)
    assert y.dtype == torch.bfloat16 and _err(y, ref) < 1e-2 and _err(y, lanes.double().cpu()) < 1e-2
