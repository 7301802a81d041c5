"""The chunked gated delta rule's per-chunk inverse of (I + A), A strictly lower triangular [64, 64] (the WY form's
solve; ktrans.kernels.triton.gated_delta_prep): A's diagonal 16x16 blocks inverted row by row
(from registers, the block form's, or from the program's fp32 scratch) or by doubling, and the whole inverse
assembled from them in fp32 16x16 products, six dependent products deep or by 32-row halves, four deep. Every
product is fp32 (input_precision ieee): the inverse's entries feed every w and u."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unstack4(t):
    """[4, 16, 16] -> its four [16, 16] blocks."""
    blk = tl.arange(0, 4)[:, None, None]
    return (tl.sum(tl.where(blk == 0, t, 0.0), axis=0), tl.sum(tl.where(blk == 1, t, 0.0), axis=0),
            tl.sum(tl.where(blk == 2, t, 0.0), axis=0), tl.sum(tl.where(blk == 3, t, 0.0), axis=0))


@triton.jit
def _inv_unit_lower4(a0, a1, a2, a3):
    """(I + a_b)^-1 for four strictly lower-triangular 16x16 blocks, by forward substitution row by row, the four
    side by side as one [4, 16, 16] tensor (one chain of 15 steps, not four)."""
    r = tl.arange(0, a0.shape[0])
    blk = tl.arange(0, 4)[:, None, None]
    a = tl.where(blk == 0, a0[None, :, :], tl.where(blk == 1, a1[None, :, :],
                                                    tl.where(blk == 2, a2[None, :, :], a3[None, :, :])))
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :]
    t = eye + tl.zeros_like(a)
    for i in tl.static_range(1, a0.shape[0]):
        # Row i of each inverse: e_i - sum_{j<i} a_ij t_j, where rows j < i of t are already final.
        is_i = (r == i)[None, :, None]
        a_i = tl.sum(tl.where(is_i, a, 0.0), axis=1)
        t = tl.where(is_i, eye - tl.sum(a_i[:, :, None] * t, axis=1)[:, None, :], t)
    return _unstack4(t)


@triton.jit
def _inv_diag_from(scr):
    """The same four inverses for the diagonal 16x16 blocks of the chunk's A stored at scr ([64, 64] fp32, strictly
    lower), each step's rows loaded from there (L1) rather than picked out of registers."""
    S: tl.constexpr = 16
    r = tl.arange(0, S)
    blk = tl.arange(0, 4)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :]
    t = eye + tl.zeros([4, S, S], tl.float32)
    for i in tl.static_range(1, S):
        a_i = tl.load(scr + (blk[:, None] * S + i) * (4 * S) + blk[:, None] * S + r[None, :])  # [4, 16]
        is_i = (r == i)[None, :, None]
        t = tl.where(is_i, eye - tl.sum(a_i[:, :, None] * t, axis=1)[:, None, :], t)
    return _unstack4(t)


@triton.jit
def _inv_diag_doubling(scr):
    """The same four inverses by doubling the inverted blocks' size, 1 -> 2 -> 4 -> 8 -> 16, each step two batched
    fp32 products: with T the inverse of (I + N) over blocks of s rows on the diagonal and E the part of N coupling
    the two halves of each 2s block, the inverse over 2s blocks is T - T E T (E T E = 0). Three dependent pairs of
    [4, 16, 16] products instead of fifteen dependent row steps, and the blocked substitution's values up to fp32
    rounding (no powers of N, which grow)."""
    S: tl.constexpr = 16
    r = tl.arange(0, S)
    blk = tl.arange(0, 4)[:, None, None]
    i = r[None, :, None]
    j = r[None, None, :]
    return _unstack4(_doubling(tl.load(scr + (blk * S + i) * (4 * S) + blk * S + j)))


