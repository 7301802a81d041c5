"""An attention layer's step from its projections to the KV cache in one launch: the q and k RMSNorms (zero-centred,
per head), partial NeoX RoPE on both, and the write of this step's rotated keys and its values into the paged pool.

Unfused, the same step is four launches (ktrans/kernels/triton/norm.py rms_norm for q and for k, rope.py rope_qk_,
attention.py write_kv); this one does their arithmetic in their order: the norm in fp32 rounded to the dtype (its
store), the rotation in fp32 from those rounded values rounded once more, the keys and values stored at their cache
rows. The oracle is that sequence (tests/kernels/test_triton_attention_prep.py). The sums of squares may add in
another order than rms_norm's tiles do (another tile shape), so results agree within the fp32 rounding of the
norm's scale, not bitwise.

One program per (token, q or k): the q program norms and rotates the token's query heads into `q_out`; the k program
its key heads, storing them and the value heads at the token's cache row. The rotary dims are read a second time as
two halves, so the rotation pairs column c with c + rotary_dim / 2 without moving values between columns.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton import unaligned
from ktrans.kernels.triton.pdl import enter, launch

# On (KTRANS_ATTN_PREP=0 opts out): KQwen3NextAttention hands q and k over as projected to an op that takes them so
# (KAttentionTriton.takes_prep), which runs qk_prep: three launches a full-attention layer fewer. Timed with the gate
# in the merge under the serve rules at full size (H100, session 25, doc/benchmarks.md): 863 -> 815 device ops a
# token, the GPU's share 3.096 -> 3.028 ms, batch 1 76.7 -> 78.5 tok/s.
FUSED = os.environ.get("KTRANS_ATTN_PREP", "1") == "1"


@triton.jit
def _norm_rope_heads(X, stride_h, W, eps, C, S, heads, n_heads, Y, stride_yh, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The heads [n_heads, D] at X normed (weight 1 + W) and rotated on their first 2 * HALF dims, into Y."""
    cols = tl.arange(0, BLOCK_D)
    hmask = heads < n_heads
    mask = hmask[:, None] & (cols < D)[None, :]
    x = tl.load(X + heads[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = (xf * rstd[:, None] * (1.0 + w[None, :])).to(Y.dtype.element_ty)
    # the pass-through dims as normed; the rotary ones below
    tl.store(Y + heads[:, None] * stride_yh + cols[None, :], y, mask=mask & (cols >= 2 * HALF)[None, :])
    hc = tl.arange(0, BLOCK_HALF)
    mh = hc < HALF
    m2 = hmask[:, None] & mh[None, :]
    x1 = tl.load(X + heads[:, None] * stride_h + hc[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(X + heads[:, None] * stride_h + HALF + hc[None, :], mask=m2, other=0.0).to(tl.float32)
    w1 = tl.load(W + hc, mask=mh, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + hc, mask=mh, other=0.0).to(tl.float32)[None, :]
    # rounded to the dtype as the norm's store rounds them, then rotated in fp32 as rope_qk_ does
    a = (x1 * rstd[:, None] * (1.0 + w1)).to(Y.dtype.element_ty).to(tl.float32)
    b = (x2 * rstd[:, None] * (1.0 + w2)).to(Y.dtype.element_ty).to(tl.float32)
    c1 = tl.load(C + hc, mask=mh, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(C + HALF + hc, mask=mh, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(S + hc, mask=mh, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(S + HALF + hc, mask=mh, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + heads[:, None] * stride_yh + hc[None, :], (a * c1 - b * s1).to(Y.dtype.element_ty), mask=m2)
    tl.store(Y + heads[:, None] * stride_yh + HALF + hc[None, :], (b * c2 + a * s2).to(Y.dtype.element_ty), mask=m2)


@triton.jit(**unaligned("SLOTS"))  # the runner's slot mapping, a view at an offset its buffer sizes set
def _qk_prep_kernel(Q, K, V, WQ, WK, COS, SIN, QO, KC, VC, SLOTS, stride_qt, stride_qh, stride_kt, stride_kh,
                    stride_vt, stride_vh, stride_qot, stride_qoh, stride_cr, stride_ch, stride_c, stride_s, hq, hkv,
                    eps_q, eps_k, D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c, s = COS + t * stride_c, SIN + t * stride_s
    if tl.program_id(1) == 0:
        _norm_rope_heads(Q + t * stride_qt, stride_qh, WQ, eps_q, c, s, tl.arange(0, HQ_PAD), hq,
                         QO + t * stride_qot, stride_qoh, D, BLOCK_D, HALF, BLOCK_HALF)
    else:
        row = tl.load(SLOTS + t)
        _norm_rope_heads(K + t * stride_kt, stride_kh, WK, eps_k, c, s, tl.arange(0, HK_PAD), hkv,
                         KC + row * stride_cr, stride_ch, D, BLOCK_D, HALF, BLOCK_HALF)
        heads = tl.arange(0, HK_PAD)
        cols = tl.arange(0, BLOCK_D)
        mask = (heads < hkv)[:, None] & (cols < D)[None, :]
        v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mask, other=0.0)
        tl.store(VC + row * stride_cr + heads[:, None] * stride_ch + cols[None, :], v, mask=mask)


def qk_prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            q_eps: float, k_eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] as the projections give them (any row and head strides, unit stride along
    D): returns the normed, rotated queries [T, Hq, D] (`out` when given) and stores the normed, rotated keys and the
    values at cache rows slot_mapping [T] of k_cache / v_cache [rows, Hkv, D]. cos/sin [T, rotary_dim]."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (t, hkv, d) or v.shape != k.shape or k_cache.shape[1:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"qk_prep: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cache "
                         f"{tuple(k_cache.shape)} do not fit")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin, k_cache, v_cache)) or k_cache.stride() != v_cache.stride():
        raise ValueError("qk_prep needs a unit stride along the head dim and one layout for both caches")
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device) if out is None else out
    if t == 0:
        return out
    half = cos.shape[-1] // 2
    block_d = triton.next_power_of_2(d)
    hq_pad, hk_pad = triton.next_power_of_2(hq), triton.next_power_of_2(hkv)
    _qk_prep_kernel[(t, 2)](
        q, k, v, q_weight, k_weight, cos, sin, out, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), cos.stride(0), sin.stride(0), hq, hkv, q_eps, k_eps, D=d, BLOCK_D=block_d, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), HQ_PAD=hq_pad, HK_PAD=hk_pad,
        num_warps=4 if hq_pad * block_d >= 2048 else 1, **launch())
    return out
