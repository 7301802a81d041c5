"""The Q4_K and Q6_K linear at 2-16 activation rows (a batch's decode projections) on tensor cores, the dequantized
weights kept in registers (Gluon): y = x W^T, x [M, K] bf16, W [N, K] in the packed layout (quant_layout).
Opt-in (ROWS_REG, `KTRANS_GEMV_ROWS_REG`) until timed on a GPU; the oracle is ktrans.kernels.torch.quant.quant_linear.

Why. At 16 rows the projections go through quant's tile path, whose dequantized tile reaches its dots through
shared memory: on the H100 it is 60% of a 16-request decode step's GPU time (7.5 of 12.7 ms, doc/benchmarks.md,
session 35), six times what the same weights cost at one row.

How. The weights are the mma.m16n8k16 B operand here (quant_gemv_reg's body has them as A): thread (g, t) of a warp
holds, of each 8-row tile, row g's code words 8 t .. 8 t + 7 (two 16-byte loads), and the dot's K order is
quant_gemv_reg's (column k = 64 j + 8 m + 2 a + e is weight 8 a + m of sub-block j + 4 e), so those words become the B
fragments of all sixteen K tiles by the same PTX (1 + q / 128, exact in bf16). The A operand holds eight activation
rows twice: row 8 e + u is token u's x at the columns of parity e and zero at the others (thread (g, t) loads token
g's words 8 t .. 8 t + 7 of every sub-block, 16 bytes each, and joins them with zeros into its fragments). The dot
over K chunk j (columns 64 j .. 64 j + 63) then gives, in row 8 e + u, token u's sum over sub-block j + 4 e of
(1 + q / 128) x, and a second dot of the same A against ones the sums of x, X. X is the same in every column, so
that dot is one n-tile a warp wide, copied to the warp's other n-tiles in registers (48 mma a super-block at the
default tiling, where a full-width ones operand took 64). Each chunk's sums are scaled by their rows' sub-block
scales as ggml sums them (128 d sc (P - X) - dmin m X) into the accumulator; at the end each token's two rows (e = 0
and 1: registers of one thread) are added. A program takes 8 x TILES x WARPS rows and eight tokens; more tokens are
more programs along the grid's first axis, next to each other, so their weights come from the L2. K is split across
programs as in quant_gemv (the fp32 partials summed in split order by each tile's last program).

Q6_K (16 sub-blocks of 16; lm_head and some projections of a Q4_K_M file) takes the one-row body's Q6_K order: word
groups a = 2, 3 hold sub-blocks 8.., so a chunk's columns span four sub-blocks (parity e, half h = a // 2). A's rows
are then 8 e + 4 h + u, four tokens a program, x given only to the threads whose h matches; each row's sum is scaled
by its sub-block's signed scale, d sc (64 P - 96 X), and a token's four rows are summed at the end.
"""
from __future__ import annotations

import os

import torch
import triton

from ktrans.kernels.triton.gluon_common import _GLUON, runs_on
from ktrans.kernels.triton.pdl import launch

MAX_ROWS = 16
_ENV = [int(v) for v in os.environ.get("KTRANS_GEMV_ROWS_REG", "0").split(",") if v.strip()] or [0]
# on; row tiles of 8 a warp (a program's rows: 8 x tiles x warps); warps; programs wanted an SM (K is split to reach
# them). Untimed: 2 tiles, 4 warps (64 rows a program), 2 programs an SM. sm_90, Triton 3.9 (3.6), Q4_K: 128 (128)
# registers at 2 tiles, 98 (96) at 1, 251 (250) at 4; Q6_K at 2: 141 (128); 8 spill
ROWS_REG = dict(zip(("on", "tiles", "warps", "per_sm"), _ENV + [2, 4, 2][len(_ENV) - 1:]))


