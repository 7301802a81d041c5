"""The chunked gated delta rule's prep with one program per (chunk, key head) (KTRANS_GDN_PREP_FULL=6): the R value
heads that share a key head share its k and q, so k.k, q.q and q.k, the rows' norms and the normalised q and k are
made once for all R, and the R inverses of I + A are made side by side, each dependent step one batched product over
R heads' blocks rather than R chains one after another. Otherwise FULL=5's program (gated_delta_prep): A through the
per-head scratch, the diagonal blocks by doubling, the assembly by halves, w and u at their whole width from rows
loaded early. Needs R a power of two (Qwen3-Next: R = 2); launch_prep takes FULL=5 for other R."""
from __future__ import annotations

import triton
import triton.language as tl

from ktrans.kernels.triton.gated_delta_inv import _assemble_shallow, _block_offs, _doubling
from ktrans.kernels.triton.gated_delta_rows import _gates, _load_rows, _rnorm_diag, _store_attn, _store_rows
from ktrans.kernels.triton.gated_delta_wu import _wu_rows


@triton.jit
def _head_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt):
    """Value head h's cum (the chunk's cumulative log-decay) and beta, as gated_delta_prep._chunk_gates makes them."""
    gf, bf = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, 0, 64)
    return tl.cumsum(gf, axis=0), bf


@triton.jit
def _heads_at(scr0, I: tl.constexpr, J: tl.constexpr, R: tl.constexpr):
    """Block (I, J) of each of R heads' [64, 64] scratches (head stride 64 * 64 + 64) as [R, 16, 16]."""
    hd = tl.arange(0, R)[:, None, None]
    return tl.load(scr0 + hd * (64 * 64 + 64) + _block_offs(I, J)[None, :, :])


@triton.jit
def _store_heads(scr0, x, I: tl.constexpr, J: tl.constexpr, R: tl.constexpr):
    hd = tl.arange(0, R)[:, None, None]
    tl.store(scr0 + hd * (64 * 64 + 64) + _block_offs(I, J)[None, :, :], x)


@triton.jit
def _pick(t4, b: tl.constexpr):
    """Diagonal block b of every head, [R, 16, 16], from t4 [R, 4, 16, 16]."""
    blk = tl.arange(0, 4)[None, :, None, None]
    return tl.sum(tl.where(blk == b, t4, 0.0), axis=1)


