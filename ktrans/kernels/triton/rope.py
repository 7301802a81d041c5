"""Partial NeoX RoPE in Triton: rotates the first rotary_dim dims of q and k in place, both in one launch.

The oracle is `apply_rope` in `ktrans/operators/rope.py`: the rotary dims split in two halves (x1, x2) become
(x1 cos - x2 sin, x2 cos + x1 sin); the other head_dim - rotary_dim dims (192 of Qwen3-Next's 256) pass through.
In place, only the rotary quarter of each head is read and written, where the reference rebuilds the whole
tensor. The math is fp32 with one rounding to the dtype (the reference rounds after each bf16 op).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter, launch


@triton.jit
def _rotate(X, t, stride_t, stride_h, C, S, n_heads, HALF: tl.constexpr, H_PAD: tl.constexpr,
            BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, H_PAD)
    cols = tl.arange(0, BLOCK_HALF)
    mc = cols < HALF
    mask = (heads < n_heads)[:, None] & mc[None, :]
    c1 = tl.load(C + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(C + HALF + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(S + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(S + HALF + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    p1 = X + t * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(p1, (a * c1 - b * s1).to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, (b * c2 + a * s2).to(x1.dtype), mask=mask)


@triton.jit
def _rope_qk_kernel(Q, K, COS, SIN, stride_qt, stride_qh, stride_kt, stride_kh, stride_c, stride_s, hq, hkv,
                    HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0)
    c, s = COS + t * stride_c, SIN + t * stride_s
    if tl.program_id(1) == 0:
        _rotate(Q, t, stride_qt, stride_qh, c, s, hq, HALF, HQ_PAD, BLOCK_HALF)
    else:
        _rotate(K, t, stride_kt, stride_kh, c, s, hkv, HALF, HK_PAD, BLOCK_HALF)


def rope_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos/sin [T, rotary_dim]; returns (q, k)."""
    t, rd = q.shape[0], cos.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_qk_ needs a unit stride along the head dim of q, k, cos and sin")
    if t == 0:
        return q, k
    half = rd // 2
    _rope_qk_kernel[(t, 2)](q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                            sin.stride(0), q.shape[1], k.shape[1], HALF=half, HQ_PAD=triton.next_power_of_2(q.shape[1]),
                            HK_PAD=triton.next_power_of_2(k.shape[1]), BLOCK_HALF=triton.next_power_of_2(half),
                            num_warps=1 if q.shape[1] * half <= 1024 else 4,  # 16 heads x 32 pairs: one warp
                            **launch())
    return q, k
