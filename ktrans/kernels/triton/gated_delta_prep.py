"""The chunked gated delta rule's first launch: each chunk's gates, WY factors and causal q.k decay matrix, in
parallel over chunks (ktrans.kernels.triton.gated_delta runs the sequential scan after it).

For a chunk of 64 tokens and a value head h: L2-normalised q and k, the gates g = -exp(A_log) softplus(a + dt_bias)
and beta = sigmoid(b), their in-chunk cumulative log-decay cum, A = strict_lower(beta_i k_i.k_j exp(cum_i - cum_j)),
and the solve of (I + A) X = [beta k exp(cum) | beta v] by block forward substitution on 16-row blocks (each
diagonal 16x16 block inverted by substitution, the rest matmuls), stored as w and u; also cum and
attn = (q k^T) exp(cum_i - cum_j) (causal). The design is FLA's chunked WY form (fla-org/flash-linear-attention,
fla/ops/gated_delta_rule/wy_fast.py, fla/ops/common/chunk_scaled_dot_kkt.py, fla/ops/utils/solve_tril.py), there
spread over several launches.

One program per (chunk, value head). The block form (FULL=0) runs its phases in order so that each one's values die
before the next: the attention matrix (q, k, q.k), then A's blocks and inverses from the normalised k, then w and u
by column blocks of PREP_COLS (k and v reloaded from L2). Timed on the H200 at T=8192 (doc/benchmarks.md, session
20): 454 us, against 659 for a program per (chunk, key head) holding both heads (a 1.9 KB spill stack at sm_90) and
466 for the inverse stored and w and u made by a second launch; 64-column blocks beat 32 (528 us).

The FULL forms (KTRANS_GDN_PREP_FULL) make A as FLA's chunk_scaled_dot_kkt does, one [64, 64] product of k as
stored beside q.k, the rows' inverse norms applied to the products, through a per-program fp32 scratch: the diagonal
inverses read their rows back from there (KTRANS_GDN_PREP_INV: by doubling, the default, or row by row), and the
whole inverse is assembled there; w and u are whole-chunk products. On an H100 at T=8192 (session 29) FULL=2 took
362.8 us against the block form's 480.8. FULL=5, the default, is 2 with q, k and v loaded early: 297.6 against 336.4
us (session 30, with INV=2). FULL=3 and 4 leave q's products, w and u to later launches (gated_delta_wu; the first
then holds 172 registers, not 255), and lost to 2. A program a key head for both its value heads (session 31's
FULL=6) lost by half and was removed. The inverse's pieces are in gated_delta_inv.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.gated_delta_inv import (_block_at, _inv_diag_doubling, _inv_diag_from, _inv_unit_lower4,
                                                   _store_inverse, _store_inverse_shallow)
from ktrans.kernels.triton.gated_delta_rows import (_gates, _l2norm_rows, _load_rows, _rnorm, _rnorm_diag, _store_attn,
                                                    _store_rows)
from ktrans.kernels.triton.gated_delta_wu import (_q_products, _q_products_of, _qk_kernel, _wu_full, _wu_kernel,
                                                  _wu_rows)

PREP_COLS = 64  # the column block of w and u (gdn_sweep --prep_cols)
# FULL=3's and 4's later launches (gdn_sweep --wu_warps): at sm_90 they spill at 4 warps (464, 568 and 208 bytes a
# thread), not at 8 (244, 245 and 152 registers; gdn_resources --kernel wu|qk); untimed
WU_WARPS = 8
# KTRANS_GDN_PREP_FULL (default 5): the whole (I + A)^-1 through a scratch buffer, w and u as whole-chunk products,
# q's, k's and v's rows loaded early (k and q before the gates, v before the inverse) and w and u made at their whole
# width from the rows so loaded; 2: the same bits with each operand loaded where it is used and w and u by column
# blocks of PREP_COLS; 1: only A as one [64, 64] product there; 0: the block form (_prep_kernel FULL); 3: as 2, with
# q's products, w and u by a second launch; 4: q's products once a key head by a second, w and u by a third
# (gated_delta_wu; the same bits as 2). A sixth form, a program a key head for its value heads (k.k, q.q and q.k
# once for both), lost on an H100 in session 31 (the prep 474.9 against 302.5 us at T=8192, 1,961 against 1,174 at
# T=32768: half the programs, each a chain twice as long) and was removed. Timed on an H100
# (session 30, T=8192, NORMED scan, INV=2): the prep 297.6 (5) against 336.4 us (2); the whole layer 630.2 against
# 667.8 (fla-core 0.6.0: 566.1); 3 and 4 lost to 2 (397 and 399 against 371 us at INV=0).
FULL = int(os.environ.get("KTRANS_GDN_PREP_FULL", "5"))
# KTRANS_GDN_PREP_MAXNREG=n: cap the prep's registers a thread at n (ptxas spills the rest) so that more programs share
# an SM (4 warps: 255 registers fit two, 168 three, 128 four); 0, the default, leaves ptxas free (gdn_sweep
# --prep_maxnreg).
MAXNREG = int(os.environ.get("KTRANS_GDN_PREP_MAXNREG", "0"))
# KTRANS_GDN_PREP_INV (default 2): how the FULL forms make (I + A)^-1. 0: A's diagonal 16x16 blocks inverted row by
# row (_inv_diag_from: fifteen dependent steps, each a load, a reduction and a broadcast), then the whole inverse
# assembled six dependent 16x16 products deep (_store_inverse); 1: the diagonal blocks by doubling (_inv_diag_doubling:
# three dependent pairs of batched products); 2: also the assembly by 32-row halves, four products deep
# (_store_inverse_shallow). Cutting the whole inverse took the FULL=2 prep from 371.6 to 241.7 us on an H100 (session
# 30, T=8192): a chain of latencies at two programs an SM. There: the prep 370.2 (0), 342.0 (1), 336.4 us (2) at
# FULL=2; 329.2, 300.2, 297.6 at FULL=5.
INV = int(os.environ.get("KTRANS_GDN_PREP_INV", "2"))


@triton.jit
def _kkt(ki, kj, beta_i, ci, cj, DIAG: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """A block of A: beta_i (k_i . k_j) exp(cum_i - cum_j), strictly lower inside a diagonal block."""
    kk = tl.dot(ki.to(DT), tl.trans(kj.to(DT)), input_precision=PREC)
    d = ci[:, None] - cj[None, :]
    if DIAG:
        r = tl.arange(0, ki.shape[0])
        # Masked before exp: the upper half's exponents are positive and never become numbers.
        d = tl.where(r[:, None] > r[None, :], d, float("-inf"))
    return kk * beta_i[:, None] * tl.exp(d)


@triton.jit
def _solve(t0, t1, t2, t3, a10, a20, a21, a30, a31, a32, b0, b1, b2, b3, DT: tl.constexpr, PREC: tl.constexpr):
    """X with (I + A) X = B for a 64-row chunk, by blocks: X_i = T_ii (B_i - sum_{j<i} A_ij X_j)."""
    x0 = tl.dot(t0.to(DT), b0.to(DT), input_precision=PREC)
    x1 = tl.dot(t1.to(DT), (b1 - tl.dot(a10.to(DT), x0.to(DT), input_precision=PREC)).to(DT), input_precision=PREC)
    y2 = b2 - tl.dot(a20.to(DT), x0.to(DT), input_precision=PREC) - tl.dot(a21.to(DT), x1.to(DT), input_precision=PREC)
    x2 = tl.dot(t2.to(DT), y2.to(DT), input_precision=PREC)
    y3 = (b3 - tl.dot(a30.to(DT), x0.to(DT), input_precision=PREC) - tl.dot(a31.to(DT), x1.to(DT), input_precision=PREC)
          - tl.dot(a32.to(DT), x2.to(DT), input_precision=PREC))
    x3 = tl.dot(t3.to(DT), y3.to(DT), input_precision=PREC)
    return x0, x1, x2, x3


@triton.jit
def _chunk_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, cum_ptr, row0, n, h, stride_at, stride_bt, HV: tl.constexpr):
    """Value head h's gates over a chunk: the cumulative log-decay of each 16-row block (c0..c3) and of the whole
    chunk (cf, stored to cum), and beta by block and for the whole chunk (bf)."""
    S: tl.constexpr = 16
    C: tl.constexpr = 64
    g0, be0 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, 0, S)
    g1, be1 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, S, S)
    g2, be2 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, 2 * S, S)
    g3, be3 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, 3 * S, S)
    gf, bf = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, 0, C)
    # Log-decay from the chunk's start through each token; all <= 0, so every exp below is of a non-positive number
    # for j <= i.
    c0 = tl.cumsum(g0, axis=0)
    c1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    c2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
    c3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)
    cf = tl.cumsum(gf, axis=0)
    rc = tl.arange(0, C)
    tl.store(cum_ptr + (row0 + rc).to(tl.int64) * HV + h, cf, mask=rc < n)
    return c0, c1, c2, c3, be0, be1, be2, be3, cf, bf


@triton.jit
def _wy_blocks(k0, k1, k2, k3, be0, be1, be2, be3, c0, c1, c2, c3, DT: tl.constexpr, PREC: tl.constexpr):
    """A's six off-diagonal 16x16 blocks and the inverses of (I + its diagonal blocks), from the normalised k."""
    a10 = _kkt(k1, k0, be1, c1, c0, False, DT, PREC)
    a20 = _kkt(k2, k0, be2, c2, c0, False, DT, PREC)
    a21 = _kkt(k2, k1, be2, c2, c1, False, DT, PREC)
    a30 = _kkt(k3, k0, be3, c3, c0, False, DT, PREC)
    a31 = _kkt(k3, k1, be3, c3, c1, False, DT, PREC)
    a32 = _kkt(k3, k2, be3, c3, c2, False, DT, PREC)
    t0, t1, t2, t3 = _inv_unit_lower4(_kkt(k0, k0, be0, c0, c0, True, DT, PREC),
                                      _kkt(k1, k1, be1, c1, c1, True, DT, PREC),
                                      _kkt(k2, k2, be2, c2, c2, True, DT, PREC),
                                      _kkt(k3, k3, be3, c3, c3, True, DT, PREC))
    return a10, a20, a21, a30, a31, a32, t0, t1, t2, t3


