"""Triton GEMV on GGUF-quantized weights in the packed layout (ktrans.kernels.triton.quant_layout): y = x W^T for
one activation row (decode of one sequence), x [1, K], W [N, K] Q4_K, Q5_K, Q6_K or Q8_0, fp32 accumulate.

At one row the multiply is nothing; what bounds a GEMV is the work per weight (unpacking) and the bytes in flight.
This kernel keeps both small:

- No integer-to-float conversion per weight (a quarter-rate instruction on recent NVIDIA GPUs). A K-quant's code q
  is moved into the mantissa of 1.0f instead: with b bits, the bits (q << (23 - b)) | 0x3F800000 are the float
  1 + q / 2^b exactly. The weight is then one fused multiply-add, (1 + q / 2^b) * (2^b * s) - (2^b * s + dmin * m)
  with s = d * sc, the 1 folded into a per-row constant (no subtraction per weight): ggml's s * q - dmin * m up to
  two fp32 roundings (the constant's and the FMA's), as the tests' read-back of single weights bounds. Q6_K's codes
  are offset by 32: (1 + q6 / 64) * (64 * s) - 96 * s = s * (q6 - 32).
- Lane-wise sums: each row keeps one fp32 partial per lane of a sub-block over every super-block the program reads,
  summed across lanes once at the end (a reduction per sub-block, 8 to 16 per super-block, cost far more).
- The sub-block scales are read as four int32 words a row and split into bytes in registers, not as sixteen
  byte loads.

Measured on the H200 (scripts/gemv_sweep.py, doc/benchmarks.md): the tiling (rows per program, warps, K splits)
moves the time by ~5%, and loading the next super-block ahead of the current one's arithmetic (carried across loop
iterations) made it slower; at one layer's shapes every call sits near a fixed ~8 us (two launches, the split-K sum
among them) plus ~1.5 TB/s. Loading two super-blocks per iteration before either's arithmetic was slower at every
layer shape too (session 16's sweep, doc/benchmarks.md).

K is split across programs when the row tiles alone would not fill the GPU. The fp32 partials are summed in split
order, deterministically: by a second kernel (ktrans.kernels.triton.quant.qlinear), or, with GEMV["fused_sum"], by
the last program of each row tile to finish, found through a per-tile counter (one launch instead of two; the
counters are one zeroed buffer per device, so two such GEMVs must not run at once on two streams of a device). The
oracle is ktrans.kernels.torch.quant.quant_linear.
"""
from __future__ import annotations

import triton
import triton.language as tl

ONE_F32 = tl.constexpr(0x3F800000)  # the bits of 1.0f


@triton.jit
def _bits_at(v, src: tl.constexpr, dst: tl.constexpr, mask: tl.constexpr):
    """The bits of v that start at bit `src`, moved to start at bit `dst`, under `mask` (already at `dst`)."""
    if dst >= src:
        t = v << (dst - src)
    else:
        t = v >> (src - dst)
    return t & mask


@triton.jit
def _one_plus(bits):
    """1 + q / 2^b from bits = q << (23 - b) (q < 2^b), exactly: the weight (1 + q / 2^b) * (2^b * s) - (2^b * s + m)
    is then one fused multiply-add, the 1 folded into the per-row constant."""
    return (bits | ONE_F32).to(tl.float32, bitcast=True)


@triton.jit
def _byte(word, j: tl.constexpr, SIGNED: tl.constexpr):
    """Byte j of each int32 word as an int32 (sign-extended if SIGNED)."""
    if SIGNED:
        return (word << (24 - 8 * j)) >> 24
    return (word >> (8 * j)) & 0xFF


