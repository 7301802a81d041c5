"""The CPU experts' hand-off on the GPU's stream in two launches, reading and writing the pinned staging in place.

The stream path (ktrans.kernels.cpu_stream) moves one MoE layer's inputs to the host and its output back around the
pool's submit and wait. With torch ops that is six operations a layer on the stream: the activations cast to fp32,
three device-to-host copies (x, ids, weights), then a host-to-device copy of the fp32 output and its cast to the
model's dtype. Pinned host memory is mapped into the GPU's address space (unified addressing), so a kernel can load
and store it directly:

- `stage_in`: one launch writes x (cast to fp32), the expert ids (int64) and the routing weights (fp32) of every
  row into the staging, before the pool's submit;
- `stage_out`: one launch, after the pool's wait, reads the fp32 output rows from the staging and stores them in the
  model's dtype on the device.

Ordering is the stream's: a host function runs after the kernels before it have completed, and their stores to host
memory are visible then; a kernel after a host function starts once that function returns.

The flag path (ktrans.kernels.cpu_stream.FLAGS, the default) has no host function. `stage_in` ends by ringing: each
program's threads store, meet at a barrier, and add one to a device counter with an acq_rel atomic at system scope;
the program that finds itself last has acquired every other program's release, and stores ++seq into the pinned
`go` cell after them (a plain store: what the H200 runs shows it ordered; PCIe has no host atomics to do it with).
The relay thread of ktrans._cpu sees the number, runs the layer and stores it into `done` after the output rows
(x86 keeps stores in order). `cpu_wait`, one program, polls `done` with volatile (relaxed, system-scope) loads
until it holds seq, or gives up after MAX_POLLS and says so in the flags; `stage_out` (or the MoE block's gated sum)
then reads the rows with volatile loads, past any cache that could hold an older copy. Both kernels read their
sizes from their arguments only, so a CUDA graph captures them. The oracle is the torch copies they replace
(ktrans.kernels.torch.stage), which stay the path wherever the staging is not pinned.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter, launch
from ktrans.kernels.triton.router import topk_softmax_row

BLOCK = 1024  # elements of a row per program


@triton.jit
def _stage_in_kernel(x_ptr, ids_ptr, w_ptr, sx_ptr, sids_ptr, sw_ptr, T, H, K, stride_x, stride_ids, stride_w,
                     ring_ptr, flags_ptr, BLOCK: tl.constexpr, BK: tl.constexpr, RING: tl.constexpr,
                     PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    live = _stage_x(x_ptr, sx_ptr, row, blk, T, H, stride_x, BLOCK)
    if blk == 0:
        j = tl.arange(0, BK)
        mk = j < K * live
        ids = tl.load(ids_ptr + row * stride_ids + j, mask=mk, other=0)
        tl.store(sids_ptr + row * K + j, ids.to(tl.int64), mask=mk)
        w = tl.load(w_ptr + row * stride_w + j, mask=mk, other=0.0)
        tl.store(sw_ptr + row * K + j, w.to(tl.float32), mask=mk)
    if RING:
        _ring(ring_ptr, flags_ptr)


@triton.jit
def _stage_x(x_ptr, sx_ptr, row, blk, T, H, stride_x, BLOCK: tl.constexpr):
    """Block blk of activation row `row` into the staging as fp32; returns 1 where the row is live (row < T), else 0
    (T = 0: the flag path's one program only rings)."""
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    live = (row < T).to(tl.int32)
    m = offs < H * live
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    tl.store(sx_ptr + row * H + offs, x.to(tl.float32), mask=m)
    return live


@triton.jit
def _ring(ring_ptr, flags_ptr):
    """The last program to finish rings: go = ++seq, after every program's stores (see the module doc)."""
    tl.debug_barrier()  # this program's threads' stores before its release
    arrived = tl.atomic_add(ring_ptr, 1, sem="acq_rel", scope="sys")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(ring_ptr, 0)
        seq = tl.load(ring_ptr + 1) + 1
        tl.store(ring_ptr + 1, seq)
        tl.store(flags_ptr, seq)


@triton.jit
def _route_stage_kernel(x_ptr, l_ptr, sx_ptr, sids_ptr, sw_ptr, T, H, n_experts, stride_x, stride_l, ring_ptr,
                        flags_ptr, BLOCK: tl.constexpr, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        RENORM: tl.constexpr, PDL: tl.constexpr = False):
    """stage_in with the router's top-k in its first program of each row (the flag path only: it rings)."""
    enter(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    _stage_x(x_ptr, sx_ptr, row, blk, T, H, stride_x, BLOCK)
    if blk == 0:
        if row < T:
            ks, ids, w = topk_softmax_row(l_ptr + row * stride_l, n_experts, K, E_PAD, K_PAD, RENORM)
            mk = ks < K
            tl.store(sids_ptr + row * K + ks, ids.to(tl.int64), mask=mk)
            # rounded to the logits' dtype first, as route() returns them: the same weights as the two launches
            tl.store(sw_ptr + row * K + ks, w.to(l_ptr.dtype.element_ty).to(tl.float32), mask=mk)
    _ring(ring_ptr, flags_ptr)


@triton.jit
def _cpu_wait_kernel(ring_ptr, flags_ptr, MAX_POLLS: tl.constexpr, PDL: tl.constexpr = False):
    """Poll done (flags[1]) until it holds this call's sequence number; past MAX_POLLS give up and say so in
    flags[2] (the host raises at its next check). One program: the stream's next kernels start when it ends."""
    enter(PDL)
    seq = tl.load(ring_ptr + 1)
    done = tl.load(flags_ptr + 1, volatile=True)
    polls = 0
    while (done != seq) & (polls < MAX_POLLS):
        done = tl.load(flags_ptr + 1, volatile=True)
        polls += 1
    if done != seq:
        tl.store(flags_ptr + 2, seq)


@triton.jit
def _stage_out_kernel(src_ptr, dst_ptr, H, BLOCK: tl.constexpr, BF16: tl.constexpr, VOLATILE: tl.constexpr,
                      PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    # the flag path: rows the CPU wrote while this stream polled, with no host function between (read past caches)
    v = tl.load(src_ptr + row * H + offs, mask=m, other=0.0, volatile=VOLATILE)
    if BF16:  # rounded to nearest even by hand, as torch's cast does (Triton's interpreter does not)
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        tl.store(dst_ptr + row * H + offs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
    else:
        tl.store(dst_ptr + row * H + offs, v.to(dst_ptr.dtype.element_ty), mask=m)


def _check_staging(name: str, misfit: bool, t: int, h: int, k: int, sx: torch.Tensor, sids: torch.Tensor,
                   sw: torch.Tensor, inputs: str) -> None:
    """ValueError unless T rows of hidden size h and top-k k fit the staging (sx, sids, sw) and the inputs fit each
    other (`misfit` False), and the staging is fp32 x, int64 ids, fp32 weights."""
    if misfit or sx.shape[1] != h or sids.shape[1] != k or sw.shape[1] != k \
            or min(sx.shape[0], sids.shape[0], sw.shape[0]) < t:
        raise ValueError(f"{name}: {inputs} do not fit the staging {tuple(sx.shape)}, {tuple(sids.shape)}, "
                         f"{tuple(sw.shape)}")
    if sx.dtype != torch.float32 or sids.dtype != torch.int64 or sw.dtype != torch.float32:
        raise ValueError(f"{name}: the staging is fp32 x, int64 ids, fp32 weights")


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def stage_in(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, sx: torch.Tensor, sids: torch.Tensor,
             sw: torch.Tensor, ring: torch.Tensor | None = None, flags: torch.Tensor | None = None) -> None:
    """x [T, H] (any float dtype), ids [T, K] (integers), weights [T, K] -> the staging's first T rows: sx [>= T, H]
    fp32, sids [>= T, K] int64, sw [>= T, K] fp32 (contiguous). With `ring` ([arrived, seq] int64 on x's device,
    zeros at first) and `flags` ([go, done, timed out] int64, pinned), the flag path: the launch ends by storing
    ++seq into go, T = 0 included (the relay then serves an empty call, and the wait still ends)."""
    t, h = x.shape
    k = ids.shape[1]
    _check_staging("stage_in", ids.shape != (t, k) or weights.shape != (t, k), t, h, k, sx, sids, sw,
                   f"x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    if (ring is None) != (flags is None):
        raise ValueError("stage_in: the flag path takes both ring and flags")
    if not t and ring is None:
        return
    x, ids, weights = _rows_of(x), _rows_of(ids), _rows_of(weights)
    _stage_in_kernel[(max(t, 1), triton.cdiv(h, BLOCK))](
        x, ids, weights, sx, sids, sw, t, h, k, x.stride(0), ids.stride(0), weights.stride(0),
        sx if ring is None else ring, sx if flags is None else flags, BLOCK=BLOCK, BK=triton.next_power_of_2(k),
        RING=ring is not None, **launch())


def route_stage_in(x: torch.Tensor, logits: torch.Tensor, top_k: int, renorm: bool, sx: torch.Tensor,
                   sids: torch.Tensor, sw: torch.Tensor, ring: torch.Tensor, flags: torch.Tensor) -> None:
    """The router's top-k (ktrans.kernels.triton.router.route on `logits` [T, E]) and stage_in of x [T, H] and
    those ids and weights, on the flag path, in one launch: the ids and weights go straight into the pinned staging
    (the GPU never holds them), bitwise what route() then stage_in() write."""
    t, h = x.shape
    e = logits.shape[1]
    _check_staging("route_stage_in", logits.shape[0] != t, t, h, top_k, sx, sids, sw,
                   f"x {tuple(x.shape)}, logits {tuple(logits.shape)}, top-{top_k}")
    x, logits = _rows_of(x), _rows_of(logits)
    _route_stage_kernel[(max(t, 1), triton.cdiv(h, BLOCK))](
        x, logits, sx, sids, sw, t, h, e, x.stride(0), logits.stride(0), ring, flags, BLOCK=BLOCK, K=top_k,
        E_PAD=triton.next_power_of_2(e), K_PAD=triton.next_power_of_2(top_k), RENORM=renorm, **launch())


MAX_POLLS = 1 << 26  # the wait's give-up: ~1 min of ~1 us reads over PCIe, far beyond any layer's CPU share


def cpu_wait(ring: torch.Tensor, flags: torch.Tensor) -> None:
    """On the current stream: wait until the relay has stored this call's sequence number (ring[1], set by the
    call's stage_in) into done (flags[1])."""
    _cpu_wait_kernel[(1,)](ring, flags, MAX_POLLS=MAX_POLLS, **launch())


def stage_out(src: torch.Tensor, rows: int, device: torch.device, dtype: torch.dtype,
              flagged: bool = False) -> torch.Tensor:
    """The staging's first `rows` output rows (src [>= rows, H] fp32) as a new [rows, H] tensor on `device`;
    `flagged`: after a cpu_wait (volatile loads)."""
    h = src.shape[1]
    out = torch.empty(rows, h, dtype=dtype, device=device)
    if rows:
        _stage_out_kernel[(rows, triton.cdiv(h, BLOCK))](src, out, h, BLOCK=BLOCK, BF16=dtype == torch.bfloat16,
                                                         VOLATILE=flagged, **launch())
    return out