@triton.jit
def _solve_cols(ptr, stride_t, col0, ncols, row0, n, f0, s0, f1, s1, f2, s2, f3, s3, t0, t1, t2, t3,
                a10, a20, a21, a30, a31, a32, out_ptr, out_stride_t, COLS: tl.constexpr, DT: tl.constexpr,
                PREC: tl.constexpr):
    """Columns col0 .. col0+COLS of X with (I + A) X = B, B's row blocks x_i loaded from ptr and scaled by a norm,
    then a coefficient: B_i = (x_i f_i) s_i; stored to out_ptr."""
    S: tl.constexpr = 16
    b0 = _load_rows(ptr, row0, n, stride_t, col0, ncols, 0, S, COLS, WIDE=False)
    b1 = _load_rows(ptr, row0, n, stride_t, col0, ncols, S, S, COLS, WIDE=False)
    b2 = _load_rows(ptr, row0, n, stride_t, col0, ncols, 2 * S, S, COLS, WIDE=False)
    b3 = _load_rows(ptr, row0, n, stride_t, col0, ncols, 3 * S, S, COLS, WIDE=False)
    x0, x1, x2, x3 = _solve(t0, t1, t2, t3, a10, a20, a21, a30, a31, a32, (b0 * f0[:, None]) * s0[:, None],
                            (b1 * f1[:, None]) * s1[:, None], (b2 * f2[:, None]) * s2[:, None],
                            (b3 * f3[:, None]) * s3[:, None], DT, PREC)
    _store_rows(out_ptr, x0, row0, n, out_stride_t, col0, ncols, 0)
    _store_rows(out_ptr, x1, row0, n, out_stride_t, col0, ncols, S)
    _store_rows(out_ptr, x2, row0, n, out_stride_t, col0, ncols, 2 * S)
    _store_rows(out_ptr, x3, row0, n, out_stride_t, col0, ncols, 3 * S)


