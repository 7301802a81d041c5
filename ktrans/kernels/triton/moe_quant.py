"""The routed experts of one MoE layer on GGUF-quantized weights (the packed layout of
ktrans.kernels.triton.quant_layout), in Triton:

    out[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t, j]

Two grouped kernel launches over the layer's (token, slot) pairs: gate and up as one [E, 2I, H] stack with SiLU*mul
in the epilogue (h [T*k, I]), then down with the routing weight in the epilogue (y [T*k, H] fp32); a sum over the k
slots gives out. Each program takes one block of pairs routed to one expert and one tile of output columns, and
decodes that expert's super-blocks as the dense kernel does (ktrans.kernels.triton.quant.superblock_dot).

How pairs become blocks:
- few tokens (decode): one pair per block, in routing order, the block's expert read from the ids on the device;
- more: pairs sorted by expert and each expert's run padded to the block height (moe_align, with torch ops on the
  device: argsort, a scatter-add count, cumsums, searchsorted). The grid is the bound cdiv(T*k, BM) + E blocks;
  blocks past the last expert's run exit at once.
Neither reads the routing back to the host and every buffer's size follows from T alone, so a decode step with the
layer can be captured in a CUDA graph. The oracle is ktrans.kernels.torch.moe.moe_experts on dequantized weights.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton import interpreting, quant_gemv_reg
from ktrans.kernels.triton.pdl import enter, launch
from ktrans.kernels.triton.planes import expert_planes
from ktrans.kernels.triton.quant import (_MAX_TILES, GEMV, MAXNREG_TYPES, MMA_TYPES, QT_CODE, _scale_words, _sms,
                                         counters, env_ints, gemv_rows, pipe_per_sm, plane_args, plane_offsets,
                                         superblock_dot, tiles)
from ktrans.kernels.triton.quant_gemv import row_dot
from ktrans.kernels.triton.quant_layout import QK, PackedWeight

# The few-token path through the one-row GEMV's lane-wise decoding (ktrans.kernels.triton.
# quant_gemv: codes made floats through the mantissa, one reduction per program) instead of the tile path's per-
# sub-block reductions, in two launches (gate/up split over K, down with the top-k sum) instead of ~7. On the H200
# (doc/benchmarks.md, session 13) its first form, without the split and the fused sums, took one 80B layer at B=1 in
# 53.8 us against the tile path's 87.9; with them (session 14) 26.9 us against 88.0, 28.2 against 87.0 with the Q6_K
# down projection, and its CUDA-graph test passed there. On by default since; KTRANS_MOE_LANES=0: the tile path.
# max_tokens: the largest step it takes. Measured on the H200 (`bench kernels`, session 16, one 80B layer): 70.5 /
# 119.3 / 198.0 / 361.0 / 688.0 us at 4 / 8 / 16 / 32 / 64 tokens against the tile path's 228.8 / 390.6 / 624.4 /
# 917.2 / 1,298.8 (which pads each expert's one or two pairs to a 16-row block), so decode steps of up to 64 tokens
# take it; at full size the 16-request decode step went from 375 to 709 tok/s with it.
DIRECT_MAX_TOKENS = 4  # the tile path: up to this many tokens, one pair per block (no sort)
# maxnreg: the register caps of the gate/up and the down launch (0: the compiler's choice), as the one-row GEMV's
# (quant.GEMV["maxnreg"]), for the types and form it was timed at (quant.MAXNREG_TYPES, lane groups). 80 for both
# since session 23 (H200, doc/benchmarks.md): `bench kernels` one 80B layer at B=1 26.45 -> 25.06 us (Q4_K), 29.01 ->
# 25.79 us (Q6_K down), B=4..64 within 1% or better; all-GPU decode at batch 1 205.0 -> 217.6 tok/s (two runs each,
# alternating). Compiled for sm_90 (Triton 3.9) the gate/up launch takes 104 registers uncapped (80 spills 40 B) and
# the down launch 96 (80 without spills). KTRANS_MOE_LANES_MAXNREG=96,80 sets each, 80 one for both, 0 none.
_CAPS = [int(v) for v in (os.environ.get("KTRANS_MOE_LANES_MAXNREG") or "80").split(",") if v.strip()] or [0]
# pipe: gate and up's super-block loops pipelined (quant_gemv.row_dot PIPE, its stages; 0: plain loops), with
# per_sm_pipe programs wanted per SM then (fewer K splits, longer loops), and one_loop: gate's and up's rows in one
# loop (_moe_lanes_kernel ONE_LOOP); KTRANS_MOE_LANES_PIPE=S[,PER_SM[,ONE_LOOP]]. Off: no gain on the H100 (session 31,
# moe_sweep, one 80B layer at B=1: 25.6 us plain, 26.6 pipelined, 27.2 in one loop at 8 warps).
_PIPE = env_ints("KTRANS_MOE_LANES_PIPE", [0, 2, 0])
# mma: gate/up and down through the tensor-core row_dot (quant_gemv_mma.row_dot_mma; Q4_K and Q6_K, bf16 x), mma_bn rows
# and 4 warps a program, mma_per_sm programs wanted an SM for gate/up's K split. KTRANS_MOE_LANES_MMA=ON[,BN[,PER_SM]].
_MMA = env_ints("KTRANS_MOE_LANES_MMA", [0, 64, 2])
# reg: gate/up and down through the register tensor-core body (quant_gemv_reg.moe_reg_kernel, Gluon; Q4_K and Q6_K,
# bf16 x; a launch of another type keeps the lanes kernel), reg_bn rows and reg_warps warps a program, reg_per_sm
# programs wanted an SM for gate/up's K split, reg_chains its dots' independent mma chains (quant.GEMV's, untimed).
# KTRANS_MOE_LANES_REG=ON[,BN[,WARPS[,PER_SM[,CHAINS]]]]; 0 turns it off. On by default since session 34:
# on the H100 (moe_sweep, one 80B layer, Q4_K down; 128 rows, 4 warps, 4 programs an SM) B=1 25.1 us against the
# lanes kernel's 25.4, B=2 34.5 / 38.7, B=4 53.9 / 59.7, B=8 83.5 / 105.9, B=16 140.5 / 185.4, B=32 244.9 / 345.0,
# B=64 430.0 / 664.8; Q6_K down B=1 27.6 / 27.2, B=16 173.9 / 196.0, B=64 558.5 / 705.8. The whole model on the
# gpu rules matches the reference ops under it (tests/operators/test_gpu_quant_rules.py, 18 passed there). A shared
# cp.async ring of 2 super-blocks for the Q4_K launches bought nothing (B=16 139.4, B=64 424.0) and was removed.
_REG = env_ints("KTRANS_MOE_LANES_REG", [1, 128, 4, 4, 1])
LANES = {"on": os.environ.get("KTRANS_MOE_LANES", "1") == "1", "max_tokens": 64,
         "bn": 32, "warps": 4, "per_sm": 4, "split": None,  # split: K splits of gate/up (None: auto)
         "maxnreg": (_CAPS[0], _CAPS[-1]), "pipe": _PIPE[0], "per_sm_pipe": _PIPE[1],
         "one_loop": bool(_PIPE[2]), "mma": _MMA[0], "mma_bn": _MMA[1], "mma_per_sm": _MMA[2],
         "reg": _REG[0], "reg_bn": _REG[1], "reg_warps": _REG[2], "reg_per_sm": _REG[3], "reg_chains": _REG[4]}


@triton.jit
def _moe_kernel(x_ptr, out_ptr, rows_ptr, bexp_ptr, rw_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, s_lo, s_hi, s_d, s_sc,
                P, N, N_ROWS, NSB, X_DIV, stride_x, stride_o, QT: tl.constexpr, MODE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, GATED: tl.constexpr):
    """One block of BM pairs (rows_ptr: pair ids, P where padded) on expert bexp_ptr[block] (< 0: no work) times
    output columns pid_n*BN..; GATED: columns n of gate and N + n of up -> silu(g) * u; else times the pair's
    routing weight."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e >= 0:
        pairs = tl.load(rows_ptr + pid_b * BM + tl.arange(0, BM))
        mask_m = pairs < P
        tok = tl.where(mask_m, pairs // X_DIV, 0)
        e64 = e.to(tl.int64)
        lo, hi, d, sc = lo_ptr + e64 * s_lo, hi_ptr + e64 * s_hi, d_ptr + e64 * s_d, sc_ptr + e64 * s_sc
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if GATED:
            acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for sb in range(NSB):
            acc = superblock_dot(acc, x_ptr, tok, mask_m, stride_x, lo, hi, d, sc, sb, N_ROWS, offs_n, mask_n,
                                 QT, MODE)
            if GATED:
                acc_u = superblock_dot(acc_u, x_ptr, tok, mask_m, stride_x, lo, hi, d, sc, sb, N_ROWS, offs_n + N,
                                       mask_n, QT, MODE)
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        else:
            acc = acc * tl.load(rw_ptr + tl.where(mask_m, pairs, 0), mask=mask_m, other=0.0).to(tl.float32)[:, None]
        ptrs = out_ptr + tl.where(mask_m, pairs, 0)[:, None] * stride_o + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["x_lo", "x_hi", "x_d", "x_sc"])
