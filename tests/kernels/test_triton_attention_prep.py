"""The fused attention prep (ktrans.kernels.triton.attention_prep.qk_prep: q/k RMSNorm, partial RoPE, the KV write)
against the four launches it replaces (norm.rms_norm for q and k, rope.rope_qk_, attention.write_kv), whose own
oracles are the torch references. Awkward sizes: a head dim that is not a power of two with a rotary part that is
neither (40 dims, 12 rotary), one token, odd token counts, q a strided view of q_proj's [q | gate] output, k and v
views of one projection, slots out of order and a pad row on the pad page.

Tolerance: fp32 within 1e-5 (the norm's sum of squares may add in another order; everything else is the same
arithmetic in the same order); bf16 (gpu) within one bf16 ulp (rtol 2^-7) for the same reason.
"""
from __future__ import annotations

import pytest
import torch

tri_prep = pytest.importorskip("ktrans.kernels.triton.attention_prep")
from ktrans.kernels.triton import attention as tri_attention  # noqa: E402
from ktrans.kernels.triton import norm as tri_norm  # noqa: E402
from ktrans.kernels.triton import rope as tri_rope  # noqa: E402

pytestmark = pytest.mark.triton


def _case(t, hq, hkv, d, rd, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    qg = rnd(t, hq * 2 * d)                       # q_proj's output, per head [q | gate]
    q = qg.view(t, hq, 2 * d)[:, :, :d]
    kv = rnd(t, 2 * hkv * d)                      # k and v as views of one buffer
    k, v = kv[:, : hkv * d].view(t, hkv, d), kv[:, hkv * d:].view(t, hkv, d)
    wq, wk = rnd(d) * 0.1, rnd(d) * 0.1
    pos = torch.randint(0, 4000, (t,), generator=g).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(0, rd, 2).float() / rd))[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    rows = 4 * 8
    slots = torch.randperm(rows - 1, generator=g)[:t].to(device)
    return q, k, v, wq, wk, cos, sin, rows, slots


@pytest.mark.parametrize("t, hq, hkv, d, rd", [(1, 4, 2, 40, 12), (5, 3, 1, 40, 12), (7, 16, 2, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_qk_prep_is_norms_rope_and_kv_write(triton_device, t, hq, hkv, d, rd, dtype):
    q, k, v, wq, wk, cos, sin, rows, slots = _case(t, hq, hkv, d, rd, dtype, triton_device, seed=t + d)
    caches = [[torch.zeros(rows, hkv, d, dtype=dtype, device=triton_device) for _ in range(2)] for _ in range(2)]
    # the four launches
    qn, kn = tri_norm.rms_norm(q, wq, 1e-6), tri_norm.rms_norm(k, wk, 1e-5)
    qn, kn = tri_rope.rope_qk_(qn, kn.contiguous(), cos, sin)
    tri_attention.write_kv(*caches[0], slots, kn, v)
    # the one
    got = tri_prep.qk_prep(q, k, v, wq, wk, 1e-6, 1e-5, cos, sin, *caches[1], slots)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(got, qn, **tol)
    torch.testing.assert_close(caches[1][0], caches[0][0], **tol)
    assert torch.equal(caches[1][1], caches[0][1])  # the values are copied, nothing computed
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not caches[1][0][untouched.to(triton_device)].any()  # only the step's rows written


def test_qk_prep_refuses_shapes_that_do_not_fit(triton_device):
    q, k, v, wq, wk, cos, sin, rows, slots = _case(3, 4, 2, 40, 12, torch.float32, triton_device)
    kc = torch.zeros(rows, 2, 40, device=triton_device)
    with pytest.raises(ValueError, match="do not fit"):
        tri_prep.qk_prep(q, k[:, :1], v, wq, wk, 1e-6, 1e-6, cos, sin, kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="unit stride"):
        tri_prep.qk_prep(q, k, v, wq, wk, 1e-6, 1e-6, cos, sin, kc.transpose(1, 2).contiguous().transpose(1, 2),
                         kc.clone(), slots)