@triton.jit
def _split4(t):
    """[BN, 4] -> its four columns [BN]."""
    a, b = tl.split(tl.reshape(t, [t.shape[0], 2, 2]))  # a: columns 0, 2; b: columns 1, 3
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _load_sb(lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n, mask, QT: tl.constexpr):
    """One super-block of the row tile: (a, b, c code tensors, d, dmin (fp32 [BN]), the four scale words [BN]
    int32). Q4_K: a = codes [BN, 32]; Q5_K: b = the high bits [BN, 32]; Q6_K: a, b = the low-nibble words of
    sub-blocks 0..7 and 8..15 [BN, 16], c = the high bits [BN, 16], and dmin is d. Unused ones are zero stand-ins."""
    row = sb * N + offs_n
    none = tl.zeros([1, 1], dtype=tl.int32)
    if QT == 2:
        j = tl.arange(0, 16)
        a = tl.load(lo_ptr + row[:, None] * 32 + j[None, :], mask=mask[:, None], other=0)
        b = tl.load(lo_ptr + row[:, None] * 32 + 16 + j[None, :], mask=mask[:, None], other=0)
        c = tl.load(hi_ptr + row[:, None] * 16 + j[None, :], mask=mask[:, None], other=0)
        d = tl.load(d_ptr + row, mask=mask, other=0.0).to(tl.float32)
        dmin = d
    else:
        i = tl.arange(0, 32)
        a = tl.load(lo_ptr + row[:, None] * 32 + i[None, :], mask=mask[:, None], other=0)
        if QT == 1:
            b = tl.load(hi_ptr + row[:, None] * 32 + i[None, :], mask=mask[:, None], other=0).to(tl.int32)
        else:
            b = none
        c = none
        dd = tl.load(d_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :], mask=mask[:, None], other=0.0)
        d, dmin = tl.split(dd.to(tl.float32))
    w = tl.load(sc_ptr + row[:, None] * 4 + tl.arange(0, 4)[None, :], mask=mask[:, None], other=0)
    s0, s1, s2, s3 = _split4(w)
    return a, b, c, d, dmin, s0, s1, s2, s3


@triton.jit
def _sb_lanes(lanes, x_ptr, k0, a, b, c, d, dmin, s0, s1, s2, s3, QT: tl.constexpr):
    """lanes [BN, SUB] += the products of one loaded super-block, lane by lane."""
    if QT == 2:  # Q6_K: 16 sub-blocks of 16, signed scales, codes - 32: (1 + q6/64) 64s - 96s = s (q6 - 32)
        i = tl.arange(0, 16)
        for S in tl.static_range(16):
            word = s0 if S < 4 else (s1 if S < 8 else (s2 if S < 12 else s3))
            s = d * _byte(word, S % 4, True).to(tl.float32)
            bits = _bits_at(a if S < 8 else b, 4 * (S % 8), 17, 0x1E0000) | _bits_at(c, 2 * S, 21, 0x600000)
            w = _one_plus(bits) * (s * 64.0)[:, None] - (s * 96.0)[:, None]
            x = tl.load(x_ptr + k0 + S * 16 + i).to(tl.float32)
            lanes += w * x[None, :]
    else:  # Q4_K / Q5_K: 8 sub-blocks of 32, six-bit scales and mins times d and dmin
        i = tl.arange(0, 32)
        for S in tl.static_range(8):
            sw = s0 if S < 4 else s1
            mw = s2 if S < 4 else s3
            s = d * _byte(sw, S % 4, False).to(tl.float32)
            m = dmin * _byte(mw, S % 4, False).to(tl.float32)
            if QT == 1:  # five bits: the nibble at mantissa bits 18..21, the high bit at 22
                bits = _bits_at(a, 4 * S, 18, 0x3C0000) | _bits_at(b, S, 22, 0x400000)
                w = _one_plus(bits) * (s * 32.0)[:, None] - (s * 32.0 + m)[:, None]
            else:
                w = _one_plus(_bits_at(a, 4 * S, 19, 0x780000)) * (s * 16.0)[:, None] - (s * 16.0 + m)[:, None]
            x = tl.load(x_ptr + k0 + S * 32 + i).to(tl.float32)
            lanes += w * x[None, :]
    return lanes