def _moe_lanes_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, ids_ptr, rw_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, s_lo, s_hi,
                      s_d, s_sc, P, N, N_ROWS, NSB, SB_PER, X_DIV, stride_x, stride_o, E_X, x_lo, x_hi, x_d, x_sc,
                      QT: tl.constexpr, BN: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_X: tl.constexpr, ROWS: tl.constexpr = 0, PDL: tl.constexpr = False,
                      PIPE: tl.constexpr = 0, ONE_LOOP: tl.constexpr = False, MMA: tl.constexpr = 0):
    """Pair pid_p (token pid_p // X_DIV, expert ids[pid_p], skipped when negative) times output columns pid_n*BN..,
    lane-wise; sc_ptr: the scale plane as int32 words (s_sc in words).
    GATED (gate and up): super-blocks pid_k*SB_PER.. of K; with SPLIT > 1 the fp32 partials go to part_ptr [SPLIT,
    P, 2N] and the last of the pair's and tile's programs to finish (counted in cnt_ptr, zero between calls) sums
    them in split order; silu(gate) * up into out_ptr [P, N].
    Else (down, whole K): the pair's weighted row into part_ptr [P, N] fp32, and the last of a token's X_DIV pairs
    (skipped ones count, as zero rows) sums them in slot order into out_ptr [tokens, N]: no sum kernel after it.
    HAS_X: pairs whose id is E_X take an extra expert's planes (the shared expert), at element offsets x_lo, x_hi,
    x_d, x_sc from the stack's planes (they need not lie in the stack: the offsets are taken as they come).
    ROWS: row_dot's (the row-owning form where > 0). PIPE: row_dot's pipelined loop for gate and up (0: none).
    ONE_LOOP: gate's and up's rows of the tile as one [2 BN] tile in one row_dot loop (each row's arithmetic as in
    two loops), so a pipelined loop keeps both rows' next super-blocks in flight, and fills once, not twice.
    MMA: row_dot's tensor-core body."""
    enter(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(ids_ptr + pid_p)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    lo, hi, d, sc = expert_planes(e, lo_ptr, hi_ptr, d_ptr, sc_ptr, s_lo, s_hi, s_d, s_sc, E_X, x_lo, x_hi, x_d, x_sc,
                                  HAS_X)
    if GATED:
        if e >= 0:
            x_row = x_ptr + (pid_p // X_DIV) * stride_x
            sb0 = pid_k * SB_PER
            sb1 = tl.minimum(sb0 + SB_PER, NSB)
            if ONE_LOOP:
                i = tl.arange(0, 2 * BN)
                both = pid_n * BN + i % BN
                gu = row_dot(x_row, lo, hi, d, sc, N_ROWS, sb0, sb1, both + (i // BN) * N, both < N, QT, 2 * BN,
                             ROWS, False, PIPE)
                gate, up = tl.split(tl.permute(tl.reshape(gu, [2, BN]), [1, 0]))
            else:
                gate = row_dot(x_row, lo, hi, d, sc, N_ROWS, sb0, sb1, offs_n, mask_n, QT, BN, ROWS, False, PIPE,
                               MMA)
                up = row_dot(x_row, lo, hi, d, sc, N_ROWS, sb0, sb1, offs_n + N, mask_n, QT, BN, ROWS, False, PIPE,
                             MMA)
            if SPLIT == 1:
                h = gate / (1.0 + tl.exp(-gate)) * up
                tl.store(out_ptr + pid_p * stride_o + offs_n, h.to(out_ptr.dtype.element_ty), mask=mask_n)
            else:
                part = part_ptr + (pid_k * P + pid_p) * 2 * N
                tl.store(part + offs_n, gate, mask=mask_n)
                tl.store(part + N + offs_n, up, mask=mask_n)
                tl.debug_barrier()  # every thread's partial stored before the count's release
                cnt = cnt_ptr + pid_p * tl.num_programs(1) + pid_n
                if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
                    gate = tl.zeros([BN], dtype=tl.float32)
                    up = tl.zeros([BN], dtype=tl.float32)
                    for s in range(SPLIT):
                        part = part_ptr + (s * P + pid_p) * 2 * N
                        gate += tl.load(part + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg")
                        up += tl.load(part + N + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg")
                    h = gate / (1.0 + tl.exp(-gate)) * up
                    tl.store(out_ptr + pid_p * stride_o + offs_n, h.to(out_ptr.dtype.element_ty), mask=mask_n)
                    tl.atomic_xchg(cnt, 0)
    else:
        acc = tl.zeros([BN], dtype=tl.float32)
        if e >= 0:
            acc = row_dot(x_ptr + pid_p * stride_x, lo, hi, d, sc, N_ROWS, 0, NSB, offs_n, mask_n, QT, BN, ROWS,
                          False, 0, MMA)
            acc = acc * tl.load(rw_ptr + pid_p).to(tl.float32)
        tl.store(part_ptr + pid_p * N + offs_n, acc, mask=mask_n)
        tl.debug_barrier()
        tok = pid_p // X_DIV
        cnt = cnt_ptr + tok * tl.num_programs(1) + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel") == X_DIV - 1:
            total = tl.zeros([BN], dtype=tl.float32)
            for j in range(X_DIV):
                total += tl.load(part_ptr + (tok * X_DIV + j) * N + offs_n, mask=mask_n, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + tok * stride_o + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(cnt, 0)


def _lanes_cap(j: int, qtype: str, rows: bool) -> dict:
    """The lanes path's launch option for launch j (0 gate/up, 1 down): LANES' register cap where one is set and the
    launch is a lane-group one of a type the cap was timed at; nothing otherwise."""
    cap = LANES["maxnreg"][j]
    return {"maxnreg": cap} if cap and not rows and qtype in MAXNREG_TYPES else {}


def _expert_strides(planes) -> list[int]:
    """Each plane's stride from one expert to the next (0 for a one-element stand-in plane)."""
    return [t.stride(0) if t.numel() > 1 else 0 for t in planes]


def _reg_launch(j, w, src, dst, part, cnt, ids, rw, p, n, x_div, grid_k, sb_per, gated, e_x, extra, bn) -> None:
    """Launch j of the lanes path (0 gate/up, 1 down) by quant_gemv_reg.moe_reg_kernel: the planes as plane_args
    gives them (the scale plane as bytes), their expert strides and the extra expert's offsets in elements."""
    warps = LANES["reg_warps"]
    if w.n * (w.k // QK) * 32 >= 2 ** 31:  # row_sums' plane offsets within an expert are int32
        raise ValueError(f"moe_quant: an expert's [{w.n}, {w.k}] overflows the register kernel's int32 offsets")
    planes = plane_args(w)
    strides = _expert_strides(planes)
    consts = quant_gemv_reg.tiling("KTRANS_MOE_LANES_REG", bn, warps)
    offs = plane_offsets(planes, plane_args(extra[j])) if extra is not None else [0, 0, 0, 0]
    quant_gemv_reg.moe_reg_kernel[(p, triton.cdiv(n, bn), grid_k)](
        src, dst, part, cnt, ids, rw, *planes, *strides, p, n, w.n, w.k // QK,
        sb_per if gated else 1, x_div, src.stride(0), dst.stride(0), e_x, *offs, QT=QT_CODE[w.qtype], GATED=gated,
        SPLIT=grid_k, HAS_X=extra is not None, CH=LANES["reg_chains"], num_warps=warps, **consts, **launch())


def _lanes(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, gate_up: PackedWeight,
           down: PackedWeight, extra: tuple[PackedWeight, PackedWeight] | None = None) -> torch.Tensor:
    """The few-token path: two launches (gate and up split over K where the pairs alone would not fill the GPU;
    down with the sum over the top-k), the sums in fixed order (ktrans.kernels.triton.quant_gemv's fused sum).
    extra: (gate_up, down) of one more expert, taken by pairs whose id is gate_up.experts."""
    t, k = ids.shape
    p, inter, hidden = t * k, gate_up.n // 2, down.n
    ids = ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    h = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    # per launch: the tensor-core row_dot (LANES["mma"]; bf16 x, MMA_TYPES), the lane-group one (rows 0) or the
    # row-owning one (GEMV["rows"]; bf16 x, K-quant types)
    reg = [bool(LANES["reg"]) and quant_gemv_reg.applies(x, w.qtype) for w in (gate_up, down)]
    mma = [int(LANES["mma"]) if w.qtype in MMA_TYPES and x.dtype == torch.bfloat16 and not r else 0
           for w, r in zip((gate_up, down), reg)]
    rows = [0 if mma[0] or reg[0] else gemv_rows(x, gate_up.qtype), 0 if mma[1] or reg[1] else gemv_rows(h, down.qtype)]
    bns = [LANES["reg_bn"] if g else LANES["mma_bn"] if m else GEMV["rows_bn"] if r else
           LANES["bn"] * (2 if interpreting() else 1) for g, m, r in zip(reg, mma, rows)]
    tiles_i, tiles_h = triton.cdiv(inter, bns[0]), triton.cdiv(hidden, bns[1])
    nsb = gate_up.k // QK
    pipe, per_sm = pipe_per_sm(LANES, rows[0])
    if mma[0]:
        pipe, per_sm = 0, LANES["mma_per_sm"]
    if reg[0]:
        pipe, per_sm = 0, LANES["reg_per_sm"]
    split = LANES["split"] or max(1, min(nsb, triton.cdiv(per_sm * _sms(x.device), p * tiles_i)))
    sb_per = triton.cdiv(nsb, split)
    split = triton.cdiv(nsb, sb_per)
    if max(p * tiles_i, t * tiles_h) > _MAX_TILES:
        raise ValueError(f"moe_quant: {p} pairs are too many for the few-token path")
    cnt = counters(x.device)
    part = torch.empty(max(split * p * 2 * inter if split > 1 else 0, p * hidden), dtype=torch.float32,
                       device=x.device)
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    for j, (w, src, dst, n, x_div, grid_k, gated) in enumerate(((gate_up, x, h, inter, k, split, True),
                                                               (down, h, out, hidden, k, 1, False))):
        if reg[j]:
            _reg_launch(j, w, src, dst, part, cnt, ids, rw, p, n, x_div, grid_k, sb_per, gated, gate_up.experts,
                        extra, bns[j])
            continue
        lo, hi, d, _ = plane_args(w)
        planes = (lo, hi, d, _scale_words(w))
        offs = [0, 0, 0, 0]
        if extra is not None:
            xw = extra[j]
            xlo, xhi, xd, _ = plane_args(xw)
            offs = plane_offsets(planes, (xlo, xhi, xd, _scale_words(xw)))
        _moe_lanes_kernel[(p, triton.cdiv(n, bns[j]), grid_k)](
            src, dst, part, cnt, ids, rw, *planes, *_expert_strides(planes), p, n, w.n, w.k // QK,
            sb_per if gated else 1, x_div, src.stride(0), dst.stride(0), gate_up.experts, *offs, QT=QT_CODE[w.qtype],
            BN=bns[j], GATED=gated, SPLIT=grid_k, HAS_X=extra is not None, ROWS=rows[j], PIPE=pipe if gated else 0,
            ONE_LOOP=gated and LANES["one_loop"] and not rows[j] and not mma[j], MMA=mma[j],
            num_warps=4 if mma[j] else GEMV["rows_warps"] if rows[j] else LANES["warps"],
            **({} if mma[j] else _lanes_cap(j, w.qtype, rows[j])), **launch())
    return out


def align(ids: torch.Tensor, n_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block experts) for pairs sorted by expert in runs padded to bm: rows [n_blocks * bm] pair ids (P
    where padded), block experts [n_blocks] (-1 past the last run). Device ops only; sizes from len(ids) alone."""
    p = ids.numel()
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    valid = flat >= 0
    key = torch.where(valid, flat, n_experts)  # skipped pairs (negative ids) sort last, into no block
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    # the skipped pairs' bin emptied on the device (`counts[n_experts] = 0` copies a host scalar in: refused inside
    # a CUDA-graph capture)
    counts = torch.cat([counts[:n_experts], counts.new_zeros(1)])
    padded = (counts + bm - 1) // bm * bm
    pad_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    skey = key[order]
    dest = pad_end[skey] - padded[skey] + torch.arange(p, device=dev) - start[skey]
    n_blocks = triton.cdiv(p, bm) + n_experts
    rows = torch.full((n_blocks * bm + bm,), p, dtype=torch.int32, device=dev)  # a spare block for skipped pairs
    dest = torch.where(skey < n_experts, dest, n_blocks * bm)  # skipped: into the spare block's first row, unread
    rows.scatter_(0, dest, order.to(torch.int32))
    first = torch.arange(n_blocks, device=dev) * bm
    bexp = torch.searchsorted(pad_end[:n_experts], first, right=True)
    bexp = torch.where(first < pad_end[n_experts - 1], bexp, -1).to(torch.int32)
    return rows[:n_blocks * bm], bexp


def _launch(x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, bexp: torch.Tensor, rw: torch.Tensor,
            w: PackedWeight, p: int, n: int, x_div: int, mode: int, bm: int, bn: int, warps: int, gated: bool) -> None:
    planes = plane_args(w)
    grid = (bexp.numel(), triton.cdiv(n, bn))
    _moe_kernel[grid](x, out, rows, bexp, rw, *planes, *_expert_strides(planes), p, n, w.n,
                      w.k // QK, x_div, x.stride(0), out.stride(0), QT=QT_CODE[w.qtype], MODE=mode, BM=bm, BN=bn,
                      GATED=gated, num_warps=warps)


@triton.jit
def _split_resident_kernel(ids_ptr, slot_ptr, gpu_ptr, cpu_ptr, n, n_experts, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = tl.load(ids_ptr + i, mask=m, other=-1)
    inside = m & (e >= 0) & (e < n_experts)
    s = tl.load(slot_ptr + tl.minimum(tl.maximum(e, 0), n_experts - 1), mask=inside, other=-1)
    tl.store(gpu_ptr + i, s.to(gpu_ptr.dtype.element_ty), mask=m)
    tl.store(cpu_ptr + i, tl.where(s >= 0, -1, e).to(cpu_ptr.dtype.element_ty), mask=m)


def split_resident(ids: torch.Tensor, slot_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's routing split between the experts resident on the GPU and the CPU's, in one launch (the oracle:
    ktrans.kernels.torch.moe.split_resident). ids [T, k] (-1: a pair masked off); slot_of [E], an expert's slot in
    the resident stacks or -1. Returns (slots, cpu_ids), both like ids: a resident pair's slot and -1 in cpu_ids;
    any other pair -1 in slots and its id in cpu_ids (an id past the table too: the CPU's kernel refuses it)."""
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    slots, cpu_ids = torch.empty_like(flat), torch.empty_like(flat)
    n, block = flat.numel(), 256
    _split_resident_kernel[(triton.cdiv(n, block),)](flat, slot_of, slots, cpu_ids, n, slot_of.numel(), BLOCK=block,
                                                 **launch())
    return slots.view(ids.shape), cpu_ids.view(ids.shape)


def moe_quant(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: PackedWeight,
              down: PackedWeight, extra: tuple[PackedWeight, PackedWeight] | None = None) -> torch.Tensor:
    """x [T, H]; ids, weights [T, k]; gate_up: a stack [E, 2I, H] (gate rows, then up rows); down [E, H, I].
    Returns [T, H] in x's dtype. extra: (gate_up, down) of one more expert of the same types and shapes (the shared
    expert, a one-expert stack each), which pairs with id E take: the lanes path only (T <= LANES["max_tokens"])."""
    t, k = ids.shape
    e, inter, hidden = gate_up.experts, gate_up.n // 2, down.n
    if x.shape != (t, gate_up.k) or down.k != inter or down.experts != e:
        raise ValueError(f"moe_quant: x {tuple(x.shape)}, gate_up [{e}, {gate_up.n}, {gate_up.k}], down "
                         f"[{down.experts}, {down.n}, {down.k}] do not fit")
    x = x if x.stride(1) == 1 else x.contiguous()
    p = t * k
    rw = weights.reshape(-1)
    rw = rw if rw.is_contiguous() else rw.contiguous()
    if extra is not None:
        xg, xd = extra
        if not (LANES["on"] and t <= LANES["max_tokens"]):
            raise ValueError(f"moe_quant: an extra expert rides the lanes path only ({t} tokens)")
        if (xg.qtype, xg.n, xg.k, xd.qtype, xd.n, xd.k) != (gate_up.qtype, gate_up.n, gate_up.k, down.qtype, down.n,
                                                            down.k):
            raise ValueError("moe_quant: the extra expert's types or shapes differ from the stack's")
        return _lanes(x, ids, rw, gate_up, down, extra)
    if LANES["on"] and t <= LANES["max_tokens"]:
        return _lanes(x, ids, rw, gate_up, down)
    if t <= DIRECT_MAX_TOKENS:
        mode, bm = 0, 1
        rows = torch.arange(p, dtype=torch.int32, device=x.device)
        bexp = ids.reshape(-1).to(torch.int32)
    else:
        mode, bm = (1, 16) if p <= 16 * e else (2, 64)
        rows, bexp = align(ids, e, bm)
    _, _, bn, warps = tiles(bm)
    if bm == 1 and not interpreting():
        bn //= 2  # the per-pair path has no split K: narrower tiles, more programs in flight
    h = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(p, hidden, dtype=torch.float32, device=x.device)  # skipped pairs add nothing
    _launch(x, h, rows, bexp, rw, gate_up, p, inter, k, mode, bm, bn, warps, True)
    _launch(h, y, rows, bexp, rw, down, p, hidden, 1, mode, bm, bn, warps, False)
    return y.view(t, k, hidden).sum(1).to(x.dtype)
