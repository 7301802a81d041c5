"""The DeltaNet prep's later launches, for the FULL forms that split it (ktrans.kernels.triton.gated_delta_prep,
KTRANS_GDN_PREP_FULL=3 and 4): after the first launch has left each chunk's (I + A)^-1 and the k rows' inverse norms
in its per-program scratch and cum in place, the attention matrix (q's products, with the normalised q and k) and w
and u: FULL=3 in one launch a value head (_wu_kernel), FULL=4 in two, q's products once a key head (_qk_kernel, half
the q.k work of the others) and then w and u a value head.
The same fp32 values go into the same products as FULL=2's one launch (_q_products, _wu_full are its tail too), so
the outputs are the same bits. FLA splits its prep likewise (chunk_scaled_dot_kkt and solve_tril, then
recompute_w_u)."""
from __future__ import annotations

import triton
import triton.language as tl

from ktrans.kernels.triton.gated_delta_rows import _gates, _load_rows, _rnorm_diag, _store_attn, _store_rows


@triton.jit
def _chunk_cum(cum_ptr, row0, n, h, HV: tl.constexpr):
    """Value head h's cum over a chunk as the first launch stored it, the rows past the chunk's end carrying its last
    value on, as that launch's cumsum over their zero gates did."""
    rc = tl.arange(0, 64)
    return tl.load(cum_ptr + (row0 + tl.minimum(rc, n - 1)).to(tl.int64) * HV + h)


@triton.jit
def _q_products(qp, kr, kt, rk, cf, c, h, kh, row0, n, stride_qt, attn_ptr, qn_ptr, kn_ptr, cum_ptr,
                HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                PREC: tl.constexpr, NORMED: tl.constexpr, GROUP: tl.constexpr = False):
    """The FULL forms' attention matrix from q as stored and k (kr, its transpose kt, its rows' inverse norms rk),
    q's norms from the diagonal of q.q, for value head h (cum cf); with NORMED, the normalised q and k stored too.
    GROUP: for every value head of key head kh, q.k made once and each head's cum loaded from cum_ptr."""
    qr = _load_rows(qp, row0, n, stride_qt, 0, DK, 0, 64, BK, False, WIDE=False).to(DT)
    _q_products_of(qr, kr, kt, rk, cf, c, h, kh, row0, n, attn_ptr, qn_ptr, kn_ptr, cum_ptr, HV, R, DK, DT, PREC,
                   NORMED, GROUP)