@triton.jit
def _q8_0_lanes(lanes, x_ptr, lo_ptr, d_ptr, sb, N, offs_n, mask_n):
    """Q8_0: int8 codes in element order, one fp16 scale per 32 (the conversion is kept: one byte a weight)."""
    row = sb * N + offs_n
    i = tl.arange(0, 32)
    for S in tl.static_range(8):
        q = tl.load(lo_ptr + row[:, None] * 256 + S * 32 + i[None, :], mask=mask_n[:, None], other=0)
        s = tl.load(d_ptr + row * 8 + S, mask=mask_n, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + sb * 256 + S * 32 + i).to(tl.float32)
        lanes += q.to(tl.float32) * s[:, None] * x[None, :]
    return lanes


@triton.jit
def row_dot(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, sb_end, offs_n, mask_n, QT: tl.constexpr,
            BN: tl.constexpr):
    """[BN] fp32: rows offs_n of one matrix (N rows) times one activation row, over super-blocks sb0..sb_end-1,
    lane by lane and reduced once (the GEMV's program body; the MoE's few-token path calls it per expert)."""
    lanes = tl.zeros([BN, 16 if QT == 2 else 32], dtype=tl.float32)
    for sb in range(sb0, sb_end):
        if QT == 3:
            lanes = _q8_0_lanes(lanes, x_ptr, lo_ptr, d_ptr, sb, N, offs_n, mask_n)
        else:
            a, b, c, d, dmin, s0, s1, s2, s3 = _load_sb(lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n, mask_n, QT)
            lanes = _sb_lanes(lanes, x_ptr, sb * 256, a, b, c, d, dmin, s0, s1, s2, s3, QT)
    return tl.sum(lanes, axis=1)


@triton.jit(do_not_specialize=["b_lo", "b_hi", "b_d", "b_sc"])
def gemv_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, NSB, SB_PER, SPLIT,
                TILES_A, N_B, b_lo, b_hi, b_d, b_sc, QT: tl.constexpr, BN: tl.constexpr, FUSED_SUM: tl.constexpr,
                HAS_B: tl.constexpr = False):
    """Rows pid_n*BN.. of y over super-blocks pid_k*SB_PER..; sc_ptr is the scale plane as int32 words (four a row
    and super-block). SPLIT = 1: y into out_ptr. Else the fp32 partial into part_ptr row pid_k, and with FUSED_SUM
    the row tile's last program to finish (counted in cnt_ptr[pid_n], zero between calls) sums the SPLIT partials in
    order into out_ptr, as the separate sum kernel does, and zeroes the count for the next call (a graph replay).
    HAS_B: a second matrix of the same type and width (N_B rows, its planes at element offsets b_* from the first's)
    in the same launch: row tiles TILES_A.. are its, its rows follow the first's in out_ptr and its partials theirs
    in part_ptr ([SPLIT, N] then [SPLIT, N_B])."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile = pid_n
    if HAS_B:
        is_b = pid_n >= TILES_A
        tile = tl.where(is_b, pid_n - TILES_A, pid_n)
        lo_ptr += tl.where(is_b, b_lo, 0)
        hi_ptr += tl.where(is_b, b_hi, 0)
        d_ptr += tl.where(is_b, b_d, 0)
        sc_ptr += tl.where(is_b, b_sc, 0)
        out_ptr += tl.where(is_b, N, 0)
        part_ptr += tl.where(is_b, SPLIT * N, 0)
        N = tl.where(is_b, N_B, N)
    offs_n = tile * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    sb0 = pid_k * SB_PER
    acc = row_dot(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, tl.minimum(sb0 + SB_PER, NSB), offs_n, mask_n, QT, BN)
    if SPLIT == 1:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(part_ptr + pid_k * N + offs_n, acc, mask=mask_n)
        if FUSED_SUM:
            tl.debug_barrier()  # every thread's partial stored before the count's release
            if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
                total = tl.zeros([BN], dtype=tl.float32)
                for s in range(SPLIT):
                    total += tl.load(part_ptr + s * N + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)
