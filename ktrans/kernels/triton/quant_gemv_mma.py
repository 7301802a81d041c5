"""The one-row GEMV's tensor-core body, `row_dot_mma` (quant_gemv.row_dot with MMA > 0: GEMV["mma"], opt-in; the MoE
lanes kernel's `mma`): a super-block's codes become bf16 1 + q / 2^b (exact in bf16's mantissa) by inline PTX, a
shift and a logic op a weight pair, and one dot against x placed block-diagonally gives every row's sub-block sums,
which the sub-block scales then multiply. The PTX (`_q4_asm`, `_q6_asm`) is shared with the Gluon body
(quant_gemv_reg). Why it stays opt-in is in quant_gemv's module doc.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ktrans.kernels.triton import interpreting
from ktrans.kernels.triton.pdl import enter


# The tensor-core body (row_dot MMA): the codes turned into bf16 (1 + q / 2^b), exact in bf16's 7-bit mantissa, by one
# shift and one three-input logic op per two weights (the bits of a bf16 pair of 1.0 are 0x3F803F80; a code word's
# nibbles j and j + 4 sit 16 bits apart, so one shift moves both into their halves' mantissas). Inline PTX, for
# Triton has no bitcast from int32 to a bf16 pair; the interpreter gets the same values by arithmetic.
def _shift(dst: str, src: str, right: int) -> str:
    return f"shr.u32 {dst}, {src}, {right};\n" if right >= 0 else f"shl.b32 {dst}, {src}, {-right};\n"


def _q4_asm() -> str:
    """PTX for _codes_q4: pair j = nibbles j (low half) and j + 4 (high half), 16 bits apart in the word: one shift
    puts both at mantissa bits 3-6, and one lop3 (0xEA: (t & mask) | 1.0) masks them and ORs in 1.0's bits."""
    text = "{\n.reg .b32 t;\n"
    for j in range(4):
        text += _shift("t", "$4", 4 * j - 3) + f"lop3.b32 ${j}, t, 0x00780078, 0x3F803F80, 0xEA;\n"
    return text + "}"


def _q6_asm() -> str:
    """PTX for _codes_q6: pair j = the word's sub-blocks j (low half) and j + 4 (high half). q6's nibble goes
    to mantissa bits 1-4 (a's nibbles j, j + 4 sit 16 bits apart: one shift), its two high bits to 5-6: b holds them
    at bits 2S, 2S + 1, the pair's 8 bits apart, so one shift puts them at bits 5-6 and 13-14 and a byte permute
    copies byte 1 to byte 2 (bits 21-22). Then t where 0x001E001E, else the high bits (lop3 0xE4), masked to the
    pair's 2 x 6 bits and ORed with 1.0 (lop3 0xEA)."""
    text = "{\n.reg .b32 t, u;\n"
    for j in range(4):
        text += _shift("t", "$4", 4 * j - 1) + _shift("u", "$12", 2 * j - 5)
        text += "prmt.b32 u, u, u, 0x1100;\nlop3.b32 t, t, u, 0x001E001E, 0xE4;\n"
        text += f"lop3.b32 ${j}, t, 0x007E007E, 0x3F803F80, 0xEA;\n"
    return text + "}"


_Q4_ASM = tl.constexpr(_q4_asm())
_Q6_ASM = tl.constexpr(_q6_asm())