@triton.jit
def _q_products_of(qr, kr, kt, rk, cf, c, h, kh, row0, n, attn_ptr, qn_ptr, kn_ptr, cum_ptr, HV: tl.constexpr,
                   R: tl.constexpr, DK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, NORMED: tl.constexpr,
                   GROUP: tl.constexpr = False):
    """_q_products from q's rows as loaded (qr [64, BK] in the dots' dtype)."""
    rq = _rnorm_diag(tl.dot(qr, tl.trans(qr), input_precision=PREC)) * (DK ** -0.5)
    qk = tl.dot(qr, kt, input_precision=PREC) * rq[:, None] * rk[None, :]
    if GROUP:
        for j in tl.static_range(R):
            _store_attn(attn_ptr, qk, _chunk_cum(cum_ptr, row0, n, kh * R + j, HV), c, kh * R + j, HV)
    else:
        _store_attn(attn_ptr, qk, cf, c, h, HV)
    if NORMED:
        if GROUP or h % R == 0:  # one value head a key head stores each (one fp32 copy a program)
            _store_rows(qn_ptr + kh * DK, qr * rq[:, None], row0, n, (HV // R) * DK, 0, DK, 0)
        if GROUP or h % R == R - 1:
            _store_rows(kn_ptr + kh * DK, kr * rk[:, None], row0, n, (HV // R) * DK, 0, DK, 0)


@triton.jit
def _wu_full(ainv, bf, cf, rk, kp, vp, w_ptr, u_ptr, h, row0, n, stride_kt, stride_vt, HV: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BC: tl.constexpr,
             DT: tl.constexpr, PREC: tl.constexpr):
    """w and u of one chunk and value head as whole-chunk products of (I + A)^-1 (ainv, fp32 [64, 64]) and k and v
    as stored, the coefficients (beta exp(cum) / the k row's norm, beta) folded into the inverse's columns; by
    column blocks of BC."""
    C: tl.constexpr = 64
    wk = (ainv * (bf * tl.exp(cf) * rk)[None, :]).to(DT)
    for col in tl.static_range(0, BK, BC):
        kb = _load_rows(kp, row0, n, stride_kt, col, DK - col, 0, C, BC, False, WIDE=False)
        _store_rows(w_ptr + h * DK, tl.dot(wk, kb.to(DT), input_precision=PREC), row0, n, HV * DK, col, DK - col, 0)
    uv = (ainv * bf[None, :]).to(DT)
    for col in tl.static_range(0, BVF, BC):
        vb = _load_rows(vp, row0, n, stride_vt, col, DV - col, 0, C, BC, False, WIDE=False)
        _store_rows(u_ptr + h * DV, tl.dot(uv, vb.to(DT), input_precision=PREC), row0, n, HV * DV, col, DV - col, 0)


@triton.jit
def _wu_rows(ainv, bf, cf, rk, kr, vr, w_ptr, u_ptr, h, row0, n, HV: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """_wu_full from k's and v's rows as loaded (kr [64, BK], vr [64, BVF], in the dots' dtype), at their whole
    width: FULL=5's, its loads issued long before (the same products, column for column)."""
    wk = (ainv * (bf * tl.exp(cf) * rk)[None, :]).to(DT)
    _store_rows(w_ptr + h * DK, tl.dot(wk, kr, input_precision=PREC), row0, n, HV * DK, 0, DK, 0)
    uv = (ainv * bf[None, :]).to(DT)
    _store_rows(u_ptr + h * DV, tl.dot(uv, vr, input_precision=PREC), row0, n, HV * DV, 0, DV, 0)


@triton.jit
def _wu_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, cum_ptr, attn_ptr, qn_ptr, kn_ptr,
               scr_ptr, chunk_start, chunk_len, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_at, stride_bt, HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BK: tl.constexpr, BVF: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
               NORMED: tl.constexpr, QK: tl.constexpr = True):
    """One program per (chunk, value head): with QK (FULL=3) the attention matrix (and with NORMED the normalised q
    and k), then w and u, from the inverse and the k rows' inverse norms in the program's scratch, cum, and beta made
    again from b."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // R
    row0 = tl.load(chunk_start + c)
    n = tl.load(chunk_len + c)
    C: tl.constexpr = 64
    rc = tl.arange(0, C)
    _, bf = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, 0, C)
    cf = _chunk_cum(cum_ptr, row0, n, h, HV)
    scr = scr_ptr + (c * HV + h).to(tl.int64) * (C * C + C)
    rk = tl.load(scr + C * C + rc)
    kp = k_ptr + kh * stride_kh
    if QK:
        kr = _load_rows(kp, row0, n, stride_kt, 0, DK, 0, C, BK, False, WIDE=False).to(DT)
        _q_products(q_ptr + kh * stride_qh, kr, tl.trans(kr), rk, cf, c, h, kh, row0, n, stride_qt, attn_ptr,
                    qn_ptr, kn_ptr, cum_ptr, HV, R, DK, BK, DT, PREC, NORMED)
    _wu_full(tl.load(scr + rc[:, None] * C + rc[None, :]), bf, cf, rk, kp, v_ptr + h * stride_vh, w_ptr, u_ptr, h,
             row0, n, stride_kt, stride_vt, HV, DK, DV, BK, BVF, BC, DT, PREC)


@triton.jit
def _qk_kernel(q_ptr, k_ptr, cum_ptr, attn_ptr, qn_ptr, kn_ptr, scr_ptr, chunk_start, chunk_len, stride_qt,
               stride_qh, stride_kt, stride_kh, HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr,
               BK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, NORMED: tl.constexpr):
    """FULL=4's q launch, one program per (chunk, key head): q.k once for the key head's R value heads (the norms of
    k's rows from its first value head's scratch: every value head of a key head made the same ones), each head's
    attention matrix with its own decay, and with NORMED the normalised q and k."""
    c = tl.program_id(0)
    kh = tl.program_id(1)
    row0 = tl.load(chunk_start + c)
    n = tl.load(chunk_len + c)
    C: tl.constexpr = 64
    rk = tl.load(scr_ptr + (c * HV + kh * R).to(tl.int64) * (C * C + C) + C * C + tl.arange(0, C))
    kr = _load_rows(k_ptr + kh * stride_kh, row0, n, stride_kt, 0, DK, 0, C, BK, False, WIDE=False).to(DT)
    _q_products(q_ptr + kh * stride_qh, kr, tl.trans(kr), rk, rk, c, kh * R, kh, row0, n, stride_qt, attn_ptr,
                qn_ptr, kn_ptr, cum_ptr, HV, R, DK, BK, DT, PREC, NORMED, GROUP=True)