def applies(x: torch.Tensor, w) -> bool:
    """Whether this body takes x [M, K] times the packed matrix w: on, Q4_K or Q6_K, 2..MAX_ROWS bf16 rows, a GPU,
    and a size its int32 offsets and grid hold (else the caller's tile path takes it)."""
    if not (ROWS_REG["on"] and w.qtype in ("Q4_K", "Q6_K") and 2 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
            and runs_on(x.device)):
        return False
    nsb, bn = w.k // 256, 8 * ROWS_REG["warps"] * ROWS_REG["tiles"]
    return max(w.n * nsb * 32, x.shape[0] * w.n * nsb) < 2 ** 31 and triton.cdiv(w.n, bn) < 65536


if _GLUON:
    import functools

    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from ktrans.kernels.triton.gluon_common import _enter, dequant_rows, store_split, tile_copies, word_offsets

    @functools.lru_cache(maxsize=None)
    def layouts(warps: int, tiles: int, qtype: str = "Q4_K") -> tuple:
        """(MMA, A, B, WORDS, X) for `warps` warps side by side along the rows of W, `tiles` 8-row tiles a warp: the
        accumulator's [16, BN] mma.m16n8k16 layout, its two operands', the code words' [BN, 4, 8] (word 8 a + m
        of each row) whose dequantization is the B operand [256, BN] with no data movement, and x's [8, 8, 4, 8]
        (_x_operand's input)."""
        if warps & (warps - 1) or tiles & (tiles - 1) or not 1 <= tiles <= 8:
            raise ValueError(f"quant_rows_reg: warps ({warps}) and 8-row tiles a warp ({tiles}, at most 8) must be "
                             "powers of two")
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, warps], instr_shape=[16, 8])
        a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # registers: the 8 consecutive words (two 16-byte loads), then the further row tiles; lanes: the word group
        # a (the B fragment's K pair), then rows 0..7; warps: 8-row tiles
        reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4]] + [[8 * warps << i, 0, 0] for i in range(tiles.bit_length() - 1)]
        lane = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp = [[8 << i, 0, 0] for i in range(warps.bit_length() - 1)]
        words = gl.DistributedLinearLayout(reg, lane, warp, [], [8 * warps * tiles, 4, 8])
        # x [8 tokens, 8 sub-blocks, 4 word groups a, 8 words m]: a thread holds its token's 8 words 8 a .. of every
        # sub-block (8 16-byte loads), every warp the same (warp bases zero: each needs the whole A operand). Q6_K:
        # [4 tokens u, 2 halves h, 8 sub-blocks c, 4 a, 8 m], lane bits 2-4 the row g = 4 h + u
        nw = warps.bit_length() - 1
        if qtype == "Q6_K":
            xs = gl.DistributedLinearLayout(
                [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]],
                [[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [0, 1, 0, 0, 0]],
                [[0, 0, 0, 0, 0]] * nw, [], [4, 2, 8, 4, 8])
        else:
            xs = gl.DistributedLinearLayout([[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 1, 0, 0], [0, 2, 0, 0],
                                             [0, 4, 0, 0]], [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0],
                                                             [4, 0, 0, 0]], [[0, 0, 0, 0]] * nw, [], [8, 8, 4, 8])
        return mma, a, b, words, xs

    def tiling(flag: str, warps: int, tiles: int, qtype: str = "Q4_K") -> dict:
        """The kernel's tiling constexprs for a `qtype` matrix; `flag` names the setting a bad tiling came from."""
        try:
            mma, la, lb, lw, lx = layouts(warps, tiles, qtype)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        return {"QT": 2 if qtype == "Q6_K" else 0, "W": warps, "NT": tiles, "MMA": mma, "LA": la, "LB": lb, "LW": lw,
                "LX": lx}

    @gluon.jit
    def _codes_b(words, hi, BN: gl.constexpr, LB: gl.constexpr, QT: gl.constexpr):
        """Code words [BN, 4, 8] (word 8 a + m) -> the B operand [256, BN] bf16: row k of column n is row n's
        weight at the dot's column k (gluon_common.dequant_rows), transposed."""
        return gl.convert_layout(gl.permute(dequant_rows(words, hi, BN, QT), (1, 0)), LB, assert_trivial=True)

    @gluon.jit
    def _halves_k(t, L: gl.constexpr, AXIS: gl.constexpr):
        """t split along its K axis (AXIS 1: A [R, K]; 0: B [K, C]) into its two halves, each in L (K's top bit
        is a register bit of both operands: no data moves)."""
        if AXIS == 1:
            R: gl.constexpr = t.shape[0]
            K: gl.constexpr = t.shape[1]
            u0, u1 = gl.split(gl.permute(gl.reshape(t, [R, 2, K // 2]), (0, 2, 1)))
        else:
            K: gl.constexpr = t.shape[0]
            C: gl.constexpr = t.shape[1]
            u0, u1 = gl.split(gl.permute(gl.reshape(t, [2, K // 2, C]), (1, 2, 0)))
        return gl.convert_layout(u0, L, assert_trivial=True), gl.convert_layout(u1, L, assert_trivial=True)

    @gluon.jit
    def _quarters_k(t, L: gl.constexpr, AXIS: gl.constexpr):
        """t's four K chunks of 64 (chunk j: columns 64 j ..), each in L."""
        h0, h1 = _halves_k(t, L, AXIS)
        c0, c1 = _halves_k(h0, L, AXIS)
        c2, c3 = _halves_k(h1, L, AXIS)
        return c0, c1, c2, c3

    @gluon.jit
    def _x_operand(xv, LA: gl.constexpr):
        """x [8 tokens t, 8 sub-blocks c, 4 a, 8 m] (c = j + 4 e) -> the A operand [16, 256]: row 8 e' + t, column
        64 j + 8 m + 2 a + e is token t's x of sub-block j + 4 e, word 8 a + m, where e = e', else 0."""
        x6 = gl.permute(gl.reshape(xv, [8, 2, 4, 4, 8]), (0, 2, 3, 4, 1))  # [t, j, a, m, e]
        x_e0, x_e1 = gl.split(x6)
        z = gl.zeros_like(x_e0)
        a = gl.join(gl.join(x_e0, z), gl.join(z, x_e1))  # [t, j, a, m, e, e']
        a = gl.reshape(gl.permute(a, (5, 0, 1, 3, 2, 4)), [16, 256])
        return gl.convert_layout(a, LA, assert_trivial=True)

    @gluon.jit
    def _x_operand6(xv, LA: gl.constexpr):
        """Q6_K: x [4 tokens u, 2 halves h, 8 sub-blocks c, 4 a, 8 m] (loaded as sub-block c + 8 h' of a = 2 h' + ..,
        zero where h is not h') -> the A operand [16, 256]: row 8 e' + 4 h + u, column 64 j + 8 m + 2 a + e is token
        u's x there where e = e', else 0."""
        x6 = gl.permute(gl.reshape(xv, [4, 2, 2, 4, 4, 8]), (0, 1, 3, 4, 5, 2))  # [u, h, j, a, m, e]
        x_e0, x_e1 = gl.split(x6)
        z = gl.zeros_like(x_e0)
        a = gl.join(gl.join(x_e0, z), gl.join(z, x_e1))  # [u, h, j, a, m, e, e']
        a = gl.reshape(gl.permute(a, (6, 1, 0, 2, 4, 3, 5)), [16, 256])
        return gl.convert_layout(a, LA, assert_trivial=True)

    @gluon.jit
    def _x_sums(a, ones, z8, MMA: gl.constexpr, NT: gl.constexpr):
        """The sums of x over a chunk, a row of A each, as the accumulator [16, BN]: one dot of A against a ones
        operand one n-tile a warp wide (the same in every column: the same mma, the same order), copied to the warp's
        NT n-tiles in registers. A full-width ones operand did the same dot once per n-tile."""
        return gl.convert_layout(tile_copies(mma_v2(a, ones, z8), NT, 1), MMA, assert_trivial=True)

    @gluon.jit
    def _chunk_sums6(acc, a, b, ones, z, z8, w, d, J: gl.constexpr, e_r, h_r, MMA: gl.constexpr, NT: gl.constexpr):
        """Q6_K: acc += chunk J's sums scaled by the rows' sub-blocks J + 4 e + 8 h (rows 8 e + 4 h + u): the int8
        scale is byte J of the row's scale word e + 2 h (w: the four words, [BN] each); d sc (q6 - 32) summed is
        d sc (64 P - 96 X)."""
        p = mma_v2(a, b, z)
        xs = _x_sums(a, ones, z8, MMA, NT)
        sw = gl.where(h_r, gl.where(e_r, w[3][None, :], w[2][None, :]), gl.where(e_r, w[1][None, :], w[0][None, :]))
        sc = ((sw << (24 - 8 * J)) >> 24).to(gl.float32)
        return acc + (sc * d[None, :]) * (64.0 * p - 96.0 * xs)

    @gluon.jit
    def _token_rows(t):
        """[16, C] (row 8 e + t) -> ([8, C] row t of e = 0, the same of e = 1): row bit 3 is a register bit."""
        C: gl.constexpr = t.shape[1]
        return gl.split(gl.permute(gl.reshape(t, [2, 8, C]), (1, 2, 0)))

    @gluon.jit
    def _chunk_sums(acc, a, b, ones, z, z8, w, d, dmin, J: gl.constexpr, hi, MMA: gl.constexpr, NT: gl.constexpr):
        """acc += chunk J's sums (A chunk a, B chunk b) scaled by sub-blocks J (rows e = 0) and J + 4 (e = 1): the
        scales are byte J of the row's int32 words w (scales 0..3, 4..7, then mins 0..3, 4..7; [BN] each), hi the
        rows of e = 1; d already times 128."""
        p = mma_v2(a, b, z)
        xs = _x_sums(a, ones, z8, MMA, NT)
        s_lo = ((w[0] >> (8 * J)) & 0xFF).to(gl.float32)
        s_hi = ((w[1] >> (8 * J)) & 0xFF).to(gl.float32)
        m_lo = ((w[2] >> (8 * J)) & 0xFF).to(gl.float32)
        m_hi = ((w[3] >> (8 * J)) & 0xFF).to(gl.float32)
        s = gl.where(hi, (s_hi * d)[None, :], (s_lo * d)[None, :])
        m = gl.where(hi, (m_hi * dmin)[None, :], (m_lo * dmin)[None, :])
        return acc + s * (p - xs) - m * xs

    @gluon.jit
    def rows_reg_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, M, N, NSB, SB_PER, SPLIT,
                        stride_x, QT: gl.constexpr, PDL: gl.constexpr, W: gl.constexpr, NT: gl.constexpr,
                        MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LW: gl.constexpr,
                        LX: gl.constexpr):
        """Tokens pid_g * 8.. (of M) times rows pid_n * BN.. of W over super-blocks pid_k * SB_PER..: SPLIT = 1, y
        into out_ptr [M, N]; else the fp32 partial into part_ptr [SPLIT, M, N], and the tile's last program
        (counted in cnt_ptr[tile], zero between calls) sums the partials in order and zeroes the count.
        sc_ptr: the scale plane's bytes (Q4_K: a row's 8 scales, then its 8 mins; Q6_K, QT 2: its 16 int8 scales);
        d_ptr: its fp16 d, dmin pairs (Q6_K: d alone). Q6_K takes four tokens a program (TOK): its columns of word
        group a hold sub-blocks 8 (a // 2) + j + 4 e, so the rows are 8 e + 4 h + u and h must match a // 2."""
        BN: gl.constexpr = 8 * W * NT
        TOK: gl.constexpr = 4 if QT == 2 else 8
        _enter(PDL)
        pid_g = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        row0 = pid_n * BN
        t0 = pid_g * TOK
        woff, wmask, hoff, hshift = word_offsets(row0, N, BN, LW)  # the code words: row n, word 8 a + m
        if QT == 2:  # x of tokens t0.. : [u, h, c, a, m] at sub-block c + 8 (a // 2), word (8 a + m) % 16
            L4: gl.constexpr = gl.SliceLayout(4, LX)
            u_x = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
            h_x = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
            c_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
            a_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
            m_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3,
                                                                                                           LX)))))
            t_x = t0 + u_x
            xoff4 = (t_x * stride_x)[:, None, None, None] + (h_x * 0)[None, :, None, None] + \
                (c_x * 16)[None, None, :, None] + ((a_x // 2) * 128 + (a_x % 2) * 8)[None, None, None, :]
            xmask4 = (t_x < M)[:, None, None, None] & (h_x[None, :, None, None] == (a_x // 2)[None, None, None, :]) \
                & (c_x >= 0)[None, None, :, None]
            xoff = xoff4[:, :, :, :, None] + m_x[None, None, None, None, :]
            xmask = xmask4[:, :, :, :, None] & (m_x >= 0)[None, None, None, None, :]
        else:  # x of tokens t0.. by sub-block c and word 8 a + m (made into the A operand by _x_operand)
            t_x = t0 + gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LX))))
            c_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LX))))
            a_x = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LX))))
            m_x = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LX))))
            xoff = (t_x * stride_x)[:, None, None, None] + (c_x * 32)[None, :, None, None] + \
                (a_x * 8)[None, None, :, None] + m_x[None, None, None, :]
            xmask = (t_x < M)[:, None, None, None] & (m_x >= 0)[None, None, None, :]
        ones = gl.full([64, 8 * W], 1.0, gl.bfloat16, layout=LB)  # an n-tile a warp: x's sums, the same in every column
        # the scales, d and dmin of the accumulator's columns (rows of W), as int32 words
        n_c = row0 + gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
        cmask = n_c < N
        r_c = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        hi = (r_c >= 8)[:, None]  # rows of e = 1
        h_r = ((r_c // 4) % 2 == 1)[:, None]  # Q6_K: rows of h = 1
        sc32 = sc_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        d32 = d_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        z = gl.zeros([16, BN], gl.float32, layout=MMA)
        z8 = gl.zeros([16, 8 * W], gl.float32, layout=MMA)
        acc = z
        sb0 = pid_k * SB_PER
        for sb in range(sb0, gl.minimum(sb0 + SB_PER, NSB)):
            words = gl.load(lo_ptr + sb * N * 32 + woff, mask=wmask, other=0)
            hw = words
            if QT == 2:
                hw = gl.load(hi_ptr + sb * N * 16 + hoff, mask=wmask, other=0) >> hshift
            b0, b1, b2, b3 = _quarters_k(_codes_b(words, hw, BN, LB, QT), LB, 0)
            if QT == 2:
                xa = _x_operand6(gl.load(x_ptr + sb * 256 + xoff, mask=xmask, other=0.0), LA)
            else:
                xa = _x_operand(gl.load(x_ptr + sb * 256 + xoff, mask=xmask, other=0.0), LA)
            a0, a1, a2, a3 = _quarters_k(xa, LA, 1)
            rows = sb * N + n_c
            w = (gl.load(sc32 + rows * 4, mask=cmask, other=0), gl.load(sc32 + rows * 4 + 1, mask=cmask, other=0),
                 gl.load(sc32 + rows * 4 + 2, mask=cmask, other=0), gl.load(sc32 + rows * 4 + 3, mask=cmask, other=0))
            if QT == 2:
                d = gl.load(d_ptr + rows, mask=cmask, other=0.0).to(gl.float32)
                acc = _chunk_sums6(acc, a0, b0, ones, z, z8, w, d, 0, hi, h_r, MMA, NT)
                acc = _chunk_sums6(acc, a1, b1, ones, z, z8, w, d, 1, hi, h_r, MMA, NT)
                acc = _chunk_sums6(acc, a2, b2, ones, z, z8, w, d, 2, hi, h_r, MMA, NT)
                acc = _chunk_sums6(acc, a3, b3, ones, z, z8, w, d, 3, hi, h_r, MMA, NT)
            else:
                dd = gl.load(d32 + rows, mask=cmask, other=0)
                d = (dd & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32) * 128.0
                dmin = (dd >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
                acc = _chunk_sums(acc, a0, b0, ones, z, z8, w, d, dmin, 0, hi, MMA, NT)
                acc = _chunk_sums(acc, a1, b1, ones, z, z8, w, d, dmin, 1, hi, MMA, NT)
                acc = _chunk_sums(acc, a2, b2, ones, z, z8, w, d, dmin, 2, hi, MMA, NT)
                acc = _chunk_sums(acc, a3, b3, ones, z, z8, w, d, dmin, 3, hi, MMA, NT)
        tk16 = gl.zeros([16, BN], gl.int32, layout=MMA) + (t0 + r_c % TOK)[:, None]
        nn16 = gl.zeros([16, BN], gl.int32, layout=MMA) + n_c[None, :]
        if QT == 2:  # a token's four rows (e: a register bit; h: a lane bit) summed
            y = gl.sum(gl.sum(gl.reshape(acc, [2, 2, 4, BN]), axis=0), axis=0)
            tk = gl.max(gl.max(gl.reshape(tk16, [2, 2, 4, BN]), axis=0), axis=0)
            nn = gl.max(gl.max(gl.reshape(nn16, [2, 2, 4, BN]), axis=0), axis=0)
        else:
            y0, y1 = _token_rows(acc)
            y = y0 + y1
            tk, _ = _token_rows(tk16)
            nn, _ = _token_rows(nn16)
        offs = tk * N + nn
        mask = (tk < M) & (nn < N)
        store_split(y, offs, mask, out_ptr, part_ptr, cnt_ptr + pid_n * gl.num_programs(0) + pid_g, pid_k, SPLIT,
                    M * N, True)


def qlinear_rows(x: torch.Tensor, w, planes, cnt: torch.Tensor, sms: int, split: int | None) -> torch.Tensor:
    """x [M, K] times the Q4_K or Q6_K matrix w (where applies) -> [M, N] bf16, through rows_reg_kernel; `planes`
    are quant.plane_args(w), `cnt` the device's split-sum counts (quant.counters), `sms` its SM count; `split`: K
    splits (None: enough programs for ROWS_REG["per_sm"] an SM)."""
    m, n, nsb = x.shape[0], w.n, w.k // 256
    warps, tiles = ROWS_REG["warps"], ROWS_REG["tiles"]
    consts = tiling("KTRANS_GEMV_ROWS_REG", warps, tiles, w.qtype)
    bn, groups = 8 * warps * tiles, triton.cdiv(m, 4 if w.qtype == "Q6_K" else 8)
    grid_nm = triton.cdiv(n, bn) * groups
    if split is None:
        split = max(1, min(nsb, triton.cdiv(ROWS_REG["per_sm"] * sms, grid_nm)))
    sb_per = triton.cdiv(nsb, split)
    split = triton.cdiv(nsb, sb_per)
    if split > 1 and grid_nm > cnt.numel():  # more tiles than split-sum counts: whole K a program
        split, sb_per = 1, nsb
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split * m * n if split > 1 else 1, dtype=torch.float32, device=x.device)
    rows_reg_kernel[(groups, triton.cdiv(n, bn), split)](
        x, out, part, cnt, *planes, m, n, nsb, sb_per, split, x.stride(0), num_warps=warps, **consts, **launch())
    return out
