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

A second body, `_row_dot_rows` (GEMV["rows"], opt-in), has each row's super-block read by H threads, so a
sub-block's scale is made once a row rather than once per lane group, and reads x as int32 words of two bf16: ~16%
fewer instructions a weight on sm_90, and no faster on the H200 (session 18): what holds the GEMV is its chain of
latencies (the weights' first bytes, the split partials' store, the counter's release, the last program's reload).
Under programmatic dependent launch (ktrans.kernels.triton.pdl) `row_dot` loads the first super-block's weights
before waiting for the predecessor, so the first of those latencies passes while the predecessor runs.

A third body, `quant_gemv_mma.row_dot_mma` (GEMV["mma"], opt-in), multiplies on tensor cores: a super-block's codes
become bf16 1 + q / 2^b (exact in bf16's mantissa) by inline PTX, a shift and a logic op a weight pair, and one dot
against x placed block-diagonally gives every row's sub-block sums, which the sub-block scales then multiply: ~2.7
instructions a weight at Q4_K. It is slower on the H100 at every tiling (session 32): Triton hands the dot its
dequantized operand through shared memory, 4 bytes of traffic a weight, with barriers every super-block.

K is split across programs when the row tiles alone would not fill the GPU. The fp32 partials are summed in split
order, deterministically: by a second kernel (ktrans.kernels.triton.quant.qlinear), or, with GEMV["fused_sum"], by
the last program of each row tile to finish, found through a per-tile counter (one launch instead of two; the
counters are one zeroed buffer per device, so two such GEMVs must not run at once on two streams of a device). The
oracle is ktrans.kernels.torch.quant.quant_linear.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter
from ktrans.kernels.triton.planes import second_matrix
from ktrans.kernels.triton.quant_gemv_mma import row_dot_mma

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
def _pick8(S: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """v_S for a compile-time S (values kept in registers across an unrolled loop)."""
    return v0 if S == 0 else (v1 if S == 1 else (v2 if S == 2 else (v3 if S == 3 else (
        v4 if S == 4 else (v5 if S == 5 else (v6 if S == 6 else v7))))))


@triton.jit
def _scale8(d, dmin, s0, s1, s2, s3, S: tl.constexpr, QT: tl.constexpr, HALF: tl.constexpr):
    """(c, k) [BN] of sub-block S (Q6_K: 8 * HALF + S) such that its weight is (1 + q / 2^b) * c - k (_one_plus)."""
    if QT == 2:  # Q6_K: signed scales, codes offset by 32
        word = s0 if 8 * HALF + S < 4 else (s1 if 8 * HALF + S < 8 else (s2 if 8 * HALF + S < 12 else s3))
        s = d * _byte(word, S % 4, True).to(tl.float32)
        return s * 64.0, s * 96.0
    s = d * _byte(s0 if S < 4 else s1, S % 4, False).to(tl.float32)
    m = dmin * _byte(s2 if S < 4 else s3, S % 4, False).to(tl.float32)
    c = s * (32.0 if QT == 1 else 16.0)
    return c, c + m


@triton.jit
def _halves(t):
    """[BN, H, 4] -> its even and odd columns, [BN, H, 2] each."""
    return tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2]))


@triton.jit
def _weights(a, b, c, k, S: tl.constexpr, QT: tl.constexpr, HALF: tl.constexpr):
    """The weights of sub-block S (Q6_K: 8 * HALF + S) at the positions of code words a (high bits b)."""
    if QT == 2:
        bits = _bits_at(a, 4 * S, 17, 0x1E0000) | _bits_at(b, 2 * (8 * HALF + S), 21, 0x600000)
    elif QT == 1:
        bits = _bits_at(a, 4 * S, 18, 0x3C0000) | _bits_at(b, S, 22, 0x400000)
    else:
        bits = _bits_at(a, 4 * S, 19, 0x780000)
    return _one_plus(bits) * c[:, None, None] - k[:, None, None]


