"""The fused decode step of a Gated DeltaNet layer in Triton: one launch per layer for a batch of one-token rows.

Per row it does what the reference does in five steps (`ktrans/kernels/torch/conv.py` causal_conv1d_update, the
gates, `ktrans/kernels/torch/gated_delta.py` gated_delta_rule_decode): the conv window update with SiLU, the
gates g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), the q/k L2 norm, and the recurrent update
of the fp32 state, in place in the state pool at the row's slot.

One program per (row, key head): it owns every channel of that key head (its q and k channels and the v channels
of its R value heads) and their R states [Dk, Dv], so no other program reads a conv window it rewrites. (Split
finer, the programs sharing a key head's q/k windows would race: one could shift a window another has not read
yet.) A small batch loads the R states as one [R, Dk, Dv] tile, so the whole 2 x 64 KiB of the real model is in
flight at once from the few SMs that work; a large one takes them a head at a time in smaller programs.

By default the step takes two launches instead (TWO_LAUNCHES), so that the state's traffic is spread over the whole
GPU: `_prep_kernel`, one program per (row, key head) as above, does the conv windows, the gates and the q/k norms and
writes q, k, v, g and beta (a few KiB) to a scratch; `_state_kernel`, one program per (row, value head, block of Dv
columns), updates its block of the state. On the H200 (`ktrans bench kernels --family gdn --match decode`,
2026-12-02) two launches took 10.3 us at B=1 and 82 us at B=64 (0.79 of HBM), the one launch 15.3 and 125 us. Each state column depends on the whole of q and k and on its own v only, so the blocks are
independent (FLA's fused recurrent kernel splits V the same way).

Capturable in a CUDA graph: it reads only shapes on the host and allocates nothing but its output (none when the
caller passes `out`). Pad rows of a graph bucket name the pool's pad slot: several rows then race on that slot,
which nobody reads; their outputs are finite garbage.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.norm import gated_rows
from ktrans.kernels.triton.pdl import enter, launch
from ktrans.kernels.triton.quant import _MAX_TILES, counters


@triton.jit
def _conv_step(x_row, w_ptr, conv_slot, stride_cc, ch, cmask, K: tl.constexpr, KP: tl.constexpr):
    """SiLU(conv) of channels `ch` (1-D) for one new input, and their window shifted by it (to store later)."""
    j = tl.arange(0, KP)
    hist = cmask[:, None] & (j[None, :] < K - 1)
    win = tl.load(conv_slot + ch[:, None] * stride_cc + j[None, :], mask=hist, other=0.0).to(tl.float32)
    x = tl.load(x_row + ch, mask=cmask, other=0.0).to(tl.float32)
    win = tl.where(j[None, :] == K - 1, x[:, None], win)  # [oldest .. newest], the new input last
    w = tl.load(w_ptr + ch[:, None] * K + j[None, :], mask=cmask[:, None] & (j[None, :] < K), other=0.0)
    y = tl.sum(win * w.to(tl.float32), axis=1)
    return y / (1.0 + tl.exp(-y)), win


@triton.jit
def _store_window(conv_slot, stride_cc, ch, cmask, win, K: tl.constexpr, KP: tl.constexpr):
    # Column j of the window becomes column j - 1: the oldest input drops out.
    j = tl.arange(0, KP)
    tl.store(conv_slot + ch[:, None] * stride_cc + (j[None, :] - 1), win.to(conv_slot.dtype.element_ty),
             mask=cmask[:, None] & (j[None, :] >= 1) & (j[None, :] < K))


@triton.jit
def _row_slot(rows_ptr, slots_ptr, i, HAS_ROWS: tl.constexpr):
    """Sequence i's token row (rows[i], or i) and state slot."""
    row = i
    if HAS_ROWS:
        row = tl.load(rows_ptr + i)
    return row, tl.load(slots_ptr + i)


