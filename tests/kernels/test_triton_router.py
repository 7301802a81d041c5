"""The Triton router (top-k over the softmax, renormalised or not) and the MoE block's gated sum against the
torch ops of ktrans/operators/moe.py (`route`, and routed + sigmoid(gate) * shared).

Expert counts are not powers of two, k is odd, T=1 is covered. The ids must be identical: each row's logits are a
random permutation of distinct multiples of 1/64 (exact in bf16 too, so no ties for the two to break apart); weights within atol 1e-6 in fp32 (the same softmax, summed in another order), and within
one bf16 ulp (atol 4e-3 / rtol 8e-3) in bf16 on the GPU.
"""
from __future__ import annotations

import pytest
import torch

from ktrans.operators.moe import route

tri = pytest.importorskip("ktrans.kernels.triton.router")

pytestmark = pytest.mark.triton
CASES = [pytest.param(torch.float32, id="fp32"),
         pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", CASES)
@pytest.mark.parametrize("t,e,k", [(1, 12, 1), (9, 33, 5), (4, 512, 10)])
@pytest.mark.parametrize("renorm", [True, False])
def test_topk_softmax(triton_device, dtype, t, e, k, renorm):
    logits = torch.stack([(torch.randperm(e) - e // 2).float() / 64 for _ in range(t)]).to(dtype).to(triton_device)
    want_ids, want_w = route(logits, k, renorm)
    got_ids, got_w = tri.route(logits, k, renorm)
    assert got_ids.dtype == torch.int64 and got_w.dtype == dtype
    assert torch.equal(got_ids, want_ids)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=8e-3)
    torch.testing.assert_close(got_w, want_w, **tol)


@pytest.mark.parametrize("dtype", CASES)
@pytest.mark.parametrize("t,h", [(1, 40), (7, 130)])
def test_gated_sum(triton_device, dtype, t, h):
    routed, shared = (torch.randn(t, h).to(dtype).to(triton_device) for _ in range(2))
    gate = torch.randn(t, 1).to(dtype).to(triton_device)
    want = routed + torch.sigmoid(gate) * shared
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(tri.gated_sum(routed, shared, gate), want, **tol)


@pytest.mark.parametrize("dtype", CASES)
@pytest.mark.parametrize("t,h", [(1, 40), (5, 1300), (2, 2048)])
def test_gated_sum_dot(triton_device, dtype, t, h):
    """The gate logit computed in the launch: x . w per token (fp32 sums over H, H not a multiple of the block and
    larger than it), against the block's torch ops (the logit from F.linear, rounded to the dtype)."""
    routed, shared, x = (torch.randn(t, h).to(dtype).to(triton_device) for _ in range(3))
    w = (torch.randn(1, h) / h ** 0.5).to(dtype).to(triton_device)
    want = routed + torch.sigmoid(torch.nn.functional.linear(x, w)) * shared
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1.6e-2)
    got = tri.gated_sum_dot(routed, shared, x, w)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    strided = torch.cat([x, x], dim=1)[:, :h]  # rows of a wider tensor: its stride, not h
    torch.testing.assert_close(tri.gated_sum_dot(routed, shared, strided, w), got, atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not fit"):
        tri.gated_sum_dot(routed, shared, x, w.T)


@pytest.mark.parametrize("t,e,k", [(1, 12, 1), (3, 512, 10)])
@pytest.mark.parametrize("renorm", [True, False])
def test_route_with_shared(triton_device, t, e, k, renorm):
    """Logits with the shared expert's gate logit as column E: the first k ids and weights as route() gives them,
    then id E with sigmoid(gate logit), in fp32."""
    logits = torch.stack([(torch.randperm(e + 1) - e // 2).float() / 64 for _ in range(t)]).to(triton_device)
    want_ids, want_w = route(logits[:, :e], k, renorm)
    got_ids, got_w = tri.route_with_shared(logits, k, renorm)
    assert got_ids.shape == (t, k + 1) and got_w.dtype == torch.float32
    assert torch.equal(got_ids[:, :k], want_ids) and (got_ids[:, k] == e).all()
    torch.testing.assert_close(got_w[:, :k], want_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_w[:, k], torch.sigmoid(logits[:, e]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_sum_dot_on_the_staged_rows(triton_device, dtype):
    """The stage-out folded into the gated sum (KTRANS_ROUTE_STAGE): the CPU experts' fp32 rows read in place as
    `dtype` rows give bitwise the sum of stage_out's copy (ktrans.kernels.triton.stage) then gated_sum_dot."""
    from ktrans.kernels.triton import stage

    t, h = 3, 1300
    g = torch.Generator().manual_seed(9)
    staged = torch.randn(t + 2, h, generator=g)  # the staging holds more rows than the call's
    if triton_device.type == "cuda":
        staged = staged.pin_memory()
    shared = torch.randn(t, h, generator=g).to(dtype).to(triton_device)
    x = torch.randn(t, h, generator=g).to(dtype).to(triton_device)
    w = (torch.randn(1, h, generator=g) * 0.05).to(dtype).to(triton_device)
    want = tri.gated_sum_dot(stage.stage_out(staged, t, triton_device, dtype), shared, x, w)
    got = tri.gated_sum_dot(staged[:t], shared, x, w, staged_dtype=dtype)
    assert got.dtype == want.dtype and got.device == want.device and torch.equal(got, want)
    with pytest.raises(ValueError, match="staged routed output"):
        tri.gated_sum_dot(staged[:t].to(torch.float16), shared, x, w, staged_dtype=dtype)