@triton.jit
def _rows_half(even, odd, x_ptr, k0, lo_ptr, hi_ptr, row, mask, d, dmin, s0, s1, s2, s3, QT: tl.constexpr,
               HALF: tl.constexpr, H: tl.constexpr):
    """even, odd [BN, H, 2] += one super-block's products (Q6_K: its sub-blocks 8 * HALF..), four word positions
    of each of the H parts of a row at a time (even and odd positions apart: x is read as int32 words of two bf16,
    each half an fp32 by one operation). A row's sub-block scale is made by the H threads that share the row, not
    once per lane group."""
    c0, k0_ = _scale8(d, dmin, s0, s1, s2, s3, 0, QT, HALF)
    c1, k1 = _scale8(d, dmin, s0, s1, s2, s3, 1, QT, HALF)
    c2, k2 = _scale8(d, dmin, s0, s1, s2, s3, 2, QT, HALF)
    c3, k3 = _scale8(d, dmin, s0, s1, s2, s3, 3, QT, HALF)
    c4, k4 = _scale8(d, dmin, s0, s1, s2, s3, 4, QT, HALF)
    c5, k5 = _scale8(d, dmin, s0, s1, s2, s3, 5, QT, HALF)
    c6, k6 = _scale8(d, dmin, s0, s1, s2, s3, 6, QT, HALF)
    c7, k7 = _scale8(d, dmin, s0, s1, s2, s3, 7, QT, HALF)
    # a sub-block's positions (= the code words of a (half) super-block): 16 for Q6_K, else 32
    j = tl.arange(0, 4)[None, None, :]
    h = tl.arange(0, H)[None, :, None] * ((16 if QT == 2 else 32) // H)
    xh = tl.arange(0, H)[None, :, None] * ((16 if QT == 2 else 32) // H // 2) + tl.arange(0, 2)[None, None, :]
    xw_ptr = x_ptr.to(tl.pointer_type(tl.int32))
    r = row[:, None, None]
    m = mask[:, None, None]
    for g in tl.static_range((16 if QT == 2 else 32) // H // 4):  # positions h + 4g.. of each part
        a_e, a_o = _halves(tl.load(lo_ptr + r * 32 + 16 * HALF + h + 4 * g + j, mask=m, other=0))
        b_e = a_e
        b_o = a_o
        if QT == 1:
            b_e, b_o = _halves(tl.load(hi_ptr + r * 32 + h + 4 * g + j, mask=m, other=0).to(tl.int32))
        if QT == 2:
            b_e, b_o = _halves(tl.load(hi_ptr + r * 16 + h + 4 * g + j, mask=m, other=0))
        for S in tl.static_range(8):
            c = _pick8(S, c0, c1, c2, c3, c4, c5, c6, c7)
            k = _pick8(S, k0_, k1, k2, k3, k4, k5, k6, k7)
            xw = tl.load(xw_ptr + (k0 + (8 * HALF + S) * (16 if QT == 2 else 32) + 4 * g) // 2 + xh)  # bf16 pairs
            x_e = (xw << 16).to(tl.float32, bitcast=True)
            x_o = (xw & -65536).to(tl.float32, bitcast=True)
            even += _weights(a_e, b_e, c, k, S, QT, HALF) * x_e
            odd += _weights(a_o, b_o, c, k, S, QT, HALF) * x_o
    return even, odd


@triton.jit
def _row_dot_rows(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, sb_end, offs_n, mask_n, QT: tl.constexpr,
                  BN: tl.constexpr, H: tl.constexpr):
    """row_dot with each row's super-block read by H threads ([BN, H, 4] tiles of four int32 words): the K-quant
    types, bf16 x."""
    even = tl.zeros([BN, H, 2], dtype=tl.float32)
    odd = tl.zeros([BN, H, 2], dtype=tl.float32)
    for sb in range(sb0, sb_end):
        row = sb * N + offs_n
        if QT == 2:
            d = tl.load(d_ptr + row, mask=mask_n, other=0.0).to(tl.float32)
            dmin = d
        else:
            dd = tl.load(d_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :], mask=mask_n[:, None], other=0.0)
            d, dmin = tl.split(dd.to(tl.float32))
        w = tl.load(sc_ptr + row[:, None] * 4 + tl.arange(0, 4)[None, :], mask=mask_n[:, None], other=0)
        s0, s1, s2, s3 = _split4(w)
        even, odd = _rows_half(even, odd, x_ptr, sb * 256, lo_ptr, hi_ptr, row, mask_n, d, dmin, s0, s1, s2, s3, QT,
                               0, H)
        if QT == 2:
            even, odd = _rows_half(even, odd, x_ptr, sb * 256, lo_ptr, hi_ptr, row, mask_n, d, dmin, s0, s1, s2, s3,
                                   QT, 1, H)
    return tl.sum(tl.sum(even + odd, axis=2), axis=1)



@triton.jit
def _lanes_step(lanes, x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n, mask_n, QT: tl.constexpr):
    """lanes += super-block sb's products (row_dot's loop body)."""
    if QT == 3:
        lanes = _q8_0_lanes(lanes, x_ptr, lo_ptr, d_ptr, sb, N, offs_n, mask_n)
    else:
        a, b, c, d, dmin, s0, s1, s2, s3 = _load_sb(lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n, mask_n, QT)
        lanes = _sb_lanes(lanes, x_ptr, sb * 256, a, b, c, d, dmin, s0, s1, s2, s3, QT)
    return lanes


@triton.jit
def row_dot(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, sb_end, offs_n, mask_n, QT: tl.constexpr,
            BN: tl.constexpr, ROWS: tl.constexpr = 0, PDL: tl.constexpr = False, PIPE: tl.constexpr = 0,
            MMA: tl.constexpr = 0):
    """[BN] fp32: rows offs_n of one matrix (N rows) times one activation row, over super-blocks sb0..sb_end-1,
    lane by lane and reduced once (the GEMV's program body; the MoE's few-token path calls it per expert).
    ROWS > 0: each row's super-block read by ROWS threads (_row_dot_rows; the K-quant types, bf16 x).
    PDL: the kernel has not yet waited for its predecessor (ktrans.kernels.triton.pdl): the first super-block's
    weights, which no kernel writes, are loaded before the wait, so their latency passes while the predecessor runs;
    x and everything else after it.
    PIPE > 0: the super-block loop runs as tl.range(num_stages=PIPE), so Triton's pipeliner copies the next PIPE - 1
    super-blocks' weights into shared memory (cp.async) while the current one's arithmetic runs. A plain range
    (PIPE = 0) is not pipelined at all: Triton multi-buffers only loads that feed a dot unless the loop asks for
    stages (Triton 3.6 and 3.9 compiled for sm_90: 512 B of shared memory and no cp.async at any launch num_stages;
    9,216 B and cp.async with PIPE = 3).
    MMA > 0: the tensor-core body (quant_gemv_mma.row_dot_mma; Q4_K and Q6_K, bf16 x; 2: its dot transposed)."""
    if MMA:
        return row_dot_mma(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, sb_end, offs_n, mask_n, QT, BN, PDL, PIPE,
                            MMA)
    if ROWS > 0 and QT != 3:
        enter(PDL)
        return _row_dot_rows(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, sb_end, offs_n, mask_n, QT, BN, ROWS)
    lanes = tl.zeros([BN, 16 if QT == 2 else 32], dtype=tl.float32)
    first = sb0
    if PDL and QT != 3:
        a, b, c, d, dmin, s0, s1, s2, s3 = _load_sb(lo_ptr, hi_ptr, d_ptr, sc_ptr, sb0, N, offs_n, mask_n, QT)
        enter(PDL)
        lanes = _sb_lanes(lanes, x_ptr, sb0 * 256, a, b, c, d, dmin, s0, s1, s2, s3, QT)
        first = sb0 + 1
    else:
        enter(PDL)
    if PIPE > 0:
        for sb in tl.range(first, sb_end, num_stages=PIPE):
            lanes = _lanes_step(lanes, x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n, mask_n, QT)
    else:
        for sb in range(first, sb_end):
            lanes = _lanes_step(lanes, x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n, mask_n, QT)
    return tl.sum(lanes, axis=1)


@triton.jit(do_not_specialize=["b_lo", "b_hi", "b_d", "b_sc"])
def gemv_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, NSB, SB_PER, SPLIT,
                TILES_A, N_B, b_lo, b_hi, b_d, b_sc, QT: tl.constexpr, BN: tl.constexpr, FUSED_SUM: tl.constexpr,
                HAS_B: tl.constexpr = False, ROWS: tl.constexpr = 0, PDL: tl.constexpr = False,
                PIPE: tl.constexpr = 0, MMA: tl.constexpr = 0):
    """Rows pid_n*BN.. of y over super-blocks pid_k*SB_PER..; sc_ptr is the scale plane as int32 words (four a row
    and super-block). SPLIT = 1: y into out_ptr. Else the fp32 partial into part_ptr row pid_k, and with FUSED_SUM
    the row tile's last program to finish (counted in cnt_ptr[pid_n], zero between calls) sums the SPLIT partials in
    order into out_ptr, as the separate sum kernel does, and zeroes the count for the next call (a graph replay).
    HAS_B: a second matrix of the same type and width (N_B rows, its planes at element offsets b_* from the first's)
    in the same launch: row tiles TILES_A.. are its, its rows follow the first's in out_ptr and its partials theirs
    in part_ptr ([SPLIT, N] then [SPLIT, N_B]). PDL: row_dot waits for the predecessor, after its first weights.
    PIPE: row_dot's pipelined super-block loop (its stages; 0: none)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile = pid_n
    if HAS_B:
        tile, lo_ptr, hi_ptr, d_ptr, sc_ptr, out_ptr, part_ptr, N = second_matrix(
            pid_n, TILES_A, N, N_B, SPLIT, lo_ptr, hi_ptr, d_ptr, sc_ptr, out_ptr, part_ptr, b_lo, b_hi, b_d, b_sc)
    offs_n = tile * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    sb0 = pid_k * SB_PER
    acc = row_dot(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, tl.minimum(sb0 + SB_PER, NSB), offs_n, mask_n, QT, BN,
                  ROWS, PDL, PIPE, MMA)
    store_split(acc, offs_n, mask_n, out_ptr, part_ptr, cnt_ptr + pid_n, pid_k, SPLIT, N, FUSED_SUM)


@triton.jit
def store_split(y, offs, mask, out_ptr, part_ptr, cnt, pid_k, SPLIT, STRIDE, FUSED: tl.constexpr):
    """A program's fp32 result y at `offs`: SPLIT = 1, into out_ptr (its dtype); else its K split's partial into
    part_ptr + pid_k * STRIDE, and with FUSED the tile's last program to finish (counted at `cnt`, zero between
    calls) sums the SPLIT partials in split order into out_ptr, as the separate sum kernel does, and zeroes the
    count for the next call (a graph replay). The Gluon bodies' twin is gluon_common.store_split."""
    if SPLIT == 1:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * STRIDE + offs, y, mask=mask)
        if FUSED:
            tl.debug_barrier()  # every thread's partial stored before the count's release
            if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
                total = tl.zeros_like(y)
                for s in range(SPLIT):
                    total += tl.load(part_ptr + s * STRIDE + offs, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt, 0)
