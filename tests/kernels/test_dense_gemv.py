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


@pytest.mark.parametrize("m, e, k, top_k, renorm, shared", [(1, 37, 300, 5, True, False), (3, 64, 260, 8, False, False),
                                                           (4, 40, 96, 10, True, True), (2, 19, 64, 3, False, True)])
def test_dense_route_against_the_two_launches(triton_device, m, e, k, top_k, renorm, shared):
    """The logits' GEMV and the routing in one launch against dense_gemv then route / route_with_shared: the same
    ids, the weights within fp32 rounding (another reduction order), in the same dtypes; twice in a row, the count
    the last program resets zero after each (a graph replay's next step)."""
    from ktrans.kernels.triton import router
    from ktrans.kernels.triton.quant import counters

    g = torch.Generator().manual_seed(m * e + k)
    # fp32 rows of a wider tensor, cast to the weight's bf16 as KLinearMarlin's float part casts them
    x = torch.randn(m, 2 * k, generator=g).to(triton_device)[:, :k]
    w = (torch.randn(e + shared, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(triton_device)
    logits = tri.dense_gemv(x.to(torch.bfloat16), w)
    want = router.route_with_shared(logits, top_k, renorm) if shared else router.route(logits, top_k, renorm)
    for _ in range(2):
        ids, weights = tri.dense_route(x, w, top_k, renorm, shared=shared)
        assert ids.shape == want[0].shape and weights.dtype == want[1].dtype
        assert torch.equal(ids, want[0])
        torch.testing.assert_close(weights, want[1], atol=1e-6, rtol=1e-6 if shared else 8e-3)
        assert not counters(x.device).any()  # the last program zeroed its count


def test_dense_route_refuses_what_it_cannot_route(triton_device):
    x = torch.zeros(2, 8, device=triton_device)
    with pytest.raises(ValueError, match="do not fit"):
        tri.dense_route(torch.zeros(tri.MAX_ROWS + 1, 8, device=triton_device), torch.zeros(4, 8), 2, True)
    with pytest.raises(ValueError, match="top_k 5 of 4 experts"):
        tri.dense_route(x, torch.zeros(5, 8, device=triton_device), 5, True, shared=True)
