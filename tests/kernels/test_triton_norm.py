"""The Triton RMSNorms (zero-centred, fused with the residual add; gated) and the partial RoPE against their
references in ktrans/operators/norm.py and ktrans/operators/rope.py.

Rows are odd in count and in width (head dims that are not powers of two), q is a strided view (q_proj's
half) as the attention operator hands it over, and T=1 is covered. Tolerances: fp32 within atol/rtol 1e-5 (the
same fp32 math, other summation order); bf16 (gpu) within two bf16 ulps, atol 2e-2 / rtol 1.6e-2, since the
reference rounds after each bf16 op where the kernels round once.
"""
from __future__ import annotations

import pytest
import torch

from ktrans.operators.norm import rms_norm, rms_norm_gated
from ktrans.operators.rope import apply_rope, rope_cos_sin

tri_norm = pytest.importorskip("ktrans.kernels.triton.norm")
tri_rope = pytest.importorskip("ktrans.kernels.triton.rope")

pytestmark = pytest.mark.triton
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
CASES = [pytest.param(torch.float32, id="fp32"),
         pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu)]


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", CASES)
@pytest.mark.parametrize("t,d", [(1, 96), (13, 200), (5, 2048)])
def test_rms_norm_and_fused_residual(triton_device, dtype, t, d):
    x = torch.randn(t, d).to(dtype).to(triton_device)
    res = (3 * torch.randn(t, d)).to(dtype).to(triton_device)
    w = (0.1 * torch.randn(d)).to(dtype).to(triton_device)
    _close(tri_norm.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), dtype)
    normed, new_res = tri_norm.rms_norm(x, w, 1e-6, residual=res)
    _close(new_res, res + x, dtype)
    _close(normed, rms_norm(res + x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", CASES)
def test_rms_norm_over_heads_of_a_strided_view(triton_device, dtype):
    """The q/k norm: [T, H, D] where q is the first half of each head's q_proj output (not contiguous)."""
    t, h, d = 7, 3, 48
    q, _ = torch.randn(t, h, 2 * d).to(dtype).to(triton_device).chunk(2, dim=-1)
    assert not q.is_contiguous()
    w = torch.randn(d).to(dtype).to(triton_device)
    _close(tri_norm.rms_norm(q, w, 1e-6), rms_norm(q, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", CASES)
@pytest.mark.parametrize("rows,d", [(1, 24), (9 * 6, 24), (3 * 32, 128)])
def test_rms_norm_gated(triton_device, dtype, rows, d):
    x = torch.randn(rows, d).to(dtype).to(triton_device)
    gate = (2 * torch.randn(rows, d)).to(dtype).to(triton_device)
    w = (1 + 0.2 * torch.randn(d)).to(dtype).to(triton_device)
    _close(tri_norm.rms_norm_gated(x, gate, w, 1e-6), rms_norm_gated(x, gate, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", CASES)
@pytest.mark.parametrize("t,hq,hkv,d,rd", [(1, 4, 2, 32, 16), (11, 3, 1, 24, 12), (6, 16, 2, 256, 64)])
def test_partial_rope_on_q_and_k_in_place(triton_device, dtype, t, hq, hkv, d, rd):
    positions = torch.randint(0, 5000, (t,)).to(triton_device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / rd))
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    q = torch.randn(t, hq, d).to(dtype).to(triton_device)
    k = torch.randn(t, hkv, d).to(dtype).to(triton_device)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = tri_rope.rope_qk_(q, k, cos, sin)
    assert got_q is q and got_k is k  # in place
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert torch.equal(got_q[..., rd:], want_q[..., rd:])  # the unrotated dims are untouched
