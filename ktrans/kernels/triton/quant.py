"""Triton GEMV / GEMM on GGUF-quantized weights in the packed layout (ktrans.kernels.triton.quant_layout):
y = x W^T, x [M, K] bf16 (or fp16 / fp32), W [N, K] Q4_K, Q5_K, Q6_K or Q8_0, fp32 accumulate, y in x's dtype.

The weights are never expanded in memory: each program decodes one super-block (256 weights) of its row tile at a
time, sub-block by sub-block, from contiguous plane runs. Three ways to multiply, chosen by M:

- M = 1 (decode of one sequence): the GEMV kernel of ktrans.kernels.triton.quant_gemv (lane-wise sums, codes
  turned into floats without a conversion instruction). Exact up to fp32 rounding.
- M <= 4 (decode): products and sums in fp32 on the CUDA cores, each sub-block's integer codes dotted with x and
  then scaled: y = sum_S (d*sc_S) (x_S . q_S) - (dmin*m_S) sum(x_S). Exact up to fp32 rounding.
- M <= 32: the same factoring with the code dot on tensor cores (bf16 x, integer codes exact in bf16).
- larger M (prefill): each sub-block dequantized to bf16 and fed to tl.dot, accumulating into one fp32 tile; the
  weights are rounded to bf16 (as a bf16 model's KLinearTorch rounds them at load).

When the row tiles alone would not fill the GPU (decode of a 2048-row matrix), K is split across programs and a
second small kernel sums the fp32 partials (deterministic, no atomics). `superblock_dot` is shared with the MoE
kernel (ktrans.kernels.triton.moe_quant). The oracle is ktrans.kernels.torch.quant.quant_linear.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ktrans.kernels.triton import interpreting, quant_gemv_reg, quant_rows_reg
from ktrans.kernels.triton.pdl import enter, launch
from ktrans.kernels.triton.quant_gemv import gemv_kernel, store_split
from ktrans.kernels.triton.quant_layout import QK, PackedWeight

QT_CODE = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "Q8_0": 3}
_STAGES: dict[tuple, tuple] = {}  # (device, type, mode, BM, BN) -> the pipelining stages that fit its shared memory
# Triton 3.9's interpreter multiplies bf16 tl.dot operands as their raw bits; interpreted, the operands are rounded to
# bf16 and multiplied in fp32 instead (the same values, so the same results up to summation order).
if interpreting():
    @triton.jit
    def to_dot(v):
        """v rounded to bf16, as a tl.dot operand (fp32 holding bf16 values, for the interpreter)."""
        return v.to(tl.bfloat16).to(tl.float32)
else:
    @triton.jit
    def to_dot(v):
        """v rounded to bf16, as a tl.dot operand."""
        return v.to(tl.bfloat16)


@triton.jit
def _sub_x(x_ptr, offs_m, mask_m, stride_xm, k0, SUB: tl.constexpr):
    """Activations of one sub-block: [BM, SUB] fp32."""
    offs_k = k0 + tl.arange(0, SUB)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _mul_add(acc, x, q, s, m, MODE: tl.constexpr, HAS_MIN: tl.constexpr):
    """acc [BM, BN] += x [BM, SUB] @ (s q - m)^T, q [BN, SUB] integer codes, s, m [BN] fp32."""
    if MODE == 2:
        w = q.to(tl.float32) * s[:, None]
        if HAS_MIN:
            w = w - m[:, None]
        acc = tl.dot(to_dot(x), tl.trans(to_dot(w)), acc)
    else:
        if MODE == 1:
            part = tl.dot(to_dot(x), tl.trans(to_dot(q.to(tl.float32))))
        else:
            part = tl.sum(x[:, None, :] * q.to(tl.float32)[None, :, :], axis=2)
        acc += part * s[None, :]
        if HAS_MIN:
            acc -= tl.sum(x, axis=1)[:, None] * m[None, :]
    return acc


@triton.jit
def superblock_dot(acc, x_ptr, offs_m, mask_m, stride_xm, lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n, mask_n,
                   QT: tl.constexpr, MODE: tl.constexpr):
    """acc [BM, BN] += the products of super-block `sb` (weights sb*256 .. +256) of rows offs_n; the plane
    pointers are those of one matrix (an expert's, in the MoE)."""
    row = sb * N + offs_n  # [BN] index of (super-block, row) in every plane
    k0 = sb * 256
    if QT == 3:  # Q8_0: int8 codes in element order, one fp16 scale per 32
        for S in tl.static_range(8):
            i = tl.arange(0, 32)
            q = tl.load(lo_ptr + row[:, None] * 256 + S * 32 + i[None, :], mask=mask_n[:, None], other=0)
            s = tl.load(d_ptr + row * 8 + S, mask=mask_n, other=0.0).to(tl.float32)
            x = _sub_x(x_ptr, offs_m, mask_m, stride_xm, k0 + S * 32, 32)
            acc = _mul_add(acc, x, q.to(tl.int32), s, s, MODE, False)
    elif QT == 2:  # Q6_K: 16 sub-blocks of 16, signed int8 scales, codes - 32
        i = tl.arange(0, 16)
        wa = tl.load(lo_ptr + row[:, None] * 32 + i[None, :], mask=mask_n[:, None], other=0)
        wb = tl.load(lo_ptr + row[:, None] * 32 + 16 + i[None, :], mask=mask_n[:, None], other=0)
        h = tl.load(hi_ptr + row[:, None] * 16 + i[None, :], mask=mask_n[:, None], other=0)
        d = tl.load(d_ptr + row, mask=mask_n, other=0.0).to(tl.float32)
        for S in tl.static_range(16):
            if S < 8:
                low = (wa >> (4 * S)) & 15
            else:
                low = (wb >> (4 * (S - 8))) & 15
            q = (low | (((h >> (2 * S)) & 3) << 4)) - 32
            s = d * tl.load(sc_ptr + row * 16 + S, mask=mask_n, other=0).to(tl.float32)
            x = _sub_x(x_ptr, offs_m, mask_m, stride_xm, k0 + S * 16, 16)
            acc = _mul_add(acc, x, q, s, s, MODE, False)
    else:  # Q4_K / Q5_K: 8 sub-blocks of 32, six-bit scales and mins times the fp16 d and dmin
        i = tl.arange(0, 32)
        words = tl.load(lo_ptr + row[:, None] * 32 + i[None, :], mask=mask_n[:, None], other=0)
        if QT == 1:
            hb = tl.load(hi_ptr + row[:, None] * 32 + i[None, :], mask=mask_n[:, None], other=0).to(tl.int32)
        d = tl.load(d_ptr + row * 2, mask=mask_n, other=0.0).to(tl.float32)
        dmin = tl.load(d_ptr + row * 2 + 1, mask=mask_n, other=0.0).to(tl.float32)
        for S in tl.static_range(8):
            q = (words >> (4 * S)) & 15
            if QT == 1:
                q = q | (((hb >> S) & 1) << 4)
            s = d * tl.load(sc_ptr + row * 16 + S, mask=mask_n, other=0).to(tl.float32)
            m = dmin * tl.load(sc_ptr + row * 16 + 8 + S, mask=mask_n, other=0).to(tl.float32)
            x = _sub_x(x_ptr, offs_m, mask_m, stride_xm, k0 + S * 32, 32)
            acc = _mul_add(acc, x, q, s, m, MODE, True)
    return acc


@triton.jit
def _qlinear_kernel(x_ptr, out_ptr, part_ptr, cnt_ptr, lo_ptr, hi_ptr, d_ptr, sc_ptr, M, N, NSB, SB_PER, SPLIT,
                    stride_xm, QT: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    FUSED_SUM: tl.constexpr = False, PDL: tl.constexpr = False):
    """Tile (pid_n, pid_m) of y [M, N] over super-blocks pid_k * SB_PER..: SPLIT = 1, into out_ptr (x's dtype); else
    the fp32 partial into part_ptr [SPLIT, M, N], and with FUSED_SUM the tile's last program to finish (counted in
    cnt_ptr[tile], zero between calls) sums the SPLIT partials in order into out_ptr (quant_gemv.store_split: one
    launch instead of two, as the GEMV's)."""
    enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_n = offs_n < N
    mask_m = offs_m < M
    sb0 = pid_k * SB_PER
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for sb in range(sb0, tl.minimum(sb0 + SB_PER, NSB)):
        acc = superblock_dot(acc, x_ptr, offs_m, mask_m, stride_xm, lo_ptr, hi_ptr, d_ptr, sc_ptr, sb, N, offs_n,
                             mask_n, QT, MODE)
    store_split(acc, offs_m[:, None] * N + offs_n[None, :], mask_m[:, None] & mask_n[None, :], out_ptr, part_ptr,
                cnt_ptr + pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT, M * N, FUSED_SUM)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, SPLIT, MN, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_STAND_INS: dict[tuple, torch.Tensor] = {}


def plane_args(w: PackedWeight) -> tuple[torch.Tensor, ...]:
    """The four planes as kernel arguments; a type without `hi` or `sc` passes a one-element stand-in (never
    read, made once per dtype and device) rather than an empty tensor."""
    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            return t
        key = (t.dtype, t.device)
        if key not in _STAND_INS:
            _STAND_INS[key] = torch.zeros(1, dtype=t.dtype, device=t.device)
        return _STAND_INS[key]
    return w.lo, stand_in(w.hi), w.d, stand_in(w.sc)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    if device.type == "cuda" and not interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, but enough that the tests take the split-K path


# The one-row GEMV's tiling (ktrans.kernels.triton.quant_gemv): rows per program, warps, programs wanted per SM (K
# is split until the grid has that many). Set from scripts/gemv_sweep.py on the H200 (doc/benchmarks.md, 2026-12-02):
# 100.4 us over the nine Q4_K shapes of a layer's projections, within 1% of the best of 54 tilings tried (64, 4, 8:
# 104.7); the interpreter gets wider tiles. fused_sum: the split-K partials summed by the GEMV's last program (one
# launch) instead of a second kernel; faster in every tiling of the session-13 sweep (90.7 against 101.4 us), and
# all on the H200 at full size (session 15, CUDA graphs) 153.7 against 135.2 tok/s at batch 1 once its CUDA-graph
# test had passed there. On by default; KTRANS_GEMV_FUSED_SUM=0 selects the second kernel.
# stages: the launch's num_stages (None: Triton's default), swept by scripts/gemv_sweep.py (no effect in session 16).
# rows: each row's super-block read by that many threads (quant_gemv._row_dot_rows: a sub-block's scale made once a
# row, x read as bf16 pairs; bf16 x only), with rows_bn rows and rows_warps warps a program; 0: the lane-group kernel.
# KTRANS_GEMV_ROWS=H or H,BN,WARPS sets them (also for the MoE's few-token path).


def env_ints(name: str, defaults: list[int]) -> list[int]:
    """A comma-separated list of ints from the environment, its missing trailing fields taken from `defaults`."""
    given = [int(v) for v in os.environ.get(name, "").split(",") if v.strip()]
    return given + defaults[len(given):]


_ROWS_ENV = env_ints("KTRANS_GEMV_ROWS", [0, 128, 4])
# maxnreg: a register cap for the launch (None: the compiler's choice, ~125 registers for the lane-group kernel on
# sm_90), swept by gemv_sweep --maxnreg. 80 on the H200 (session 22, two runs, doc/benchmarks.md): the nine shapes
# of a layer's projections 85.8 against 95.5 us at Q4_K and 95.1 against 102 us at Q6_K, the small ones (~7 against
# ~9 us) and in_proj_qkvz (16.2 against 17.1 us) both faster; 96 was between, 64 slower (spills). KTRANS_GEMV_MAXNREG
# sets another (0: none). The cap changes the register allocation only: the same results bitwise. End to end
# (session 23): the serve placement's GPU share 3.09 against 3.19 ms, all-GPU batch 1 208 against 203 tok/s; with
# the cap, 6 or 8 programs an SM (per_sm) were no faster than 4.
# pipe: the stages of the lane-group body's super-block loop (quant_gemv.row_dot PIPE: the next super-blocks' weights
# copied into shared memory while the current one's arithmetic runs; 0: the plain loop, which Triton does not
# pipeline at any launch num_stages). per_sm_pipe: programs wanted per SM where pipe is on: a pipelined program wants
# a long loop (few K splits), a plain one many programs. KTRANS_GEMV_PIPE=S[,PER_SM] sets both. Off: on the H100
# (session 31, gemv_sweep) 3 stages at one program an SM took in_proj_qkvz 16.9 -> 15.5 us and q_proj 13.5 -> 12.5
# at Q4_K, but lost on the K=4096 shapes and at Q6_K; a layer's nine shapes 90.6 against the default's 90.0 us. Its
# loop issues ~8 instructions a weight (scripts/gemv_resources.py), which the issue slots, not the bytes, pace.
_PIPE_ENV = env_ints("KTRANS_GEMV_PIPE", [0, 2])
# mma: the tensor-core body (quant_gemv_mma.row_dot_mma: a super-block's codes as bf16 1 + q / 2^b by one shift and one
# logic op a weight pair, dotted on tensor cores with x placed block-diagonally, the sub-block scales applied after
# the dot; ~2.7 instructions a weight at Q4_K against the lane-group body's 7.5-8.5) for Q4_K and Q6_K with bf16 x,
# mma_bn rows and mma_warps warps a program, mma_per_sm programs wanted an SM, mma_pipe its loop's stages (0: a
# plain loop). mma 2: the dot transposed (its M the 16 columns of x; at 2 warps mma.m16n8k16 instead of sm_90's
# wgmma). KTRANS_GEMV_MMA=MMA[,BN[,WARPS[,PER_SM[,PIPE]]]] sets them. Off: slower at every tiling on the H100
# (session 32, gemv_sweep): a layer's nine Q4_K shapes 110.3 us at best (64 rows, 4 warps, 2 an SM) against the
# lane-group body's 90.8, in_proj_qkvz 22.9 against 17.7. Triton stages the dequantized operand through shared
# memory (stored, then read back in the dot's layout: 4 bytes of shared traffic a weight, 6-way store conflicts,
# barriers every super-block), and ncu found 0.3 eligible warps a scheduler, stalled on shared memory (38% of
# samples), global loads (21%) and barriers (16%): fewer instructions, but a longer chain a super-block.
_MMA_ENV = env_ints("KTRANS_GEMV_MMA", [0, 128, 4, 2, 0])
MMA_TYPES = ("Q4_K", "Q6_K")
# reg: the tensor-core body with the dequantized weights kept in registers (ktrans.kernels.triton.quant_gemv_reg,
# Gluon; Q4_K and Q6_K with bf16 x), reg_bn rows a program (16 reg_warps times a power of two), reg_warps warps,
# reg_per_sm programs wanted an SM; reg 2: the next super-block's code words loaded ahead of the current one's
# arithmetic; reg_bn6: Q6_K's rows a program (its 16 accumulator columns and high-bit words spill at 256 rows and 4
# warps: 255 registers and a 392-byte stack on sm_90, against 241 and none at 128); reg_chains: each super-block's dot
# as that many independent mma chains (1 or 2; untimed). KTRANS_GEMV_REG=ON[,BN[,WARPS[,PER_SM[,BN6[,CHAINS]]]]] sets
# them (ON 1 or 2). Off: on the H100 (session 33, gemv_sweep) a layer's nine Q4_K shapes 92.0 us at best (128 rows,
# 2 an SM) against the lane-group body's 89.3: in_proj_qkvz 15.6 against 17.2 and q_proj 13.1 against 13.4, but every
# small shape ~0.7-1 us slower; Q6_K 107.7 against 101.4. ~2.3 instructions a weight and no shared memory, yet
# in_proj_qkvz reads at 0.31 of HBM: its latency (one super-block of loads in flight a thread, a chain of 16 dependent
# mma a super-block), not its issue slots, sets its pace. A shared ring of 2 or 4 super-blocks that cp.async filled
# ahead (sessions 33-34) put all of a short program's loads in flight and was slower at every tiling (in_proj_qkvz
# 18.2 us at 256 rows, 0.27 of HBM): removed.
_REG_ENV = env_ints("KTRANS_GEMV_REG", [0, 256, 4, 2, 128, 1])
# tile_fused_sum (KTRANS_GEMV_TILE_FUSED_SUM=1; opt-in until timed): the tile path's split sums in each tile's last
# program, not _sum_splits_kernel (537 us, 174 launches of a 16-request step on the H100, session 35); the same bits.
GEMV = {"bn": 32, "warps": 4, "per_sm": 4, "fused_sum": os.environ.get("KTRANS_GEMV_FUSED_SUM", "1") == "1",
        "tile_fused_sum": os.environ.get("KTRANS_GEMV_TILE_FUSED_SUM", "0") == "1",
        "stages": None, "rows": _ROWS_ENV[0], "rows_bn": _ROWS_ENV[1], "rows_warps": _ROWS_ENV[2],
        "maxnreg": int(os.environ.get("KTRANS_GEMV_MAXNREG") or 80) or None,
        "pipe": _PIPE_ENV[0], "per_sm_pipe": _PIPE_ENV[1],
        "mma": _MMA_ENV[0], "mma_bn": _MMA_ENV[1], "mma_warps": _MMA_ENV[2], "mma_per_sm": _MMA_ENV[3],
        "mma_pipe": _MMA_ENV[4], "reg": _REG_ENV[0], "reg_bn": _REG_ENV[1], "reg_warps": _REG_ENV[2],
        "reg_per_sm": _REG_ENV[3], "reg_bn6": _REG_ENV[4], "reg_chains": _REG_ENV[5]}
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: the fused split-K sum's per-row-tile counts, kept zero
_MAX_TILES = 1 << 16


def counters(device: torch.device) -> torch.Tensor:
    """The device's _MAX_TILES int32 counts of the fused split sums (the GEMV's, the MoE's few-token path; also
    gated_delta_decode's fused output norm and folded launch, a count a row and value head and one a row and key
    head), and one more, dense_gemv.dense_route's (index _MAX_TILES), zero between kernels: each kernel's last
    program of a tile resets its count. Made before any graph capture. Keyed by the device with its index (`cuda`
    and `cuda:0` are unequal torch.devices, but one GPU has one set of counts)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(_MAX_TILES + 1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


# where the cap was timed (the lane-group form); other types and the row-owning form go uncapped (gemv_sweep --maxnreg
# with --rows 1 times no cap)
MAXNREG_TYPES = ("Q4_K", "Q6_K")


def _gemv_options(qtype: str, rows: int, mma: int = 0) -> dict:
    """The one-row GEMV's launch options from GEMV (stages, maxnreg) where set; the cap for the types and form it
    was timed on (the lane-group body's)."""
    extra = {} if GEMV["stages"] is None else {"num_stages": GEMV["stages"]}
    if GEMV["maxnreg"] is None or rows or mma or qtype not in MAXNREG_TYPES:
        return extra
    return {**extra, "maxnreg": GEMV["maxnreg"]}


def pipe_per_sm(cfg: dict, rows: int, mma: int = 0) -> tuple[int, int]:
    """(row_dot's PIPE, programs wanted per SM) under a launch config with "pipe", "per_sm" and "per_sm_pipe" (GEMV,
    moe_quant.LANES): the lane-group body's loop pipelined as set (the row-owning body, rows > 0, keeps its plain
    loop), and the pipelined form's own programs an SM (its K split follows); the tensor-core body's own ("mma_pipe",
    "mma_per_sm")."""
    if mma:
        return cfg["mma_pipe"], cfg["mma_per_sm"]
    pipe = 0 if rows else cfg["pipe"]
    return pipe, cfg["per_sm_pipe"] if pipe else cfg["per_sm"]


def gemv_rows(x: torch.Tensor, qtype: str) -> int:
    """The ROWS argument of the one-row GEMV body for activation rows x: GEMV["rows"] where the row-owning form
    applies (a K-quant type, bf16 x whose every row starts int32-aligned, H a power of two with four code words a
    thread at least: H <= 8, Q6_K's half super-blocks H <= 4; rows_bn a power of two), else 0."""
    h, words = GEMV["rows"], 16 if qtype == "Q6_K" else 32
    aligned = x.data_ptr() % 4 == 0 and (x.shape[0] <= 1 or x.stride(0) % 2 == 0)
    ok = x.dtype == torch.bfloat16 and qtype != "Q8_0" and aligned and h > 0 and \
        h & (h - 1) == 0 and 4 * h <= words and GEMV["rows_bn"] & (GEMV["rows_bn"] - 1) == 0
    return h if ok else 0


def gemv_mma(x: torch.Tensor, qtype: str) -> int:
    """The one-row GEMV's tensor-core body for activation rows x (row_dot's MMA): GEMV["mma"] for a type of
    MMA_TYPES and bf16 x, else 0 (the CUDA-core bodies)."""
    return int(GEMV["mma"]) if qtype in MMA_TYPES and x.dtype == torch.bfloat16 else 0


def gemv_reg(x: torch.Tensor, qtype: str) -> bool:
    """Whether the one-row GEMV of activation rows x takes the register tensor-core body (quant_gemv_reg): GEMV["reg"]
    on, a type it covers, bf16 x on a GPU where Gluon compiles."""
    return bool(GEMV["reg"]) and quant_gemv_reg.applies(x, qtype)


def _reg_launch(x, out, w, wb, split) -> None:
    """quant_gemv_reg's launch for x [1, K] times w (and wb, of the same type and width, its rows after w's in
    `out`), K split `split` ways (None: enough programs for GEMV["reg_per_sm"] an SM); fp32 partials summed by each
    row tile's last program (always: GEMV["fused_sum"] selects between the lane-group body's two sums only)."""
    warps, bn = GEMV["reg_warps"], GEMV["reg_bn6"] if w.qtype == "Q6_K" else GEMV["reg_bn"]
    consts = quant_gemv_reg.tiling("KTRANS_GEMV_REG", bn, warps)
    nsb = w.k // QK
    tiles_a = triton.cdiv(w.n, bn)
    tiles_b = triton.cdiv(wb.n, bn) if wb is not None else 0
    n_all = w.n + (wb.n if wb is not None else 0)
    if n_all * nsb * 32 >= 2 ** 31:
        raise ValueError(f"quant_gemv_reg: [{w.n}, {w.k}] overflows its int32 offsets")
    if split is None:
        split = max(1, min(nsb, triton.cdiv(GEMV["reg_per_sm"] * _sms(x.device), tiles_a + tiles_b)))
    sb_per = triton.cdiv(nsb, split)
    split = triton.cdiv(nsb, sb_per)
    if split > 1 and tiles_a + tiles_b > _MAX_TILES:  # more row tiles than split-sum counts: whole K a program
        split, sb_per = 1, nsb
    part = torch.empty(split * n_all if split > 1 else 1, dtype=torch.float32, device=x.device)
    planes = plane_args(w)
    offs = plane_offsets(planes, plane_args(wb)) if wb is not None else [0, 0, 0, 0]
    quant_gemv_reg.gemv_reg_kernel[(tiles_a + tiles_b, split)](
        x, out, part, counters(x.device), *planes, w.n, nsb, sb_per, split, tiles_a,
        wb.n if wb is not None else 0, *offs, QT=QT_CODE[w.qtype], FUSED_SUM=split > 1, HAS_B=wb is not None,
        PF=GEMV["reg"] == 2, CH=GEMV["reg_chains"], num_warps=warps, **consts, **launch())


def tiles(m: int, rows: int = 0, mma: int = 0) -> tuple[int, int, int, int]:
    """(MODE, BM, BN, num_warps) for M rows of activations (MODE 3: one row, the GEMV kernel, `rows` its ROWS, `mma`
    its tensor-core body; 0: a few rows, fp32 products; 1: tensor-core code dots; 2: bf16 tiles). The interpreter
    pays per program, not per element: it gets wider row tiles."""
    wide = 2 if interpreting() else 1
    if m == 1 and mma:
        return 3, 1, GEMV["mma_bn"], GEMV["mma_warps"]
    if m == 1 and rows:
        return 3, 1, GEMV["rows_bn"], GEMV["rows_warps"]
    if m == 1:
        return 3, 1, GEMV["bn"] * wide, GEMV["warps"]
    if m <= 4:
        return 0, triton.next_power_of_2(m), 64 * wide, 4
    if m <= 32:
        return 1, (16 if m <= 16 else 32), 64 * wide, 4
    return 2, (64 if m <= 64 else 128), 128, 8


def _scale_words(w: PackedWeight) -> torch.Tensor:
    """The sub-block scale plane as int32 words (four a row and super-block); a stand-in for Q8_0."""
    if not w.sc.numel():
        return plane_args(w)[0].new_zeros(1, dtype=torch.int32)
    return w.sc.view(torch.int32)


def qlinear(x: torch.Tensor, w: PackedWeight, split: int | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype. `split`: K splits (default: enough programs to fill the device)."""
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"qlinear: x is {tuple(x.shape)}, the weight is [{w.n}, {w.k}]")
    if w.experts is not None:
        raise ValueError("qlinear takes one matrix; the experts' kernel is ktrans.kernels.triton.moe_quant")
    if not x.shape[0]:  # e.g. lm_head on a prefill chunk that returns no logits
        return x.new_empty(0, w.n)
    x = x if x.stride(1) == 1 else x.contiguous()
    m, n, nsb = x.shape[0], w.n, w.k // QK
    if quant_rows_reg.applies(x, w):  # 2..16 bf16 rows of Q4_K or Q6_K, opt-in
        return quant_rows_reg.qlinear_rows(x, w, plane_args(w), counters(x.device), _sms(x.device), split)
    if m == 1 and gemv_reg(x, w.qtype):
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
        _reg_launch(x, out, w, None, split)
        return out
    mma = gemv_mma(x, w.qtype) if m == 1 else 0
    rows = gemv_rows(x, w.qtype) if m == 1 and not mma else 0
    pipe, per_sm = pipe_per_sm(GEMV, rows, mma)
    mode, bm, bn, warps = tiles(m, rows, mma)
    grid_nm = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    if split is None:  # a decode GEMV streams with no software pipelining across programs: enough programs per SM
        # keep enough loads in flight (a 2048-row matrix at K=2048 has only 32 row tiles)
        per_sm = per_sm if mode == 3 else 8
        split = max(1, min(nsb, triton.cdiv(per_sm * _sms(x.device), grid_nm))) if mode != 2 else 1
    sb_per = triton.cdiv(nsb, split)
    split = triton.cdiv(nsb, sb_per)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dst = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    fused = split > 1 and GEMV["fused_sum" if mode == 3 else "tile_fused_sum"] and grid_nm <= _MAX_TILES
    if mode == 3:
        lo, hi, d, _ = plane_args(w)
        cnt = counters(x.device) if fused else dst
        extra = _gemv_options(w.qtype, rows, mma)
        gemv_kernel[(triton.cdiv(n, bn), split)](
            x, out, dst, cnt, lo, hi, d, _scale_words(w), n, nsb, sb_per, split, 0, 0, 0, 0, 0, 0, QT=QT_CODE[w.qtype],
            BN=bn, FUSED_SUM=fused, ROWS=rows, PIPE=pipe, MMA=mma, num_warps=warps, **extra, **launch())
    else:
        _launch_tiles(x, out, dst, w, m, n, nsb, sb_per, split, mode, bm, bn, warps, fused)
    if split > 1 and not fused:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](dst, out, split, m * n, BLOCK=block, **launch())
    return out


def plane_offsets(planes, other) -> list[int]:
    """Each of `other`'s planes' offset from `planes`' (kernel arguments, as plane_args and _scale_words give
    them), in the plane's elements: a kernel reaches a second matrix's planes from the first's pointers. Each must
    be a whole number of 16-byte steps (planes.step16; separate allocations always are)."""
    out = []
    for a, b in zip(planes, other):
        if a.dtype != b.dtype or a.device != b.device:
            raise ValueError("the second matrix's planes differ from the first's in dtype or device")
        diff = b.data_ptr() - a.data_ptr()
        if diff % 16:
            raise ValueError(f"the second matrix's planes lie {diff} bytes from the first's: not a 16-byte step")
        out.append(diff // a.element_size())
    return out


def qlinear_pair(x: torch.Tensor, wa: PackedWeight, wb: PackedWeight,
                 split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One activation row times two matrices of one type and width (e.g. a DeltaNet's in_proj_qkvz and
    in_proj_ba), in one GEMV launch: (x @ Wa^T [1, Na], x @ Wb^T [1, Nb]), each bitwise what qlinear gives at the
    same K split. `split`: as qlinear's (default: enough programs for the two together)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != wa.k:
        raise ValueError(f"qlinear_pair: one row of width {wa.k}, got x {tuple(x.shape)}")
    if wa.experts is not None or wb.experts is not None or (wa.qtype, wa.k) != (wb.qtype, wb.k):
        raise ValueError(f"qlinear_pair: two matrices of one type and width, got {wa.qtype} [{wa.n}, {wa.k}] and "
                         f"{wb.qtype} [{wb.n}, {wb.k}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    if gemv_reg(x, wa.qtype):
        out = torch.empty(1, wa.n + wb.n, dtype=x.dtype, device=x.device)
        _reg_launch(x, out, wa, wb, split)
        return out[:, : wa.n], out[:, wa.n:]
    mma = gemv_mma(x, wa.qtype)
    rows = 0 if mma else gemv_rows(x, wa.qtype)
    pipe, per_sm = pipe_per_sm(GEMV, rows, mma)
    mode, _, bn, warps = tiles(1, rows, mma)
    nsb = wa.k // QK
    tiles_a, tiles_b = triton.cdiv(wa.n, bn), triton.cdiv(wb.n, bn)
    if split is None:
        split = max(1, min(nsb, triton.cdiv(per_sm * _sms(x.device), tiles_a + tiles_b)))
    sb_per = triton.cdiv(nsb, split)
    split = triton.cdiv(nsb, sb_per)
    if split > 1 and not (GEMV["fused_sum"] and tiles_a + tiles_b <= _MAX_TILES):
        return qlinear(x, wa, split), qlinear(x, wb, split)
    out = torch.empty(1, wa.n + wb.n, dtype=x.dtype, device=x.device)
    part = torch.empty(split * (wa.n + wb.n) if split > 1 else 1, dtype=torch.float32, device=x.device)
    lo, hi, d, _ = plane_args(wa)
    planes = (lo, hi, d, _scale_words(wa))
    blo, bhi, bd, _ = plane_args(wb)
    offs = plane_offsets(planes, (blo, bhi, bd, _scale_words(wb)))
    extra = _gemv_options(wa.qtype, rows, mma)
    gemv_kernel[(tiles_a + tiles_b, split)](x, out, part, counters(x.device), *planes, wa.n, nsb, sb_per, split,
                                            tiles_a, wb.n, *offs, QT=QT_CODE[wa.qtype], BN=bn,
                                            FUSED_SUM=split > 1, HAS_B=True, ROWS=rows, PIPE=pipe, MMA=mma,
                                            num_warps=warps, **extra, **launch())
    return out[:, : wa.n], out[:, wa.n:]


def _launch_tiles(x, out, dst, w, m, n, nsb, sb_per, split, mode, bm, bn, warps, fused) -> None:
    key = (x.device, w.qtype, mode, bm, bn)
    cnt = counters(x.device) if fused else dst
    for stages in _STAGES.get(key, (None, 2, 1)):
        try:
            grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
            extra = {} if stages is None else {"num_stages": stages}
            _qlinear_kernel[grid](x, out, dst, cnt, *plane_args(w), m, n, nsb, sb_per, split, x.stride(0),
                                  QT=QT_CODE[w.qtype], MODE=mode, BM=bm, BN=bn, FUSED_SUM=fused, num_warps=warps,
                                  **extra, **launch())
            _STAGES[key] = (stages,)
            return
        except OutOfResources:
            # Triton's default pipelining stages the prefill tiles in more shared memory than some GPUs have
            # (237,568 B asked on an H200's 232,448 at BM = BN = 128): fewer stages, found once per shape and kept
            if stages == 1:
                raise