if interpreting():
    @triton.jit
    def _codes_q4(a):
        """[BN, W] Q4_K code words -> [BN, W, 8] fp32: element 2j + h = 1 + q / 16 of nibble j + 4h."""
        e = tl.arange(0, 8)
        sh = 4 * (e // 2 + 4 * (e % 2))
        return ((a[:, :, None] >> sh[None, None, :]) & 15).to(tl.float32) / 16.0 + 1.0

    @triton.jit
    def _codes_q6(a, b):
        """[BN, W] Q6_K low-nibble words and their high-bit words (the word's sub-blocks' at bits 2s, 2s + 1, s = 0..7)
        -> [BN, W, 8] fp32: element 2j + h = 1 + q6 / 64 of the word's sub-block s = j + 4h."""
        e = tl.arange(0, 8)
        s = e // 2 + 4 * (e % 2)
        q = ((a[:, :, None] >> (4 * s)[None, None, :]) & 15) | (((b[:, :, None] >> (2 * s)[None, None, :]) & 3) << 4)
        return q.to(tl.float32) / 64.0 + 1.0
else:
    @triton.jit
    def _codes_q4(a):
        """[BN, W] Q4_K code words -> [BN, W, 8] bf16: element 2j + h = 1 + q / 16 of nibble j + 4h (the halves
        of one register: j's pair)."""
        a2 = tl.join(a, a)
        a4 = tl.join(a2, a2)
        return tl.inline_asm_elementwise(_Q4_ASM, "=r,=r,=r,=r" + ",r" * 8, [tl.join(a4, a4)], dtype=tl.bfloat16,
                                         is_pure=True, pack=8)

    @triton.jit
    def _codes_q6(a, b):
        """[BN, W] Q6_K low-nibble words and their high-bit words (the word's sub-blocks' at bits 2s, 2s + 1,
        s = 0..7) -> [BN, W, 8] bf16: element 2j + h = 1 + q6 / 64 of the word's sub-block s = j + 4h (_Q6_ASM)."""
        a2 = tl.join(a, a)
        a4 = tl.join(a2, a2)
        b2 = tl.join(b, b)
        b4 = tl.join(b2, b2)
        return tl.inline_asm_elementwise(_Q6_ASM, "=r,=r,=r,=r" + ",r" * 16,
                                         [tl.join(a4, a4), tl.join(b4, b4)], dtype=tl.bfloat16, is_pure=True, pack=8)


@triton.jit
def _mma_order(QT: tl.constexpr):
    """(sub, pos) [256]: the sub-block and the position in it of dot column k, the order _codes_q4 / _codes_q6 lay a
    super-block's codes out in: Q4_K k = 8i + 2j + h (weight i of sub-block j + 4h); Q6_K k = 8(16G + i) + 2j + h
    (weight i of sub-block 8G + j + 4h)."""
    k = tl.arange(0, 256)
    e = k % 8
    if QT == 2:
        return 8 * (k // 128) + e // 2 + 4 * (e % 2), (k // 8) % 16
    return e // 2 + 4 * (e % 2), k // 8


@triton.jit
def _mma_side(x_ptr, d_ptr, sc_ptr, sb, sb_end, N, offs_n, mask_n, QT: tl.constexpr):
    """Everything of super-block sb but its codes: (x in dot order [256] bf16, X_{c % NCOL} [16] fp32 (the
    sub-blocks' sums of x), the columns' coefficients [BN, 16] fp32 (Q4_K: 16 d sc_c for c < 8, -dmin m_{c - 8}
    after; Q6_K: d sc_c)). sb >= sb_end reads nothing (zeros): a prefetch past the program's last."""
    NCOL: tl.constexpr = 16 if QT == 2 else 8  # sub-blocks a super-block
    SPAN: tl.constexpr = 256 // NCOL  # weights a sub-block
    row = sb * N + offs_n
    c = tl.arange(0, 16)
    sub, pos = _mma_order(QT)
    xv = tl.load(x_ptr + sb * 256 + sub * SPAN + pos, mask=(sub * 0 + sb) < sb_end, other=0.0)
    xc = tl.load(x_ptr + sb * 256 + (c % NCOL)[None, :] * SPAN + tl.arange(0, SPAN)[:, None],
                 mask=(c * 0 + sb)[None, :] < sb_end, other=0.0)
    xs = tl.sum(xc.to(tl.float32), axis=0)
    m = mask_n & ((offs_n * 0 + sb) < sb_end)
    if QT == 2:
        d = tl.load(d_ptr + row, mask=m, other=0.0).to(tl.float32)
        u = tl.load(sc_ptr.to(tl.pointer_type(tl.int8)) + row[:, None] * 16 + c[None, :], mask=m[:, None], other=0)
        coef = u.to(tl.float32) * d[:, None]
    else:
        dd = tl.load(d_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :], mask=m[:, None], other=0.0)
        d, dmin = tl.split(dd.to(tl.float32))
        u = tl.load(sc_ptr.to(tl.pointer_type(tl.uint8)) + row[:, None] * 16 + c[None, :], mask=m[:, None], other=0)
        coef = u.to(tl.float32) * tl.where(c[None, :] < 8, 16.0 * d[:, None], -dmin[:, None])
    return xv, xs, coef


@triton.jit
def _mma_sb(acc, lo_ptr, hi_ptr, sb, N, offs_n, mask_n, xv, xs, coef, QT: tl.constexpr, BN: tl.constexpr,
            T: tl.constexpr):
    """acc [BN, 16] += super-block sb's products, one tensor-core dot: P = F @ Xd, F [BN, 256] the weights' codes
    as 1 + q / 2^b (exact in bf16), Xd [256, 16] x placed block-diagonally (row k holds x at the column of k's
    sub-block, zeros elsewhere), so P[:, c] is sub-block c's sum of (1 + q / 2^b) x, exact products summed in fp32.
    The sub-block's scale then multiplies it once per row: ggml's s q - m summed over a sub-block is
    (2^b s) (P - X) - m X, X its sum of x (Q6_K: s (64 P - 96 X)). Q4_K has 8 sub-blocks: columns 8 + S repeat S,
    and carry the min term (coefficient -dmin m_S, value X_S). xv, xs, coef: _mma_side's. T: the dot transposed,
    Xd^T F^T, its M the 16 columns (at 2 warps, mma.m16n8k16; untransposed, sm_90 takes wgmma, whose B operand Xd
    goes through shared memory behind an async-proxy fence a super-block)."""
    NCOL: tl.constexpr = 16 if QT == 2 else 8
    row = sb * N + offs_n
    c = tl.arange(0, 16)
    sub, pos = _mma_order(QT)
    if QT == 2:
        w = tl.arange(0, 32)[None, :]
        a = tl.load(lo_ptr + row[:, None] * 32 + w, mask=mask_n[:, None], other=0)
        # each word's high bits, those of the second half (G = 1) moved down to where G = 0's sit
        b = tl.load(hi_ptr + row[:, None] * 16 + w % 16, mask=mask_n[:, None], other=0) >> (16 * (w // 16))
        f = tl.reshape(_codes_q6(a, b), [BN, 256])
    else:
        a = tl.load(lo_ptr + row[:, None] * 32 + tl.arange(0, 32)[None, :], mask=mask_n[:, None], other=0)
        f = tl.reshape(_codes_q4(a), [BN, 256])
    if T:
        xdt = tl.where((c % NCOL)[:, None] == sub[None, :], xv[None, :], tl.zeros_like(xv)[None, :])
        p = tl.trans(tl.dot(xdt.to(f.dtype), tl.trans(f)))
    else:
        xd = tl.where(sub[:, None] == (c % NCOL)[None, :], xv[:, None], tl.zeros_like(xv)[:, None])
        p = tl.dot(f, xd.to(f.dtype))
    if QT == 2:
        acc += coef * (64.0 * p - 96.0 * xs[None, :])
    else:
        acc += coef * tl.where(c[None, :] < 8, p - xs[None, :], xs[None, :])
    return acc


@triton.jit
def row_dot_mma(x_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, N, sb0, sb_end, offs_n, mask_n, QT: tl.constexpr,
                 BN: tl.constexpr, PDL: tl.constexpr, PIPE: tl.constexpr, MMA: tl.constexpr):
    """row_dot on tensor cores (_mma_sb a super-block): Q4_K and Q6_K, bf16 x. MMA 2: the transposed dot. The next
    super-block's x and scales (_mma_side) are loaded an iteration ahead, by hand: no dot reads them, so Triton's
    pipeliner would leave their latency in every iteration; the codes, which feed the dot, it pipelines itself."""
    enter(PDL)
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    xv, xs, coef = _mma_side(x_ptr, d_ptr, sc_ptr, sb0, sb_end, N, offs_n, mask_n, QT)
    if PIPE > 0:
        for sb in tl.range(sb0, sb_end, num_stages=PIPE):
            nxv, nxs, ncoef = _mma_side(x_ptr, d_ptr, sc_ptr, sb + 1, sb_end, N, offs_n, mask_n, QT)
            acc = _mma_sb(acc, lo_ptr, hi_ptr, sb, N, offs_n, mask_n, xv, xs, coef, QT, BN, MMA == 2)
            xv, xs, coef = nxv, nxs, ncoef
    else:
        for sb in range(sb0, sb_end):
            nxv, nxs, ncoef = _mma_side(x_ptr, d_ptr, sc_ptr, sb + 1, sb_end, N, offs_n, mask_n, QT)
            acc = _mma_sb(acc, lo_ptr, hi_ptr, sb, N, offs_n, mask_n, xv, xs, coef, QT, BN, MMA == 2)
            xv, xs, coef = nxv, nxs, ncoef
    return tl.sum(acc, axis=1)
