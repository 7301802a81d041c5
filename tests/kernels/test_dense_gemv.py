"""ktrans.kernels.triton.dense_gemv (decode rows times a float matrix, the router's gate on KLinearMarlin) against
F.linear in fp32: odd N and K (a partial row tile, K not a multiple of the block), 1 and 3 rows, strided rows;
within 1e-5 relative (fp32 sums in another order)."""
from __future__ import annotations

import pytest
import torch

tri = pytest.importorskip("ktrans.kernels.triton.dense_gemv")

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("m, n, k", [(1, 37, 300), (3, 512, 1030), (4, 6, 64)])
def test_against_f_linear(triton_device, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 2 * k, generator=g).to(triton_device)[:, :k]  # rows of a wider tensor
    w = torch.randn(n, k, generator=g).to(triton_device)
    got = tri.dense_gemv(x, w)
    want = torch.nn.functional.linear(x.double(), w.double())
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert float((got.double() - want).norm() / want.norm()) < 1e-5


@pytest.mark.gpu
def test_bf16_against_f_linear():
    x = torch.randn(2, 2048, device="cuda").to(torch.bfloat16)
    w = (torch.randn(512, 2048, device="cuda") / 45).to(torch.bfloat16)
    torch.testing.assert_close(tri.dense_gemv(x, w), torch.nn.functional.linear(x, w), atol=2e-2, rtol=1.6e-2)


def test_rows_past_the_limit_are_refused(triton_device):
    x = torch.zeros(tri.MAX_ROWS + 1, 8, device=triton_device)
    with pytest.raises(ValueError, match="do not fit"):
        tri.dense_gemv(x, torch.zeros(4, 8, device=triton_device))


@pytest.mark.parametrize("m, n, k, top_k, renorm", [(1, 37, 300, 5, True), (3, 512, 1030, 10, True),
                                                     (4, 64, 200, 8, False)])
def test_gate_and_topk_in_one_launch(triton_device, m, n, k, top_k, renorm):
    """dense_gemv_topk: its logits those of dense_gemv (within bf16 rounding on a GPU: another summation order),
    and its top k what router.route picks from them (ids equal, weights within fp32 rounding), twice in a row on one
    count (the last program resets it; a count left set would pick no last one)."""
    from ktrans.kernels.triton.quant import counters
    from ktrans.kernels.triton.router import route

    g = torch.Generator().manual_seed(m * n + k + top_k)
    x = torch.randn(m, 2 * k, generator=g).to(triton_device)[:, :k]
    w = torch.randn(n, k, generator=g).to(triton_device)
    count = counters(x.device)[:1]
    for _ in range(2):
        ids, weights, logits = tri.dense_gemv_topk(x, w, top_k, renorm, count)
        assert float((logits.double() - tri.dense_gemv(x, w).double()).norm() / logits.double().norm()) < 1e-5
        want_ids, want_w = route(logits, top_k, renorm)
        assert ids.dtype == torch.int64 and weights.dtype == x.dtype and ids.shape == (m, top_k)
        assert torch.equal(ids.cpu(), want_ids.cpu())
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
        assert int(count.item()) == 0


def test_gate_and_topk_refuse_what_does_not_fit(triton_device):
    from ktrans.kernels.triton.quant import counters

    count = counters(torch.empty(0, device=triton_device).device)[:1]
    with pytest.raises(ValueError, match="do not fit"):
        tri.dense_gemv_topk(torch.zeros(1, 8, device=triton_device), torch.zeros(4, 8, device=triton_device), 5,
                            True, count)