@triton.jit
def _inverse_heads(scr0, R: tl.constexpr):
    """(I + A)^-1 of R heads at once, over their A in scratch: the diagonal blocks by doubling over [4R, 16, 16],
    then the assembly by halves over [R, 16, 16] blocks; written back over A."""
    S: tl.constexpr = 16
    m = tl.arange(0, 4 * R)[:, None, None]  # head m // 4, diagonal block m % 4
    r = tl.arange(0, S)
    base = scr0 + (m // 4) * (64 * 64 + 64) + (m % 4) * (S * 64 + S)
    t = _doubling(tl.load(base + r[None, :, None] * 64 + r[None, None, :]))
    t4 = tl.reshape(t, [R, 4, S, S])
    t0, t1, t2, t3 = _pick(t4, 0), _pick(t4, 1), _pick(t4, 2), _pick(t4, 3)
    x10, x20, x21, x30, x31, x32 = _assemble_shallow(
        t0, t1, t2, t3, _heads_at(scr0, 1, 0, R), _heads_at(scr0, 2, 0, R), _heads_at(scr0, 2, 1, R),
        _heads_at(scr0, 3, 0, R), _heads_at(scr0, 3, 1, R), _heads_at(scr0, 3, 2, R))
    tl.debug_barrier()  # every thread's reads of A's blocks are done before they are overwritten
    _store_heads(scr0, t0, 0, 0, R)
    _store_heads(scr0, t1, 1, 1, R)
    _store_heads(scr0, t2, 2, 2, R)
    _store_heads(scr0, t3, 3, 3, R)
    _store_heads(scr0, x10, 1, 0, R)
    _store_heads(scr0, x20, 2, 0, R)
    _store_heads(scr0, x21, 2, 1, R)
    _store_heads(scr0, x30, 3, 0, R)
    _store_heads(scr0, x31, 3, 1, R)
    _store_heads(scr0, x32, 3, 2, R)


@triton.jit
def _prep_group_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, cum_ptr, attn_ptr, qn_ptr,
                       kn_ptr, scr_ptr, chunk_start, chunk_len, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                       stride_vh, stride_at, stride_bt, HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                       NORMED: tl.constexpr):
    """One program per (chunk, key head kh), for its value heads kh * R .. kh * R + R - 1: the same stores as
    gated_delta_prep._prep_kernel's FULL=5 for each of them."""
    c = tl.program_id(0)
    kh = tl.program_id(1)
    row0 = tl.load(chunk_start + c)
    n = tl.load(chunk_len + c)
    C: tl.constexpr = 64
    rc = tl.arange(0, C)
    kr = _load_rows(k_ptr + kh * stride_kh, row0, n, stride_kt, 0, DK, 0, C, BK, False, WIDE=False).to(DT)
    qr = _load_rows(q_ptr + kh * stride_qh, row0, n, stride_qt, 0, DK, 0, C, BK, False, WIDE=False).to(DT)
    kt = tl.trans(kr)
    kk = tl.dot(kr, kt, input_precision=PREC)
    rk = _rnorm_diag(kk)
    rq = _rnorm_diag(tl.dot(qr, tl.trans(qr), input_precision=PREC)) * (DK ** -0.5)
    if NORMED:
        _store_rows(qn_ptr + kh * DK, qr * rq[:, None], row0, n, (HV // R) * DK, 0, DK, 0)
        _store_rows(kn_ptr + kh * DK, kr * rk[:, None], row0, n, (HV // R) * DK, 0, DK, 0)
    qk = tl.dot(qr, kt, input_precision=PREC) * rq[:, None] * rk[None, :]
    scr0 = scr_ptr + (c * HV + kh * R).to(tl.int64) * (C * C + C)
    for j in tl.static_range(R):  # each head's gates, attention matrix and A
        h = kh * R + j
        cf, bf = _head_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt)
        tl.store(cum_ptr + (row0 + rc).to(tl.int64) * HV + h, cf, mask=rc < n)
        _store_attn(attn_ptr, qk, cf, c, h, HV)
        # Masked before exp: the upper half's exponents are positive and never become numbers.
        dec = tl.where(rc[:, None] > rc[None, :], cf[:, None] - cf[None, :], float("-inf"))
        tl.store(scr0 + j * (C * C + C) + rc[:, None] * C + rc[None, :],
                 kk * (bf * rk)[:, None] * rk[None, :] * tl.exp(dec))
    # the first head's v rows asked for now, to arrive while the inverses are made; each next head's before the
    # last one's products
    vr_next = _load_rows(v_ptr + kh * R * stride_vh, row0, n, stride_vt, 0, DV, 0, C, BVF, False, WIDE=False)
    tl.debug_barrier()  # the program's threads read back what others stored
    _inverse_heads(scr0, R)
    tl.debug_barrier()  # the whole inverses, written by all the program's threads
    for j in tl.static_range(R):  # each head's w and u
        h = kh * R + j
        vr = vr_next.to(DT)
        if j + 1 < R:
            vr_next = _load_rows(v_ptr + (h + 1) * stride_vh, row0, n, stride_vt, 0, DV, 0, C, BVF, False,
                                 WIDE=False)
        cf, bf = _head_gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt)
        ainv = tl.load(scr0 + j * (C * C + C) + rc[:, None] * C + rc[None, :])
        _wu_rows(ainv, bf, cf, rk, kr, vr, w_ptr, u_ptr, h, row0, n, HV, DK, DV, DT, PREC)