@triton.jit
def _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row, stride_at, stride_bt, stride_g, heads, jmask, R: tl.constexpr):
    """g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) of value heads `heads` at token `row`; a value
    head's a and b sit at (head // R) * stride_g + head % R of their row (stride_g = R: rows of all heads)."""
    off = (heads // R) * stride_g + heads % R
    av = tl.load(a_ptr + row.to(tl.int64) * stride_at + off, mask=jmask, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + row.to(tl.int64) * stride_bt + off, mask=jmask, other=0.0).to(tl.float32)
    xg = av + tl.load(dtb_ptr + heads, mask=jmask, other=0.0).to(tl.float32)
    softplus = tl.where(xg > 20.0, xg, tl.log(1.0 + tl.exp(tl.minimum(xg, 20.0))))  # torch's threshold
    g = -tl.exp(tl.load(alog_ptr + heads, mask=jmask, other=0.0).to(tl.float32)) * softplus
    return g, 1.0 / (1.0 + tl.exp(-bv))


@triton.jit
def _qk_conv(x_row, w_ptr, conv_slot, stride_cc, kh, rk, kmask, KEY_DIM: tl.constexpr, DK: tl.constexpr,
             K: tl.constexpr, KP: tl.constexpr):
    """Key head kh's q and k channels: their SiLU(conv) outputs and shifted windows (to store after a barrier)."""
    qy, qwin = _conv_step(x_row, w_ptr, conv_slot, stride_cc, kh * DK + rk, kmask, K, KP)
    ky, kwin = _conv_step(x_row, w_ptr, conv_slot, stride_cc, KEY_DIM + kh * DK + rk, kmask, K, KP)
    return qy, qwin, ky, kwin


@triton.jit
def _qk_store_and_norm(conv_slot, stride_cc, kh, rk, kmask, qy, qwin, ky, kwin, KEY_DIM: tl.constexpr,
                       DK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """Store the q/k windows (every window read before: the caller's barrier) and return q and k L2-normed, q also
    scaled by Dk^-1/2."""
    _store_qk_windows(conv_slot, stride_cc, kh, rk, kmask, qwin, kwin, KEY_DIM, DK, K, KP)
    return _qk_norm(qy, ky, DK)


@triton.jit
def _store_qk_windows(conv_slot, stride_cc, kh, rk, kmask, qwin, kwin, KEY_DIM: tl.constexpr, DK: tl.constexpr,
                      K: tl.constexpr, KP: tl.constexpr):
    _store_window(conv_slot, stride_cc, kh * DK + rk, kmask, qwin, K, KP)
    _store_window(conv_slot, stride_cc, KEY_DIM + kh * DK + rk, kmask, kwin, K, KP)


@triton.jit
def _qk_norm(qy, ky, DK: tl.constexpr):
    """q and k L2-normed, q also scaled by Dk^-1/2."""
    q = qy * tl.rsqrt(tl.sum(qy * qy, axis=0) + 1e-6) * (DK ** -0.5)
    k = ky * tl.rsqrt(tl.sum(ky * ky, axis=0) + 1e-6)
    return q, k


@triton.jit
def _decode_kernel(x_ptr, rows_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, conv_ptr, ssm_ptr, slots_ptr, o_ptr,
                   stride_xt, stride_at, stride_bt, stride_g, stride_cs, stride_cc, stride_ss, stride_ot, stride_oh,
                   HAS_ROWS: tl.constexpr, HK: tl.constexpr, R: tl.constexpr, RB: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   K: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    i = tl.program_id(0)
    kh = tl.program_id(1)
    row, slot = _row_slot(rows_ptr, slots_ptr, i, HAS_ROWS)
    x_row = x_ptr + row.to(tl.int64) * stride_xt
    conv_slot = conv_ptr + slot * stride_cs
    key_dim: tl.constexpr = HK * DK

    rk = tl.arange(0, BK)
    kmask = rk < DK
    qy, qwin, ky, kwin = _qk_conv(x_row, w_ptr, conv_slot, stride_cc, kh, rk, kmask, key_dim, DK, K, KP)
    tl.debug_barrier()  # every thread has read the q/k windows before any is shifted
    q, k = _qk_store_and_norm(conv_slot, stride_cc, kh, rk, kmask, qy, qwin, ky, kwin, key_dim, DK, K, KP)

    # The group's R value heads, RB at a time: their states as one [RB, Dk, Dv] tile, their v channels as one
    # flat range (head j, column c).
    rj = tl.arange(0, RB)
    rv = tl.arange(0, BV)
    f = tl.arange(0, RB * BV)
    sp = ssm_ptr + slot * stride_ss
    for j0 in tl.static_range(0, R, RB):
        fj, fc = j0 + f // BV, f % BV
        vch = 2 * key_dim + (kh * R + fj) * DV + fc
        vmask = (fj < R) & (fc < DV)
        vy, vwin = _conv_step(x_row, w_ptr, conv_slot, stride_cc, vch, vmask, K, KP)
        jmask = j0 + rj < R
        heads = kh * R + j0 + rj
        soff = (heads[:, None, None] * DK + rk[None, :, None]) * DV + rv[None, None, :]
        smask = jmask[:, None, None] & kmask[None, :, None] & (rv < DV)[None, None, :]
        state = tl.load(sp + soff, mask=smask, other=0.0)
        tl.debug_barrier()  # these heads' v windows are read before they are shifted
        _store_window(conv_slot, stride_cc, vch, vmask, vwin, K, KP)

        v = tl.reshape(vy, (RB, BV))
        g, beta = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row, stride_at, stride_bt, stride_g, heads, jmask, R)

        state = state * tl.exp(g)[:, None, None]
        kv_mem = tl.sum(state * k[None, :, None], axis=1)            # [RB, BV]: what S predicts for k
        delta = beta[:, None] * (v - kv_mem)
        state = state + k[None, :, None] * delta[:, None, :]
        o = tl.sum(state * q[None, :, None], axis=1)
        tl.store(sp + soff, state, mask=smask)
        optr = o_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + rv[None, :]
        tl.store(optr, o.to(o_ptr.dtype.element_ty), mask=jmask[:, None] & (rv < DV)[None, :])


@triton.jit
def _prep_kernel(x_ptr, rows_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, conv_ptr, slots_ptr,
                 q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, stride_xt, stride_at, stride_bt, stride_g, stride_cs, stride_cc,
                 HAS_ROWS: tl.constexpr, HK: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, BK: tl.constexpr, BRV: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Row i, key head kh: the conv of its q, k and R heads' v channels (windows shifted in place), q and k
    L2-normed (q also scaled by Dk^-1/2), the R heads' g and beta, into the scratch [i, ...]."""
    enter(PDL)
    i = tl.program_id(0)
    kh = tl.program_id(1)
    row, slot = _row_slot(rows_ptr, slots_ptr, i, HAS_ROWS)
    x_row = x_ptr + row.to(tl.int64) * stride_xt
    conv_slot = conv_ptr + slot * stride_cs
    key_dim: tl.constexpr = HK * DK
    rk = tl.arange(0, BK)
    kmask = rk < DK
    f = tl.arange(0, BRV)
    fmask = f < R * DV
    vch = 2 * key_dim + kh * R * DV + f
    qy, qwin, ky, kwin = _qk_conv(x_row, w_ptr, conv_slot, stride_cc, kh, rk, kmask, key_dim, DK, K, KP)
    vy, vwin = _conv_step(x_row, w_ptr, conv_slot, stride_cc, vch, fmask, K, KP)
    tl.debug_barrier()  # every window is read before any is shifted
    q, k = _qk_store_and_norm(conv_slot, stride_cc, kh, rk, kmask, qy, qwin, ky, kwin, key_dim, DK, K, KP)
    _store_window(conv_slot, stride_cc, vch, fmask, vwin, K, KP)
    base = (i * HK + kh) * DK
    tl.store(q_ptr + base + rk, q, mask=kmask)
    tl.store(k_ptr + base + rk, k, mask=kmask)
    tl.store(v_ptr + (i * HK + kh) * R * DV + f, vy, mask=fmask)
    rj = tl.arange(0, RP)
    jmask = rj < R
    heads = kh * R + rj
    g, beta = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row, stride_at, stride_bt, stride_g, heads, jmask, R)
    tl.store(g_ptr + i * HK * R + heads, g, mask=jmask)
    tl.store(beta_ptr + i * HK * R + heads, beta, mask=jmask)


@triton.jit
def _block(rows_ptr, slots_ptr, ssm_ptr, stride_ss, HAS_ROWS: tl.constexpr, R: tl.constexpr, DK: tl.constexpr,
           DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A program of the (row, value head, column block) grid: its indices, its state block's pointers and mask."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    row, slot = _row_slot(rows_ptr, slots_ptr, i, HAS_ROWS)
    rk = tl.arange(0, BK)
    kmask = rk < DK
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = rv < DV
    sp = ssm_ptr + slot * stride_ss + (h * DK + rk[:, None]) * DV + rv[None, :]
    return i, h, row, slot, h // R, rk, kmask, rv, vmask, sp, kmask[:, None] & vmask[None, :]


@triton.jit
def _state_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ssm_ptr, slots_ptr, rows_ptr, o_ptr, z_ptr, nw_ptr, cnt_ptr,
                  stride_ss, stride_ot, stride_oh, stride_zt, stride_zh, eps, HAS_ROWS: tl.constexpr, HK: tl.constexpr,
                  R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  NORM: tl.constexpr = False, BD: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Row i, value head h, state columns [vb*BV, vb*BV + BV): the gated delta rule on that block, in place, and
    the output's columns. NORM: the last of the head's column blocks to finish (counted at cnt_ptr[i * HV + h],
    zero between calls) reads the head's whole output row back from L2 and stores RMSNorm(o) * w * SiLU(z) over it
    in its place (norm.gated_rows, the norm launch's arithmetic), then zeroes the count."""
    enter(PDL)
    i, h, row, slot, kh, rk, kmask, rv, vmask, sp, smask = _block(rows_ptr, slots_ptr, ssm_ptr, stride_ss, HAS_ROWS,
                                                                  R, DK, DV, BK, BV)
    q = tl.load(q_ptr + (i * HK + kh) * DK + rk, mask=kmask, other=0.0)
    k = tl.load(k_ptr + (i * HK + kh) * DK + rk, mask=kmask, other=0.0)
    v = tl.load(v_ptr + (i * HK * R + h) * DV + rv, mask=vmask, other=0.0)
    g = tl.load(g_ptr + i * HK * R + h)
    beta = tl.load(beta_ptr + i * HK * R + h)
    state = tl.load(sp, mask=smask, other=0.0)
    _update_block(state, q, k, v, g, beta, sp, smask, o_ptr, z_ptr, nw_ptr, cnt_ptr, i, h, row, rv, vmask,
                  stride_ot, stride_oh, stride_zt, stride_zh, eps, HK * R, DV, NORM, BD)


@triton.jit
def _update_block(state, q, k, v, g, beta, sp, smask, o_ptr, z_ptr, nw_ptr, cnt_ptr, i, h, row, rv, vmask,
                  stride_ot, stride_oh, stride_zt, stride_zh, eps, HV: tl.constexpr, DV: tl.constexpr,
                  NORM: tl.constexpr, BD: tl.constexpr):
    """The gated delta rule on a block of head h's state columns (state [Dk, BV] as loaded): the state stored back
    in place, the output's columns stored at token `row`, and with NORM the head's output norm by the last of its
    column blocks to finish (counted at cnt_ptr[i * HV + h], zero between calls)."""
    state = state * tl.exp(g)
    kv_mem = tl.sum(state * k[:, None], axis=0)  # [BV]: what the state predicts for k
    state = state + k[:, None] * (beta * (v - kv_mem))[None, :]
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(sp, state, mask=smask)
    o_row = o_ptr + row.to(tl.int64) * stride_ot + h * stride_oh
    tl.store(o_row + rv, o.to(o_ptr.dtype.element_ty), mask=vmask)
    if NORM:
        tl.debug_barrier()  # every thread's columns stored before the count's release
        cnt = cnt_ptr + i * HV + h
        if tl.atomic_add(cnt, 1, sem="acq_rel") == tl.num_programs(2) - 1:
            cols = tl.arange(0, BD)
            cmask = (cols < DV)[None, :]
            x = tl.load(o_row + cols[None, :], mask=cmask, other=0.0, cache_modifier=".cg")
            z = tl.load(z_ptr + row.to(tl.int64) * stride_zt + h * stride_zh + cols[None, :], mask=cmask, other=0.0)
            w = tl.load(nw_ptr + cols, mask=cols < DV, other=0.0)
            tl.store(o_row + cols[None, :], gated_rows(x, z, w, eps, DV).to(o_ptr.dtype.element_ty), mask=cmask)
            tl.atomic_xchg(cnt, 0)


@triton.jit
def _fold_kernel(x_ptr, rows_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, conv_ptr, ssm_ptr, slots_ptr, o_ptr, z_ptr,
                 nw_ptr, cnt_ptr, stride_xt, stride_at, stride_bt, stride_g, stride_cs, stride_cc, stride_ss,
                 stride_ot, stride_oh, stride_zt, stride_zh, eps, HAS_ROWS: tl.constexpr, HK: tl.constexpr,
                 R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr = False, BD: tl.constexpr = 1,
                 PDL: tl.constexpr = False):
    """The two launches in one, on _state_kernel's grid: row i, value head h, state columns [vb*BV, vb*BV + BV).
    Each program makes what _prep_kernel would have stored for it, the same arithmetic on the same channels: its
    key head's q and k (conv, SiLU, L2 norm), its own v columns' conv and its head's gates. A v channel has one
    program, which shifts its window itself; a key head's q and k windows are read by every program of the head's
    R value heads, so the last of those to finish reading (counted at cnt_ptr[n * HV + i * HK + kh], zero between
    calls) shifts them."""
    enter(PDL)
    i, h, row, slot, kh, rk, kmask, rv, vmask, sp, smask = _block(rows_ptr, slots_ptr, ssm_ptr, stride_ss, HAS_ROWS,
                                                                  R, DK, DV, BK, BV)
    state = tl.load(sp, mask=smask, other=0.0)  # the largest load first: its latency passes under the conv's
    x_row = x_ptr + row.to(tl.int64) * stride_xt
    conv_slot = conv_ptr + slot * stride_cs
    key_dim: tl.constexpr = HK * DK
    qy, qwin, ky, kwin = _qk_conv(x_row, w_ptr, conv_slot, stride_cc, kh, rk, kmask, key_dim, DK, K, KP)
    vch = 2 * key_dim + h * DV + rv
    v, vwin = _conv_step(x_row, w_ptr, conv_slot, stride_cc, vch, vmask, K, KP)
    one = tl.arange(0, 1)
    g1, beta1 = _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row, stride_at, stride_bt, stride_g, h + one, one < 1, R)
    g, beta = tl.sum(g1, 0), tl.sum(beta1, 0)
    q, k = _qk_norm(qy, ky, DK)
    tl.debug_barrier()  # every thread has read the windows before any is shifted, and before the count's release
    _store_window(conv_slot, stride_cc, vch, vmask, vwin, K, KP)
    cnt = cnt_ptr + tl.num_programs(0) * (HK * R) + i * HK + kh
    if tl.atomic_add(cnt, 1, sem="acq_rel") == R * tl.num_programs(2) - 1:
        _store_qk_windows(conv_slot, stride_cc, kh, rk, kmask, qwin, kwin, key_dim, DK, K, KP)
        tl.atomic_xchg(cnt, 0)
    _update_block(state, q, k, v, g, beta, sp, smask, o_ptr, z_ptr, nw_ptr, cnt_ptr, i, h, row, rv, vmask,
                  stride_ot, stride_oh, stride_zt, stride_zh, eps, HK * R, DV, NORM, BD)


# The two-launch path's state blocks: narrower columns until there are about this many programs.
SPLIT_V_PROGRAMS = 512


# The one-launch kernel: below this many programs (rows x key heads) a program loads all its R states at once (more
# bytes in flight where few SMs work); above, one head at a time (smaller tiles, more programs resident per SM).
WIDE_TILE_PROGRAMS = 264
# The default path (split_v=None): the two-launch kernels at every batch size, measured faster at B=1 and B=64.
TWO_LAUNCHES = True
# KTRANS_GDN_DECODE_FOLD=1 (off until timed on a GPU): the two-launch path's grid in one launch (_fold_kernel: each
# program makes the conv, norms and gates it needs itself, a key head's q and k in each of its R * Dv / BV programs),
# one launch a DeltaNet layer fewer; the same arithmetic as the two launches (bitwise under the interpreter; compiled,
# a tile of other shape may sum the conv's four products in another order).
FOLD = os.environ.get("KTRANS_GDN_DECODE_FOLD", "0") == "1"


def gated_delta_decode(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor,
                       ssm_pool: torch.Tensor, slots: torch.Tensor, num_k_heads: int, head_k_dim: int,
                       rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       heads_per_tile: int | None = None, split_v: bool | None = None,
                       norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                       fold: bool | None = None) -> torch.Tensor:
    """One decode token for each of B rows, updating the pools in place at `slots` [B] (int64, on the device).

    mixed [T, conv_dim]: q|k|v before the conv (token stride free); a, b [T, HV] raw gate inputs, or [T, HK, R]
    views into in_proj_ba's output as it groups them ([b | a] per key head: no copy to [T, HV]); rows [B] the
    token rows of the decode sequences (None: row i is token i, B = T). conv_weight [conv_dim, K];
    conv_pool [slots, conv_dim, K-1]; ssm_pool [slots, HV, Dk, Dv] float32 contiguous.
    Returns o [T, HV, Dv] in mixed's dtype (`out` when given), written at the decode rows only. heads_per_tile
    (1..R) overrides how many value heads' states a program holds at once, split_v whether the two-launch path
    runs (default: TWO_LAUNCHES); the tests run every shape.
    norm (z [T, HV, Dv] with a unit last stride, weight [Dv], eps): the output is the DeltaNet's gated output norm
    of o instead, RMSNorm(o) * weight * SiLU(z) per value head as norm.rms_norm_gated gives it for the decode rows
    (o rounded to the output's dtype first), made by the state launch's last program of each head (two launches,
    the norm's third folded in); the two-launch path only. fold: the two-launch path as one launch (_fold_kernel;
    default FOLD).
    """
    hv, dk, dv = ssm_pool.shape[1:]
    hk = num_k_heads
    conv_dim, width = conv_weight.shape
    if dk != head_k_dim or hv % hk or conv_dim != 2 * hk * dk + hv * dv or mixed.shape[1] != conv_dim:
        raise ValueError(f"shapes do not fit: mixed {tuple(mixed.shape)}, conv_weight {tuple(conv_weight.shape)}, "
                         f"ssm_pool {tuple(ssm_pool.shape)}, {hk} key heads of {head_k_dim}")
    if ssm_pool.dtype != torch.float32 or not ssm_pool.is_contiguous() or not conv_weight.is_contiguous():
        raise ValueError("ssm_pool must be contiguous float32 and conv_weight contiguous")
    if conv_pool.shape[1:] != (conv_dim, width - 1) or conv_pool.stride(2) != 1:
        raise ValueError(f"conv_pool must be [slots, {conv_dim}, {width - 1}], got {tuple(conv_pool.shape)}")
    for name, x in (("mixed", mixed), ("a", a), ("b", b)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if a.dim() == 3 and (a.shape[1:] != (hk, hv // hk) or b.shape != a.shape or a.stride(1) != b.stride(1)):
        raise ValueError(f"a and b as key-head groups must be [T, {hk}, {hv // hk}] of one layout, got "
                         f"{tuple(a.shape)} / {tuple(b.shape)}")
    stride_g = a.stride(1) if a.dim() == 3 else hv // hk
    n = slots.shape[0]
    two = split_v if split_v is not None else TWO_LAUNCHES
    if norm is not None:
        z, nw, eps = norm
        if not two:
            raise ValueError("gated_delta_decode: the fused output norm is the two-launch path's (split_v)")
        if z.shape != (mixed.shape[0], hv, dv) or z.stride(-1) != 1 or nw.shape != (dv,):
            raise ValueError(f"gated_delta_decode: the norm's z {tuple(z.shape)} (unit last stride) and weight "
                             f"{tuple(nw.shape)} must be [{mixed.shape[0]}, {hv}, {dv}] and [{dv}]")
    if fold and not two:
        raise ValueError("gated_delta_decode: the folded launch is the two-launch path's (split_v)")
    fold = two and (fold if fold is not None else FOLD)
    counted = norm is not None or fold  # last-program counts in quant.counters
    if counted and n * (hv + hk) > _MAX_TILES:
        raise ValueError(f"gated_delta_decode: {n} rows of {hv} value and {hk} key heads are more than the "
                         f"{_MAX_TILES} counts of the fused norm and the folded launch")
    out = mixed.new_empty(mixed.shape[0], hv, dv) if out is None else out
    if n == 0:
        return out
    r = hv // hk
    bv = triton.next_power_of_2(dv)
    block = bv
    while block > 16 and n * hv * triton.cdiv(dv, block) < SPLIT_V_PROGRAMS:
        block //= 2
    if norm is None:
        z, nw, eps, zs = out, out, 0.0, (0, 0)
    else:
        zs = (z.stride(0), z.stride(1))
    cnt = counters(mixed.device) if counted else slots  # (unread without counts: any pointer)
    idx = rows if rows is not None else slots
    if fold:
        _fold_kernel[(n, hv, triton.cdiv(dv, block))](
            mixed, idx, a, b, A_log, dt_bias, conv_weight, conv_pool, ssm_pool, slots, out, z, nw, cnt,
            mixed.stride(0), a.stride(0), b.stride(0), stride_g, conv_pool.stride(0), conv_pool.stride(1),
            ssm_pool.stride(0), out.stride(0), out.stride(1), *zs, eps, HAS_ROWS=rows is not None, HK=hk, R=r,
            DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block, K=width, KP=triton.next_power_of_2(width),
            NORM=norm is not None, BD=bv, num_warps=4, **launch())
        return out
    if two:
        f32 = dict(dtype=torch.float32, device=mixed.device)
        q, k = torch.empty(n, hk, dk, **f32), torch.empty(n, hk, dk, **f32)
        v, g, beta = torch.empty(n, hv, dv, **f32), torch.empty(n, hv, **f32), torch.empty(n, hv, **f32)
        _prep_kernel[(n, hk)](
            mixed, idx, a, b, A_log, dt_bias, conv_weight, conv_pool, slots, q, k, v, g, beta,
            mixed.stride(0), a.stride(0), b.stride(0), stride_g, conv_pool.stride(0), conv_pool.stride(1),
            HAS_ROWS=rows is not None, HK=hk, R=r, RP=triton.next_power_of_2(r), DK=dk, DV=dv,
            BK=triton.next_power_of_2(dk), BRV=triton.next_power_of_2(r * dv), K=width,
            KP=triton.next_power_of_2(width), num_warps=4, **launch())
        _state_kernel[(n, hv, triton.cdiv(dv, block))](
            q, k, v, g, beta, ssm_pool, slots, idx, out, z, nw, cnt, ssm_pool.stride(0), out.stride(0),
            out.stride(1), *zs, eps, HAS_ROWS=rows is not None, HK=hk, R=r, DK=dk, DV=dv,
            BK=triton.next_power_of_2(dk), BV=block, NORM=norm is not None, BD=bv, num_warps=4, **launch())
        return out
    rb = heads_per_tile or (r if n * hk < WIDE_TILE_PROGRAMS else 1)
    rb = triton.next_power_of_2(min(rb, r))
    tile = rb * triton.next_power_of_2(dk) * bv
    _decode_kernel[(n, hk)](
        mixed, rows if rows is not None else slots, a, b, A_log, dt_bias, conv_weight, conv_pool, ssm_pool, slots,
        out, mixed.stride(0), a.stride(0), b.stride(0), stride_g, conv_pool.stride(0), conv_pool.stride(1),
        ssm_pool.stride(0), out.stride(0), out.stride(1),
        HAS_ROWS=rows is not None, HK=hk, R=r, RB=rb, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
        K=width, KP=triton.next_power_of_2(width), num_warps=max(4, min(16, tile // 2048)), **launch())
    return out
