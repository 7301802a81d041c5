"""The one-row Q4_K / Q6_K GEMV on tensor cores with the dequantized weights kept in registers (Gluon): y = x W^T for
one bf16 activation row, W [N, K] in the packed layout (ktrans.kernels.triton.quant_layout). Opt-in (quant.GEMV["reg"],
`KTRANS_GEMV_REG`); the oracle is ktrans.kernels.torch.quant.quant_linear.

Why a second tensor-core body. quant_gemv_mma.row_dot_mma (plain Triton) spends ~2.7 instructions a weight but is slower
than the CUDA-core body: Triton lays the dequantized tile out for the elementwise code, then converts it to the dot's
operand layout through shared memory (4 bytes of shared traffic a weight, barriers every super-block; session 32).
Gluon states layouts explicitly, so here the code words are loaded in the layout whose dequantization *is* the
mma.m16n8k16 A operand, and every layout conversion on the way is asserted trivial at compile time (no data moves):

- The A operand (weights, [BM, 256] a super-block, kWidth 2) gives thread (g, t) of a warp rows g and g + 8 of each
  16-row tile and, of each 16-column K tile, columns 2t, 2t + 1, 2t + 8, 2t + 9. The dot's K order is free (x follows
  it), so column k = 64 j + 8 m + 2 a + e is taken to be weight 8 a + m of sub-block j + 4 e. Thread t then holds
  code words 8 t .. 8 t + 7 of its rows: two 16-byte loads a row, and nibbles j and j + 4 of one word are one
  register's bf16 pair.
- A pair becomes bf16 1 + q / 128 by one logic op (lop3: (w >> 4 j) & 0x000F000F | the bits of two 1.0s; exact,
  bf16 has 7 mantissa bits), 7 instructions a code word of 8 weights.
- The B operand is x placed by sub-block: B[k, c] = x(k) where k's sub-block is c, else 0 (8 columns, one a
  sub-block), so P = A B holds every row's 8 sub-block sums of (1 + q / 128) x, exact bf16 products summed in fp32.
  A second dot of an all-ones A against the same B gives the sums of x, X, in the accumulator's own layout.
- ggml's sum over a sub-block, d sc Σ q x - dmin m Σ x, is then 128 d sc (P - X) - dmin m X, applied once a row and
  sub-block; the 8 columns are summed across a row's 4 threads at the end.
- Q6_K (16 sub-blocks of 16) takes the same order over its 32 low-nibble words (words 16.. hold sub-blocks 8..15),
  its two high bits joined in by quant_gemv's Q6_K PTX (1 + q6 / 64, exact), 16 accumulator columns, and
  d sc (q6 - 32) summed as d sc (64 P - 96 X).

sm_90 SASS (Triton 3.6 and 3.9, 4 warps, 256 rows a program): ~2.2-2.3 instructions a weight, no shared memory, ~150
registers; the lane-group body takes 8.5. It runs on every GPU with mma.sync bf16 (sm_80 and newer).

K is split across programs as in quant_gemv (fp32 partials summed in split order, by the last program of a row tile
when FUSED_SUM), so its results equal neither body's bit for bit; they are ggml's products summed in fp32.
"""
from __future__ import annotations

import functools

import torch

from ktrans.kernels.triton.gluon_common import _GLUON, _q4_asm, available, runs_on  # noqa: F401 (this body's API)
from ktrans.kernels.triton.planes import expert_planes, second_matrix

if _GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from ktrans.kernels.triton.gluon_common import (_barrier, _enter, dequant_rows, store_split,
                                                    tile_copies, word_offsets)

TYPES = ("Q4_K", "Q6_K")


def applies(x: torch.Tensor, qtype: str) -> bool:
    """Whether activations x times a matrix of `qtype` can take this body: a type it covers, bf16 x, and runs_on."""
    return qtype in TYPES and x.dtype == torch.bfloat16 and runs_on(x.device)