@triton.jit
def _doubling(n):
    """(I + n_b)^-1 for a batch of strictly lower 16x16 blocks n [B, 16, 16], by doubling (_inv_diag_doubling)."""
    r = tl.arange(0, 16)
    i = r[None, :, None]
    j = r[None, None, :]
    t = tl.where(i == j, 1.0, 0.0) - tl.where(i // 2 == j // 2, n, 0.0)  # blocks of 2: [[1, 0], [-n, 1]]
    for s in tl.static_range(1, 4):  # halves of 2, 4, 8 rows
        e = tl.where((i >> s != j >> s) & (i >> (s + 1) == j >> (s + 1)), n, 0.0)
        t = t - _dot32(t, _dot32(e, t))
    return t


@triton.jit
def _block_offs(I: tl.constexpr, J: tl.constexpr):
    """The offsets of block (I, J), 16x16, in a [64, 64] row-major matrix."""
    r = tl.arange(0, 16)
    return (I * 16 + r)[:, None] * 64 + J * 16 + r[None, :]


@triton.jit
def _store_block(scr, x, I: tl.constexpr, J: tl.constexpr):
    tl.store(scr + _block_offs(I, J), x)


@triton.jit
def _store_inverse(scr, t0, t1, t2, t3, a10, a20, a21, a30, a31, a32):
    """(I + A)^-1 over A's scratch, from the diagonal blocks' inverses t_i and A's blocks a_ij: block (i, j) below the
    diagonal is -t_i sum_{j <= m < i} a_im X_mj (X_jj = t_j), by fp32 16x16 products (A's zero upper blocks stay)."""
    x10 = -_dot32(_dot32(t1, a10), t0)
    x21 = -_dot32(_dot32(t2, a21), t1)
    x32 = -_dot32(_dot32(t3, a32), t2)
    x20 = -_dot32(t2, _dot32(a20, t0) + _dot32(a21, x10))
    x31 = -_dot32(t3, _dot32(a31, t1) + _dot32(a32, x21))
    x30 = -_dot32(t3, _dot32(a30, t0) + _dot32(a31, x10) + _dot32(a32, x20))
    tl.debug_barrier()  # every thread's reads of A's blocks are done before they are overwritten
    _store_blocks(scr, t0, t1, t2, t3, x10, x20, x21, x30, x31, x32)


@triton.jit
def _store_inverse_shallow(scr, t0, t1, t2, t3, a10, a20, a21, a30, a31, a32):
    """The same inverse by halves (KTRANS_GDN_PREP_INV=2): each 32-row diagonal block's coupling first (x10, x32),
    then the lower-left 32x32 block as -T_b E T_a, E being A's lower-left 32x32 block and T_a, T_b the inverses of
    the diagonal 32x32 blocks: P = E T_a by 16x16 blocks, then -T_b P. The same sixteen fp32 16x16 products, four
    dependent ones deep rather than six (x30 waits on x20 in _store_inverse)."""
    x10, x20, x21, x30, x31, x32 = _assemble_shallow(t0, t1, t2, t3, a10, a20, a21, a30, a31, a32)
    tl.debug_barrier()  # every thread's reads of A's blocks are done before they are overwritten
    _store_blocks(scr, t0, t1, t2, t3, x10, x20, x21, x30, x31, x32)


@triton.jit
def _assemble_shallow(t0, t1, t2, t3, a10, a20, a21, a30, a31, a32):
    """_store_inverse_shallow's six blocks below the diagonal, for [16, 16] blocks or batches of them [B, 16, 16]."""
    x10 = -_dot32(_dot32(t1, a10), t0)
    x32 = -_dot32(_dot32(t3, a32), t2)
    p20 = _dot32(a20, t0) + _dot32(a21, x10)
    p21 = _dot32(a21, t1)
    p30 = _dot32(a30, t0) + _dot32(a31, x10)
    p31 = _dot32(a31, t1)
    x20 = -_dot32(t2, p20)
    x21 = -_dot32(t2, p21)
    x30 = -(_dot32(x32, p20) + _dot32(t3, p30))
    x31 = -(_dot32(x32, p21) + _dot32(t3, p31))
    return x10, x20, x21, x30, x31, x32


@triton.jit
def _store_blocks(scr, t0, t1, t2, t3, x10, x20, x21, x30, x31, x32):
    """The inverse's ten lower blocks into A's scratch (its zero upper blocks stay)."""
    _store_block(scr, t0, 0, 0)
    _store_block(scr, t1, 1, 1)
    _store_block(scr, t2, 2, 2)
    _store_block(scr, t3, 3, 3)
    _store_block(scr, x10, 1, 0)
    _store_block(scr, x20, 2, 0)
    _store_block(scr, x21, 2, 1)
    _store_block(scr, x30, 3, 0)
    _store_block(scr, x31, 3, 1)
    _store_block(scr, x32, 3, 2)


@triton.jit
def _dot32(x, y):
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def _block_at(scr, I: tl.constexpr, J: tl.constexpr):
    """Block (I, J) of the [64, 64] fp32 matrix at scr, as 16x16."""
    return tl.load(scr + _block_offs(I, J))
