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
