"""The split-K attention decode's merge (ktrans.kernels.triton.attention.paged_decode): per (sequence, query head,
chunk of the head's dims), the live splits' partial outputs weighed by their log-sum-exps, in one online pass. The
oracle is ktrans/kernels/torch/attention.py's paged_attention_decode (through paged_decode's tests).

What follows a context's length must not specialize the kernel, or a long context's first step compiles inside a
user's request: the split count and split length are plain integers Triton does not specialize on (it would on
multiples of 16 and on 1: a 32k context at batch 1 has 128 splits), the lengths' pointer not on its alignment (the
runner's is a view at an offset). The read width (S_STEP) does follow the count; the warm-up compiles each
(split_counts_by_shape).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton import unaligned
from ktrans.kernels.triton.pdl import enter, launch

# The merge reads a plan's splits in one go (both the log-sum-exps and the partials, one load each), up to
# MERGE_MAX_STEP of them a read, and holds at most MERGE_TILE partial values a program: with many splits, fewer dims a
# program. Before session 22 it read every split 16 at a time, twice (eighteen dependent reads of the L2 at 132
# splits); the one pass took the whole decode at 32k keys, B=1, from 36.4-37.2 to 33.4-35.3 us on the H200, the merge
# alone now ~3 us (scripts/attention_decode_sweep.py, doc/benchmarks.md).
MERGE_MAX_STEP = 256
MERGE_TILE = 4096


@triton.jit
def sigmoid_gate(o, g, DTYPE: tl.constexpr):
    """o (fp32, already rounded to DTYPE) times sigmoid(g) rounded to DTYPE, as torch's `out * torch.sigmoid(gate)`
    in DTYPE rounds it; returned in DTYPE. The one copy of the output gate's arithmetic (attention.output_gate and
    the merge's gated store)."""
    s = tl.sigmoid(g.to(tl.float32)).to(DTYPE).to(tl.float32)
    return (o * s).to(DTYPE)


@triton.jit(do_not_specialize=["n_splits", "split_tokens"], **unaligned("LENS"))
def _decode_merge_kernel(OP, LSE, O, LENS, G, stride_ob, stride_oh, stride_gb, n_splits, split_tokens,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNK: tl.constexpr, S_STEP: tl.constexpr,
                         HAS_GATE: tl.constexpr = False, PDL: tl.constexpr = False):
    """Merge the live splits of one (sequence, query head, chunk of D_CHUNK dims), those that hold keys of the
    sequence's length, in one online pass: S_STEP splits a read, their log-sum-exps and partials loaded together,
    the running maximum rescaling what came before. A plan's splits are one read up to MERGE_MAX_STEP of them.
    HAS_GATE: the result, rounded to O's type, times sigmoid of the head's gate half of G's row ([q | gate] per
    head, as q_proj gives it), bitwise what attention.output_gate makes of the ungated store."""
    enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    L = tl.load(LENS + b).to(tl.int32)
    n_live = tl.minimum(n_splits, tl.maximum(1, tl.cdiv(L, split_tokens)))  # split 0 holds key 0
    base = (b * tl.num_programs(1) + h) * n_splits
    offs_d = tl.program_id(2) * D_CHUNK + tl.arange(0, D_CHUNK)
    m = tl.max(tl.full([S_STEP], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([S_STEP], tl.float32), 0)
    acc = tl.zeros([D_CHUNK], tl.float32)
    for s0 in range(0, n_live, S_STEP):
        ss = s0 + tl.arange(0, S_STEP)
        ms = ss < n_live
        lse = tl.load(LSE + base + ss, mask=ms, other=float("-inf"))
        part = tl.load(OP + (base + ss)[:, None] * BLOCK_D + offs_d[None, :], mask=ms[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite from the first read on: split 0 is live
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(part * w[:, None], 0)
        m = m_new
    res = (acc / total).to(O.dtype.element_ty)
    if HAS_GATE:
        g = tl.load(G + b * stride_gb + h * (2 * D) + D + offs_d, mask=offs_d < D, other=0.0)
        res = sigmoid_gate(res.to(tl.float32), g, O.dtype.element_ty)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, res, mask=offs_d < D)


def merge_shape(num_splits: int, block_d: int) -> tuple[int, int]:
    """(S_STEP, D_CHUNK) of the merge for a plan's split count: every split in one read up to MERGE_MAX_STEP, and
    S_STEP * D_CHUNK <= MERGE_TILE partials a program (at least 16 dims, at most the head's)."""
    step = min(triton.next_power_of_2(max(1, num_splits)), MERGE_MAX_STEP)
    return step, min(block_d, max(16, MERGE_TILE // step))


def merge(part: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, kv_lens: torch.Tensor, num_splits: int,
          split_tokens: int, block_d: int, gate: torch.Tensor | None = None) -> None:
    """o [B, Hq, D] from the splits' partials part [B, Hq, S, block_d] and log-sum-exps lse [B, Hq, S] (fp32, flat),
    reading only the splits that hold keys of each sequence's length (kv_lens [B] on the device). gate: q_proj's
    output [B, Hq * 2D] (per head [q | gate], unit stride), whose gate halves' sigmoids the result is multiplied by."""
    bsz, hq, d = o.shape
    if gate is not None and (gate.shape != (bsz, 2 * hq * d) or gate.stride(-1) != 1):
        raise ValueError(f"merge: gate {tuple(gate.shape)} for an output {tuple(o.shape)} (needs [B, 2 * Hq * D], "
                         "unit stride)")
    step, chunk = merge_shape(num_splits, block_d)
    _decode_merge_kernel[(bsz, hq, block_d // chunk)](
        part, lse, o, kv_lens, o if gate is None else gate, o.stride(0), o.stride(1),
        0 if gate is None else gate.stride(0), num_splits, split_tokens, D=d, BLOCK_D=block_d, D_CHUNK=chunk,
        S_STEP=step, HAS_GATE=gate is not None, **launch())


def split_counts_by_shape(most: int, block_d: int) -> list[int]:
    """The smallest split count of each merge shape among 1..most: one merge compile each covers every count."""
    firsts: dict[tuple[int, int], int] = {}
    for n in range(1, most + 1):
        firsts.setdefault(merge_shape(n, block_d), n)
    return sorted(firsts.values())
