"""Depthwise causal conv1d with SiLU for prefill, varlen, in Triton (the short conv in front of Gated DeltaNet).

The oracle is `ktrans/kernels/torch/conv.py` `causal_conv1d` (one sequence). Here one launch covers every planned
sequence of a flat batch (the chunk table of `gated_delta.plan_chunks`): one program per (chunk of <= 64 tokens,
block of channels). A token among a sequence's first K-1 reads its left context from the sequence's carried conv
window in the state pool (`conv_pool[slot]`, [C, K-1], oldest first), or zeros for a fresh sequence. The
sequence's final window (its last K-1 inputs, reaching back into the carried one when the sequence is shorter)
is written to the same slot by the program of its first chunk, the only program that reads the old window, after
a barrier, so no program reads a window another has already replaced.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.gated_delta import CHUNK, ChunkPlan


@triton.jit
def _conv_kernel(x_ptr, w_ptr, y_ptr, conv_ptr, chunk_start, chunk_len, chunk_seq, first_chunk, seq_start, seq_slot,
                 seq_fresh, stride_xt, stride_yt, stride_cs, stride_cc, C,
                 K: tl.constexpr, KM: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr):
    c = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = ch < C
    row0 = tl.load(chunk_start + c)
    n = tl.load(chunk_len + c)
    s = tl.load(chunk_seq + c)
    ss = tl.load(seq_start + s)
    slot = tl.load(seq_slot + s)
    # Masks are built from tensors only (the interpreter rejects a scalar bool in a mask): a window column p < ss
    # is read when p >= lo, and lo = ss (no column) for a fresh sequence.
    lo = ss - (K - 1) * (1 - tl.load(seq_fresh + s))
    rt = tl.arange(0, BT)
    t = row0 + rt
    tmask = rt < n
    state = conv_ptr + slot * stride_cs + ch[None, :] * stride_cc
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j  # the input this tap reads
        in_seq = p >= ss
        xv = tl.load(x_ptr + p[:, None].to(tl.int64) * stride_xt + ch[None, :],
                     mask=(tmask & in_seq)[:, None] & cmask[None, :], other=0.0)
        hist = (tmask & (p < ss) & (p >= lo))[:, None] & cmask[None, :]
        sv = tl.load(state + (K - 1 + p - ss)[:, None], mask=hist, other=0.0)
        wj = tl.load(w_ptr + ch * K + j, mask=cmask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + t[:, None].to(tl.int64) * stride_yt + ch[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])

    # The final window [C, K-1]: inputs se-(K-1) .. se-1, from x or, before the sequence's start, the carried window.
    last = tl.load(first_chunk + s + 1) - 1
    se = tl.load(chunk_start + last) + tl.load(chunk_len + last)
    m = tl.arange(0, KM)
    p = se - (K - 1) + m
    mmask = (m < K - 1)[:, None] & cmask[None, :]
    xv = tl.load(x_ptr + p[:, None].to(tl.int64) * stride_xt + ch[None, :], mask=mmask & (p >= ss)[:, None],
                 other=0.0)
    sv = tl.load(state + (K - 1 + p - ss)[:, None], mask=mmask & ((p < ss) & (p >= lo))[:, None], other=0.0)
    window = xv.to(tl.float32) + sv.to(tl.float32)
    tl.debug_barrier()  # every thread of this program has read the old window before any writes it
    is_first = (tl.load(first_chunk + s) == c).to(tl.int32)
    tl.store(state + m[:, None], window.to(conv_ptr.dtype.element_ty),
             mask=(m < (K - 1) * is_first)[:, None] & cmask[None, :])


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, plan: ChunkPlan,
                         out: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """The conv over the planned sequences of a flat batch. x [T, C] (token stride free, channels contiguous);
    weight [C, K]; conv_pool [slots, C, K-1] (any dtype), read at each sequence's slot unless fresh and written
    there with its final window. Returns y [T, C] in x's dtype (rows outside the plan untouched or unset)."""
    t, channels = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, width) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{channels}, K], got {tuple(weight.shape)}")
    if conv_pool.shape[1:] != (channels, width - 1) or conv_pool.stride(2) != 1:
        raise ValueError(f"conv_pool must be [slots, {channels}, {width - 1}] with contiguous windows, got "
                         f"{tuple(conv_pool.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along channels")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r} (expected 'silu' or None)")
    if width - 1 > plan.min_first_len:
        raise ValueError(f"a first chunk of {plan.min_first_len} tokens is shorter than the conv's window "
                         f"({width - 1}): plan the conv's chunks without start positions")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if plan.num_chunks == 0:
        return out
    bc = 64
    _conv_kernel[(plan.num_chunks, triton.cdiv(channels, bc))](
        x, weight, out, conv_pool, plan.chunk_start, plan.chunk_len, plan.chunk_seq, plan.first_chunk,
        plan.seq_start, plan.seq_slot, plan.seq_fresh, x.stride(0), out.stride(0), conv_pool.stride(0),
        conv_pool.stride(1), channels, K=width, KM=max(2, triton.next_power_of_2(width - 1)), BT=CHUNK, BC=bc,
        SILU=activation is not None, num_warps=4)
    return out