if _GLUON:
    @functools.lru_cache(maxsize=None)
    def layouts(warps: int, reps: int) -> tuple:
        """(MMA, A, B, WORDS) for `warps` warps stacked down the rows, `reps` 16-row tiles a warp (BM = 16 warps reps
        rows a program): the accumulator's mma.m16n8k16 layout, its two operands', and the code words' [BM, 4, 8]
        (word 8 a + m of each row) from which the dequantization gives the A operand with no data movement."""
        if warps & (warps - 1) or reps & (reps - 1) or not 1 <= reps <= 8:
            raise ValueError(f"quant_gemv_reg: warps ({warps}) and row tiles a warp ({reps}, at most 8) must be "
                             "powers of two")
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
        a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # registers: the 8 consecutive words (two 16-byte loads), then rows + 8 and the further row tiles; lanes:
        # the word group a (A's column pair), then rows 0..7; warps: 16-row tiles
        reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]]
        reg += [[16 * warps << i, 0, 0] for i in range(reps.bit_length() - 1)]
        lane = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp = [[16 << i, 0, 0] for i in range(warps.bit_length() - 1)]
        words = gl.DistributedLinearLayout(reg, lane, warp, [], [16 * warps * reps, 4, 8])
        return mma, a, b, words

    def tiling(flag: str, bn: int, warps: int) -> dict:
        """The kernels' tiling constexprs (W, R and the layouts) for `bn` rows a program on `warps` warps; `flag`,
        the setting they came from, names a tiling that does not divide into 16-row tiles a warp."""
        if bn % (16 * warps):
            raise ValueError(f"{flag}: {bn} rows a program is not a multiple of 16 x {warps} warps")
        reps = bn // (16 * warps)
        mma, la, lb, lw = layouts(warps, reps)
        return {"W": warps, "R": reps, "MMA": mma, "LA": la, "LB": lb, "LW": lw}

    @gluon.jit
    def _codes(words, hi, BM: gl.constexpr, LA: gl.constexpr, QT: gl.constexpr):
        """Code words [BM, 4, 8] (word 8 a + m) -> the A operand [BM, 256] bf16 (gluon_common.dequant_rows)."""
        return gl.convert_layout(dequant_rows(words, hi, BM, QT), LA, assert_trivial=True)

    @gluon.jit
    def _dot(a, b, NC: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, CH: gl.constexpr):
        """a [M, 256] @ b [256, NC] in fp32 (from zero). CH = 2: as two independent chains of 8 mma over K's halves
        (column bit 7, a register bit of both operands: the split moves no data), summed after; CH = 1: one chain
        of 16."""
        M: gl.constexpr = a.shape[0]
        z = gl.zeros([M, NC], gl.float32, layout=MMA)
        if CH == 2:
            a0, a1 = gl.split(gl.permute(gl.reshape(a, [M, 2, 128]), (0, 2, 1)))
            b0, b1 = gl.split(gl.permute(gl.reshape(b, [2, 128, NC]), (1, 2, 0)))
            p = mma_v2(gl.convert_layout(a0, LA, assert_trivial=True), gl.convert_layout(b0, LB, assert_trivial=True),
                       z)
            q = mma_v2(gl.convert_layout(a1, LA, assert_trivial=True), gl.convert_layout(b1, LB, assert_trivial=True),
                       z)
            return p + q
        return mma_v2(a, b, z)

    @gluon.jit
    def _scaled(acc, p, xs, d_ptr, sc_ptr, row, cmask, c_c, QT: gl.constexpr):
        """acc [BM, NC] += one super-block's sub-block sums p (of the codes times x) and xs (of x) scaled by the rows'
        scales: ggml's d sc q - dmin m summed over a sub-block is 128 d sc (P - X) - dmin m X (Q4_K), d sc (q6 - 32)
        summed is d sc (64 (P - X) - 32 X) (Q6_K). row: the rows' plane index (super-block-major)."""
        s = gl.load(sc_ptr + row[:, None] * 16 + c_c[None, :], mask=cmask[:, None], other=0).to(gl.float32)
        if QT == 2:
            d = gl.load(d_ptr + row, mask=cmask, other=0.0).to(gl.float32)
            return acc + (s * d[:, None]) * (64.0 * p - 96.0 * xs)
        mn = gl.load(sc_ptr + row[:, None] * 16 + 8 + c_c[None, :], mask=cmask[:, None], other=0).to(gl.float32)
        d = gl.load(d_ptr + row * 2, mask=cmask, other=0.0).to(gl.float32)
        dmin = gl.load(d_ptr + row * 2 + 1, mask=cmask, other=0.0).to(gl.float32)
        return _scaled_q4(acc, p, xs, s, mn, d, dmin)

    @gluon.jit
    def _scaled_q4(acc, p, xs, s, mn, d, dmin):
        """_scaled's Q4_K arithmetic, the scales s, mins mn [BM, 8] and d, dmin [BM] given (fp32)."""
        return acc + (s * (128.0 * d)[:, None]) * (p - xs) - (mn * dmin[:, None]) * xs

    @gluon.jit
    def _x_sums(ones, xb, NC: gl.constexpr, R: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr,
                CH: gl.constexpr):
        """The sums of x by sub-block, [BM, NC] in the accumulator's layout: one all-ones 16-row tile's dot against
        B, copied to the warp's R row tiles (register copies)."""
        return gl.convert_layout(tile_copies(_dot(ones, xb, NC, MMA, LA, LB, CH), R, 0), MMA, assert_trivial=True)

    @gluon.jit
    def row_sums(x_row, lo_ptr, hi_ptr, d_ptr, sc_ptr, NR, row0, n_valid, OFF2, sb0, sb1, QT: gl.constexpr,
                 W: gl.constexpr, R: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr,
                 LW: gl.constexpr, PF: gl.constexpr, TWO: gl.constexpr, CH: gl.constexpr = 1):
        """(y, y2, rows, mask): rows row0.. (BM of them, those < n_valid real) of a matrix whose planes hold NR rows
        a super-block, times the bf16 activation row x_row, over super-blocks sb0..sb1-1, fp32 [BM] in
        SliceLayout(1, MMA); with TWO also rows row0 + OFF2.. (y2; else y2 is y), which share x's operand (the MoE's
        gate and up). PF: the next super-block's code words loaded before the current one's arithmetic (one matrix
        only). CH: each dot as CH independent mma chains (_dot). Q6_K has 16 sub-blocks of 16: 16 accumulator
        columns, words 16.. (threads a = 2, 3) hold sub-blocks 8..15, and a word's high bits are those of high-bit
        word (8 a + m) % 16 at bits 16 (a // 2) + 2s."""
        BM: gl.constexpr = 16 * W * R
        NC: gl.constexpr = 16 if QT == 2 else 8  # sub-blocks a super-block, the accumulator's columns
        SPAN: gl.constexpr = 256 // NC  # weights a sub-block
        # the code words: row n, word 8 a + m
        woff, wmask, hoff, hshift = word_offsets(row0, n_valid, BM, LW)
        # B: x by sub-block, column k = 64 j + 8 m + 2 a + e (word 8 a + m, nibble s = j + 4 e) at row c = its
        # sub-block: s (Q4_K), 8 (a // 2) + s (Q6_K)
        kk = gl.arange(0, 256, layout=gl.SliceLayout(1, LB))
        cc = gl.arange(0, NC, layout=gl.SliceLayout(0, LB))
        aa = (kk // 2) % 4
        sub = kk // 64 + 4 * (kk % 2)
        word = aa * 8 + (kk // 8) % 8
        if QT == 2:
            sub += 8 * (aa // 2)
            word = word % 16
        xoff = (sub * SPAN + word)[:, None] + cc[None, :] * 0
        xmask = sub[:, None] == cc[None, :]
        # the scales, in the accumulator's layout
        n_c = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
        c_c = gl.arange(0, NC, layout=gl.SliceLayout(0, MMA))
        cmask = n_c < n_valid
        ones = gl.full([16 * W, 256], 1.0, gl.bfloat16, layout=LA)
        acc = gl.zeros([BM, NC], gl.float32, layout=MMA)
        acc2 = acc
        if PF:
            words = gl.load(lo_ptr + sb0 * NR * 32 + woff, mask=wmask & (sb0 < sb1), other=0)
        for sb in range(sb0, sb1):
            if PF:
                nxt = gl.load(lo_ptr + (sb + 1) * NR * 32 + woff, mask=wmask & (sb + 1 < sb1), other=0)
            else:
                words = gl.load(lo_ptr + sb * NR * 32 + woff, mask=wmask, other=0)
            hi = words
            if QT == 2:
                hi = gl.load(hi_ptr + sb * NR * 16 + hoff, mask=wmask, other=0) >> hshift
            f = _codes(words, hi, BM, LA, QT)
            if PF:
                words = nxt
            xb = gl.load(x_row + sb * 256 + xoff, mask=xmask, other=0.0)
            p = _dot(f, xb, NC, MMA, LA, LB, CH)
            xs = _x_sums(ones, xb, NC, R, MMA, LA, LB, CH)
            acc = _scaled(acc, p, xs, d_ptr, sc_ptr, sb * NR + n_c, cmask, c_c, QT)
            if TWO:
                words2 = gl.load(lo_ptr + sb * NR * 32 + OFF2 * 32 + woff, mask=wmask, other=0)
                hi2 = words2
                if QT == 2:
                    hi2 = gl.load(hi_ptr + sb * NR * 16 + OFF2 * 16 + hoff, mask=wmask, other=0) >> hshift
                p2 = _dot(_codes(words2, hi2, BM, LA, QT), xb, NC, MMA, LA, LB, CH)
                acc2 = _scaled(acc2, p2, xs, d_ptr, sc_ptr, sb * NR + OFF2 + n_c, cmask, c_c, QT)
        y = gl.sum(acc, axis=1)
        y2 = y
        if TWO:
            y2 = gl.sum(acc2, axis=1)
        return y, y2, n_c, cmask

    @gluon.jit(do_not_specialize=["b_lo", "b_hi", "b_d", "b_sc"])
    def gemv_reg_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, NSB, SB_PER, SPLIT,
                        TILES_A, N_B, b_lo, b_hi, b_d, b_sc, QT: gl.constexpr, FUSED_SUM: gl.constexpr,
                        HAS_B: gl.constexpr, PDL: gl.constexpr, W: gl.constexpr, R: gl.constexpr, MMA: gl.constexpr,
                        LA: gl.constexpr, LB: gl.constexpr, LW: gl.constexpr, PF: gl.constexpr = False,
                        CH: gl.constexpr = 1):
        """Rows pid_n * BM.. of y over super-blocks pid_k * SB_PER.. (row_sums); the arguments as
        quant_gemv.gemv_kernel's (QT 0 Q4_K, 2 Q6_K; sc_ptr the scale plane's bytes; HAS_B a second matrix of the
        same width in the same launch)."""
        BM: gl.constexpr = 16 * W * R
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        tile = pid_n
        if HAS_B:
            tile, lo_ptr, hi_ptr, d_ptr, sc_ptr, out_ptr, part_ptr, N = second_matrix(
                pid_n, TILES_A, N, N_B, SPLIT, lo_ptr, hi_ptr, d_ptr, sc_ptr, out_ptr, part_ptr, b_lo, b_hi, b_d,
                b_sc)
        _enter(PDL)
        sb0 = pid_k * SB_PER
        y, _, n_c, cmask = row_sums(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, tile * BM, N, 0, sb0,
                                    gl.minimum(sb0 + SB_PER, NSB), QT, W, R, MMA, LA, LB, LW, PF, False, CH)
        store_split(y, n_c, cmask, out_ptr, part_ptr, cnt_ptr + pid_n, pid_k, SPLIT, N, FUSED_SUM)

    @gluon.jit(do_not_specialize=["x_lo", "x_hi", "x_d", "x_sc"])
    def moe_reg_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr, rw_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, s_lo, s_hi,
                       s_d, s_sc, P, N, N_ROWS, NSB, SB_PER, X_DIV, stride_x, stride_o, E_X, x_lo, x_hi, x_d, x_sc,
                       QT: gl.constexpr, GATED: gl.constexpr, SPLIT: gl.constexpr, HAS_X: gl.constexpr,
                       PDL: gl.constexpr, W: gl.constexpr, R: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr,
                       LB: gl.constexpr, LW: gl.constexpr, CH: gl.constexpr = 1):
        """moe_quant._moe_lanes_kernel with row_sums for its row dots (the MoE's few-token path; the arguments as
        its, but sc_ptr the scale plane's bytes and s_sc in bytes): pair pid_p (token pid_p // X_DIV, expert
        ids[pid_p], skipped when negative) times output rows pid_n * BM... GATED: gate and up (rows n and N + n
        of the stack's [2N, K], one x operand for both) over super-blocks pid_k * SB_PER.., silu(gate) * up into
        out_ptr [P, N] (SPLIT > 1: fp32 partials [SPLIT, P, 2N] summed in split order by the last program). Else
        down over all of K, weighted, the last of a token's X_DIV pairs summing them in slot order into out_ptr."""
        BM: gl.constexpr = 16 * W * R
        _enter(PDL)
        pid_p = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        e = gl.load(ids_ptr + pid_p)
        lo, hi, d, sc = expert_planes(e, lo_ptr, hi_ptr, d_ptr, sc_ptr, s_lo, s_hi, s_d, s_sc, E_X, x_lo, x_hi, x_d,
                                      x_sc, HAS_X)
        n_c = pid_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
        mask = n_c < N
        if GATED:
            if e >= 0:
                sb0 = pid_k * SB_PER
                gate, up, _, _ = row_sums(x_ptr + (pid_p // X_DIV) * stride_x, lo, hi, d, sc, N_ROWS, pid_n * BM, N,
                                          N, sb0, gl.minimum(sb0 + SB_PER, NSB), QT, W, R, MMA, LA, LB, LW, False,
                                          True, CH)
                if SPLIT == 1:
                    h = gate / (1.0 + gl.exp(-gate)) * up
                    gl.store(out_ptr + pid_p * stride_o + n_c, h.to(out_ptr.dtype.element_ty), mask=mask)
                else:
                    part = part_ptr + (pid_k * P + pid_p) * 2 * N
                    gl.store(part + n_c, gate, mask=mask)
                    gl.store(part + N + n_c, up, mask=mask)
                    _barrier()  # every thread's partial stored before the count's release
                    cnt = cnt_ptr + pid_p * gl.num_programs(1) + pid_n
                    if gl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
                        gate = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, MMA))
                        up = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, MMA))
                        for s in range(SPLIT):
                            part = part_ptr + (s * P + pid_p) * 2 * N
                            gate += gl.load(part + n_c, mask=mask, other=0.0, cache_modifier=".cg")
                            up += gl.load(part + N + n_c, mask=mask, other=0.0, cache_modifier=".cg")
                        h = gate / (1.0 + gl.exp(-gate)) * up
                        gl.store(out_ptr + pid_p * stride_o + n_c, h.to(out_ptr.dtype.element_ty), mask=mask)
                        gl.atomic_xchg(cnt, 0)
        else:
            acc = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, MMA))
            if e >= 0:
                acc, _, _, _ = row_sums(x_ptr + pid_p * stride_x, lo, hi, d, sc, N_ROWS, pid_n * BM, N, 0, 0, NSB, QT,
                                        W, R, MMA, LA, LB, LW, False, False, CH)
                acc = acc * gl.load(rw_ptr + pid_p).to(gl.float32)
            gl.store(part_ptr + pid_p * N + n_c, acc, mask=mask)
            _barrier()
            tok = pid_p // X_DIV
            cnt = cnt_ptr + tok * gl.num_programs(1) + pid_n
            if gl.atomic_add(cnt, 1, sem="acq_rel") == X_DIV - 1:
                total = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, MMA))
                for j in range(X_DIV):
                    total += gl.load(part_ptr + (tok * X_DIV + j) * N + n_c, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                gl.store(out_ptr + tok * stride_o + n_c, total.to(out_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt, 0)