@triton.jit
def _prep_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, cum_ptr, attn_ptr,
                 qn_ptr, kn_ptr, scr_ptr, chunk_start, chunk_len, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_vt, stride_vh, stride_at, stride_bt,
                 HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BVF: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                 NORMED: tl.constexpr = False, FULL: tl.constexpr = 0, INV: tl.constexpr = 0):
    """One program per (chunk, value head), its phases ordered so that each one's values die before the next (see
    the module's docstring). NORMED: the first value head of each key head also stores the chunk's normalised q
    (times Dk^-1/2) and the last its normalised k, to qn, kn [T, HK, Dk] in the dots' dtype, for the scan to read as
    they are.
    FULL (KTRANS_GDN_PREP_FULL): A for the whole chunk as one [64, 64] product of k as stored beside q.k (the rows'
    inverse norms applied to the products), stored with those norms to the program's scratch (scr, fp32
    [64 * 64 + 64]) and read back by blocks (L1/L2) for the diagonal inverses and the solve: no [16, Dk] row blocks of
    k and no ten 16x16 products held in registers. FULL=2: the whole (I + A)^-1 assembled from the blocks (fp32
    16x16 products) into the scratch, then w and u as [64, 64] x [64, BC] products of k and v as stored, the
    coefficients (beta exp(cum) / the norm, beta) folded into the inverse's columns."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // R
    row0 = tl.load(chunk_start + c)
    n = tl.load(chunk_len + c)
    S: tl.constexpr = 16
    C: tl.constexpr = 64
    kp = k_ptr + kh * stride_kh
    qp = q_ptr + kh * stride_qh
    vp = v_ptr + h * stride_vh
    if FULL == 5:  # the chunk's k and q rows asked for first, their latency behind the gates' loads and sums
        kr = _load_rows(kp, row0, n, stride_kt, 0, DK, 0, 64, BK, False, WIDE=False).to(DT)
        qr = _load_rows(qp, row0, n, stride_qt, 0, DK, 0, 64, BK, False, WIDE=False).to(DT)
    c0, c1, c2, c3, be0, be1, be2, be3, cf, bf = _chunk_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, cum_ptr, row0, n, h,
                                                              stride_at, stride_bt, HV)
    one = tl.full((S,), 1.0, tl.float32)
    if FULL:
        # q.k and k.k from q and k as stored (exact products), the rows' inverse norms applied to the [64, 64]s and
        # taken from the diagonals of k.k and q.q (the sums of squares, fp32-accumulated products of the stored
        # values): no fp32 copy of q or k is held (gdn_resources, session 28: FULL=2's stack 144 bytes against 352
        # with the norms from fp32 copies).
        if FULL != 5:
            kr = _load_rows(kp, row0, n, stride_kt, 0, DK, 0, C, BK, False, WIDE=False).to(DT)
        rc = tl.arange(0, C)
        kt = tl.trans(kr)
        kk = tl.dot(kr, kt, input_precision=PREC)
        rk = _rnorm_diag(kk)
        if FULL < 3:  # 3, 4: q's products are a later launch's, off this one's register peak (255 -> 172 at sm_90)
            _q_products(qp, kr, kt, rk, cf, c, h, kh, row0, n, stride_qt, attn_ptr, qn_ptr, kn_ptr, cum_ptr, HV, R,
                        DK, BK, DT, PREC, NORMED)
        if FULL == 5:
            _q_products_of(qr, kr, kt, rk, cf, c, h, kh, row0, n, attn_ptr, qn_ptr, kn_ptr, cum_ptr, HV, R, DK, DT,
                           PREC, NORMED)
            # v's rows asked for now, to arrive while the inverse is made (k's stay from above)
            vr = _load_rows(vp, row0, n, stride_vt, 0, DV, 0, C, BVF, False, WIDE=False).to(DT)
        # Masked before exp: the upper half's exponents are positive and never become numbers.
        dec = tl.where(rc[:, None] > rc[None, :], cf[:, None] - cf[None, :], float("-inf"))
        a_full = kk * (bf * rk)[:, None] * rk[None, :] * tl.exp(dec)
        scr = scr_ptr + (c * HV + h).to(tl.int64) * (C * C + C)
        tl.store(scr + rc[:, None] * C + rc[None, :], a_full)
        if FULL == 1 or FULL == 3 or FULL == 4:  # the solve by blocks (1) and the later launches read the norms back
            tl.store(scr + C * C + rc, rk)
        tl.debug_barrier()  # the program's threads read back what others stored
        if INV:
            t0, t1, t2, t3 = _inv_diag_doubling(scr)
        else:
            t0, t1, t2, t3 = _inv_diag_from(scr)
        a10, a20, a21 = _block_at(scr, 1, 0), _block_at(scr, 2, 0), _block_at(scr, 2, 1)
        a30, a31, a32 = _block_at(scr, 3, 0), _block_at(scr, 3, 1), _block_at(scr, 3, 2)
        if FULL >= 2:
            if INV == 2:
                _store_inverse_shallow(scr, t0, t1, t2, t3, a10, a20, a21, a30, a31, a32)
            else:
                _store_inverse(scr, t0, t1, t2, t3, a10, a20, a21, a30, a31, a32)
            if FULL == 3 or FULL == 4:  # the rest by later launches (gated_delta_wu) from the inverse and the norms
                return
            tl.debug_barrier()  # the whole inverse, written by all the program's threads
            if FULL == 5:
                _wu_rows(tl.load(scr + rc[:, None] * C + rc[None, :]), bf, cf, rk, kr, vr, w_ptr, u_ptr, h, row0, n,
                         HV, DK, DV, DT, PREC)
            else:
                _wu_full(tl.load(scr + rc[:, None] * C + rc[None, :]), bf, cf, rk, kp, vp, w_ptr, u_ptr, h, row0, n,
                         stride_kt, stride_vt, HV, DK, DV, BK, BVF, BC, DT, PREC)
            return
        rs = tl.arange(0, S)
        f0, f1 = tl.load(scr + C * C + rs), tl.load(scr + C * C + S + rs)
        f2, f3 = tl.load(scr + C * C + 2 * S + rs), tl.load(scr + C * C + 3 * S + rs)
    else:
        # the attention matrix: q and the whole chunk's k die here
        kf = _l2norm_rows(_load_rows(kp, row0, n, stride_kt, 0, DK, 0, C, BK, WIDE=False))
        qf = _l2norm_rows(_load_rows(qp, row0, n, stride_qt, 0, DK, 0, C, BK, WIDE=False)) * (DK ** -0.5)
        _store_attn(attn_ptr, tl.dot(qf.to(DT), tl.trans(kf.to(DT)), input_precision=PREC), cf, c, h, HV)
        if NORMED:
            if h % R == 0:
                _store_rows(qn_ptr + kh * DK, qf, row0, n, (HV // R) * DK, 0, DK, 0)
            if h % R == R - 1:
                _store_rows(kn_ptr + kh * DK, kf, row0, n, (HV // R) * DK, 0, DK, 0)

        # A's blocks and the diagonal inverses from the normalised k at full width; only the rows' norms go on
        x0 = _load_rows(kp, row0, n, stride_kt, 0, DK, 0, S, BK, WIDE=False)
        x1 = _load_rows(kp, row0, n, stride_kt, 0, DK, S, S, BK, WIDE=False)
        x2 = _load_rows(kp, row0, n, stride_kt, 0, DK, 2 * S, S, BK, WIDE=False)
        x3 = _load_rows(kp, row0, n, stride_kt, 0, DK, 3 * S, S, BK, WIDE=False)
        f0, f1, f2, f3 = _rnorm(x0), _rnorm(x1), _rnorm(x2), _rnorm(x3)
        a10, a20, a21, a30, a31, a32, t0, t1, t2, t3 = _wy_blocks(
            x0 * f0[:, None], x1 * f1[:, None], x2 * f2[:, None], x3 * f3[:, None], be0, be1, be2, be3, c0, c1, c2,
            c3, DT, PREC)

    # w = (I + A)^-1 (beta k exp(cum)) and u = (I + A)^-1 (beta v), a column block at a time
    for col in tl.static_range(0, BK, BC):
        _solve_cols(kp, stride_kt, col, DK - col, row0, n, f0, be0 * tl.exp(c0), f1, be1 * tl.exp(c1),
                    f2, be2 * tl.exp(c2), f3, be3 * tl.exp(c3), t0, t1, t2, t3, a10, a20, a21, a30, a31, a32,
                    w_ptr + h * DK, HV * DK, BC, DT, PREC)
    for col in tl.static_range(0, BVF, BC):
        _solve_cols(vp, stride_vt, col, DV - col, row0, n, one, be0, one, be1, one, be2, one, be3,
                    t0, t1, t2, t3, a10, a20, a21, a30, a31, a32, u_ptr + h * DV, HV * DV, BC, DT, PREC)


def launch_prep(q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, plan, bk: int, bvf: int, dt, prec: str,
                warps: int, cols: int | None = None, qn=None, kn=None, full: int | None = None,
                maxnreg: int | None = None, wu_warps: int | None = None, inv: int | None = None) -> None:
    """The prep launch with `warps`, w and u made by column blocks of `cols` (default PREP_COLS); qn and kn given
    (both or neither, [T, HK, Dk] contiguous): the normalised q and k stored there too (_prep_kernel's NORMED);
    `full` (default FULL, 0..5): A (and from 2 its inverse) through a scratch buffer (_prep_kernel's FULL, 16.3 KiB
    a chunk and value head; 3: q's products, w and u by a second launch, _wu_kernel; 4: q's products once a key head
    by a second, _qk_kernel, w and u by a third; 5: as 2, the operands loaded early); `maxnreg` (default MAXNREG, 0:
    none): the registers a thread of the first launch may use; `wu_warps` (default WU_WARPS): the later launches'
    warps; `inv` (default INV): the inverse's form (0: row by row, 1: the diagonal blocks by doubling, 2: and the
    assembly by halves)."""
    hk = k.shape[1]
    hv, dv = v.shape[1:]
    cols = cols or PREP_COLS
    if cols < 16 or cols & (cols - 1):
        raise ValueError(f"the DeltaNet prep's column block (gated_delta_prep.PREP_COLS, gdn_sweep --prep_cols) must "
                         f"be a power of two of at least 16 (a tensor-core product's width), got {cols}")
    normed = qn is not None
    full = FULL if full is None else int(full)
    if full not in range(6):
        raise ValueError(f"the DeltaNet prep's form (KTRANS_GDN_PREP_FULL, gdn_sweep --prep_full) must be 0 to 5, got "
                         f"{full}")
    inv = INV if inv is None else int(inv)
    if inv not in range(3):
        raise ValueError(f"the DeltaNet prep's inverse form (KTRANS_GDN_PREP_INV, gdn_sweep --prep_inv) must be 0 to "
                         f"2, got {inv}")
    scr = torch.empty(plan.num_chunks * hv * (64 * 64 + 64) if full else 1, dtype=torch.float32, device=v.device)
    bc = min(cols, bk, bvf)
    _prep_kernel[(plan.num_chunks, hv)](
        q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, qn if normed else w, kn if normed else w, scr,
        plan.chunk_start, plan.chunk_len, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), HV=hv, R=hv // hk, DK=k.shape[2], DV=dv, BK=bk, BVF=bvf, BC=bc,
        DT=dt, PREC=prec, NORMED=normed, FULL=full, INV=inv, num_warps=warps,
        **_reg_cap(maxnreg))
    if full == 4:
        _qk_kernel[(plan.num_chunks, hk)](
            q, k, cum, attn, qn if normed else w, kn if normed else w, scr, plan.chunk_start, plan.chunk_len,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), HV=hv, R=hv // hk, DK=k.shape[2], BK=bk, DT=dt,
            PREC=prec, NORMED=normed, num_warps=wu_warps or WU_WARPS)
    if full in (3, 4):
        _wu_kernel[(plan.num_chunks, hv)](
            q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, qn if normed else w, kn if normed else w, scr,
            plan.chunk_start, plan.chunk_len, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), a.stride(0), b.stride(0), HV=hv, R=hv // hk, DK=k.shape[2], DV=dv, BK=bk, BVF=bvf, BC=bc,
            DT=dt, PREC=prec, NORMED=normed, QK=full == 3, num_warps=wu_warps or WU_WARPS)


def _reg_cap(maxnreg: int | None) -> dict:
    """The launch's maxnreg option, if any (Triton's CUDA backend; its interpreter drops it)."""
    maxnreg = MAXNREG if maxnreg is None else maxnreg
    if maxnreg and not 24 <= maxnreg <= 255:
        raise ValueError(f"the DeltaNet prep's register cap (KTRANS_GDN_PREP_MAXNREG, gdn_sweep --prep_maxnreg) must "
                         f"be 0 (none) or 24..255, got {maxnreg}")
    return {"maxnreg": maxnreg} if maxnreg else {}
