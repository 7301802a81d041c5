"""Which planes a program of the one-row kernels reads: scalar pointer arithmetic shared by the Triton kernels
(quant_gemv.gemv_kernel, moe_quant._moe_lanes_kernel) and their Gluon twins (quant_gemv_reg), which call these
@triton.jit helpers as they are (no layouts: scalars only)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def step16(off, ptr):
    """`off` (in elements of ptr's type) rounded down to a 16-byte step: the same value for the offsets the launchers
    pass (quant.plane_offsets checks them), and the compiler then knows that pointer + off keeps ptr's 16-byte
    alignment, so it loads the planes it reaches 16 bytes at a time. (An offset argument left unspecialised is of
    unknown divisibility: the pair launch's code words were loaded a word at a time, its scales a byte at a time.)"""
    STEP: tl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth
    return off // STEP * STEP


@triton.jit
def second_matrix(pid_n, TILES_A, N, N_B, SPLIT, lo_ptr, hi_ptr, d_ptr, sc_ptr, out_ptr, part_ptr, b_lo, b_hi, b_d,
                  b_sc):
    """A pair launch (two matrices of one type and width, row tiles TILES_A.. the second's): (row tile, the four
    planes, out_ptr, part_ptr, N) of program pid_n's matrix. The second's planes lie at element offsets b_* from
    the first's (16-byte steps: step16), its rows follow the first's in out_ptr and its partials theirs in part_ptr
    ([SPLIT, N] then [SPLIT, N_B])."""
    is_b = pid_n >= TILES_A
    b_lo, b_hi, b_d, b_sc = step16(b_lo, lo_ptr), step16(b_hi, hi_ptr), step16(b_d, d_ptr), step16(b_sc, sc_ptr)
    return (tl.where(is_b, pid_n - TILES_A, pid_n), lo_ptr + tl.where(is_b, b_lo, 0), hi_ptr + tl.where(is_b, b_hi, 0),
            d_ptr + tl.where(is_b, b_d, 0), sc_ptr + tl.where(is_b, b_sc, 0), out_ptr + tl.where(is_b, N, 0),
            part_ptr + tl.where(is_b, SPLIT * N, 0), tl.where(is_b, N_B, N))


@triton.jit
def expert_planes(e, lo_ptr, hi_ptr, d_ptr, sc_ptr, s_lo, s_hi, s_d, s_sc, E_X, x_lo, x_hi, x_d, x_sc,
                  HAS_X: tl.constexpr):
    """The four planes of expert e of a stack (strides s_* in elements; a negative e, a skipped pair, reads expert
    0's, which the caller does not use); with HAS_X, id E_X takes an extra expert's planes at element offsets x_*
    from the stack's (they need not lie in the stack; 16-byte steps: step16)."""
    e64 = tl.maximum(e, 0).to(tl.int64)
    o_lo, o_hi, o_d, o_sc = e64 * s_lo, e64 * s_hi, e64 * s_d, e64 * s_sc
    if HAS_X:
        is_x = e == E_X
        o_lo = tl.where(is_x, step16(x_lo, lo_ptr), o_lo)
        o_hi = tl.where(is_x, step16(x_hi, hi_ptr), o_hi)
        o_d = tl.where(is_x, step16(x_d, d_ptr), o_d)
        o_sc = tl.where(is_x, step16(x_sc, sc_ptr), o_sc)
    return lo_ptr + o_lo, hi_ptr + o_hi, d_ptr + o_d, sc_ptr + o_sc
