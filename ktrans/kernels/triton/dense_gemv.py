"""A few activation rows times a float matrix (y = x W^T, W [N, K] bf16 / fp16 / fp32), in Triton: the decode-step
projections a GGUF keeps as floats (the MoE router's gate, F32 in the file and bf16 on the GPU), which KLinearMarlin
otherwise multiplies with F.linear. At one row cuBLAS took 5.4 us for the 80B's [512, 2048] router gate on the H200
(doc/benchmarks.md, session 15: 48 calls a token), for 2 MiB of weights.

One program per BN rows of W reads them once for all M <= MAX_ROWS activation rows, K in BK-wide steps, products in
fp32 and one reduction per step; the result is rounded once to x's dtype. The oracle is F.linear in fp32.

`dense_gemv_topk` is the router's gate and its routing in one launch: the same programs store the logits, and the
last of them to finish (a count in quant.counters, released with acq_rel after every program's stores, as the
quantized GEMV's fused split sum) picks each row's top k from them (router.topk_softmax_row), where the gate and the
top-k were two launches a layer. The logits are the gate's own up to fp32 summation order (one warp a program, the
gate alone four), rounded to x's dtype; the ids are those of router.route(dense_gemv(x, w)) but where two logits
tie within that rounding, the weights within fp32 rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter, launch
from ktrans.kernels.triton.router import topk_softmax_row

MAX_ROWS = 4  # activation rows this path takes (decode); more go to the caller's GEMM
BN, BK = 4, 512
# dense_gemv_topk's warps a program: its last program's k passes of max-and-mask stay inside one warp (with four,
# each pass crossed warps through shared memory: on the H200 the fused launch and the stage-in after it took 9.3 and
# 9.9 us a layer, against 5.1 + 6.0 + 4.5 for the gate, the top-k and the stage-in apart; doc/benchmarks.md, session 22)
TOPK_WARPS = 1


@triton.jit
def _dense_rows(X, W, M, N, K, stride_x, stride_w, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PDL: tl.constexpr):
    """Rows pid*BN.. of y = x W^T, fp32 [BM, BN], K in steps of BK. The first step's weights (resident: written before
    the last sync, never by a kernel of the step) are loaded before the PDL wait (ktrans.kernels.triton.pdl), x
    after it."""
    pid = tl.program_id(0)
    rows_m = tl.arange(0, BM)
    rows_n = pid * BN + tl.arange(0, BN)
    mask_m, mask_n = rows_m < M, rows_n < N
    ks = tl.arange(0, BK)
    mask_k = ks < K
    w = tl.load(W + rows_n[:, None].to(tl.int64) * stride_w + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                other=0.0)
    enter(PDL)
    x = tl.load(X + rows_m[:, None] * stride_x + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    acc = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    for k0 in range(BK, K, BK):
        ks = k0 + tl.arange(0, BK)
        mask_k = ks < K
        w = tl.load(W + rows_n[:, None].to(tl.int64) * stride_w + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0)
        x = tl.load(X + rows_m[:, None] * stride_x + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _dense_gemv_kernel(X, W, Y, M, N, K, stride_x, stride_w, stride_y, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, PDL: tl.constexpr = False):
    acc = _dense_rows(X, W, M, N, K, stride_x, stride_w, BM, BN, BK, PDL)
    rows_m = tl.arange(0, BM)
    rows_n = tl.program_id(0) * BN + tl.arange(0, BN)
    tl.store(Y + rows_m[:, None] * stride_y + rows_n[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows_m < M)[:, None] & (rows_n < N)[None, :])


@triton.jit
def _dense_gemv_topk_kernel(X, W, Y, IDS, WTS, CNT, M, N, K, stride_x, stride_w, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                            RENORM: tl.constexpr, PDL: tl.constexpr = False):
    """The logits into Y ([M, N], contiguous) as _dense_gemv_kernel stores them; the last program to finish then
    routes every row from them: ids [M, TOP_K] int64 and weights in WTS's dtype. CNT: one count, zero between
    calls (the last program resets it)."""
    acc = _dense_rows(X, W, M, N, K, stride_x, stride_w, BM, BN, BK, PDL)
    rows_m = tl.arange(0, BM)
    rows_n = tl.program_id(0) * BN + tl.arange(0, BN)
    tl.store(Y + rows_m[:, None] * N + rows_n[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows_m < M)[:, None] & (rows_n < N)[None, :])
    tl.debug_barrier()  # every thread's logits stored before the count's release
    if tl.atomic_add(CNT, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for m in range(M):
            ks, ids, w = topk_softmax_row(Y + m * N, N, TOP_K, E_PAD, K_PAD, RENORM, True)
            tl.store(IDS + m * TOP_K + ks, ids.to(tl.int64), mask=ks < TOP_K)
            tl.store(WTS + m * TOP_K + ks, w.to(WTS.dtype.element_ty), mask=ks < TOP_K)
        tl.atomic_xchg(CNT, 0)


def dense_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ w [N, K]^T -> [M, N] in x's dtype, one launch."""
    m, k = x.shape
    n = w.shape[0]
    if not 0 < m <= MAX_ROWS or w.shape[1] != k:
        raise ValueError(f"dense_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (1-{MAX_ROWS} rows)")
    x = x if x.stride(1) == 1 else x.contiguous()
    # a copy made here is written by the kernel just before ours: no PDL (it reads weights before its wait)
    pdl = launch() if w.stride(1) == 1 else {"PDL": False}
    w = w if w.stride(1) == 1 else w.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _dense_gemv_kernel[(triton.cdiv(n, BN),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                              BM=triton.next_power_of_2(m), BN=BN, BK=BK, num_warps=4, **pdl)
    return y


def dense_gemv_topk(x: torch.Tensor, w: torch.Tensor, top_k: int, renorm: bool,
                    counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's gate and routing in one launch: x [M, K] (M <= MAX_ROWS), w [N, K] (N experts) -> (ids [M, top_k]
    int64, weights [M, top_k] in x's dtype, the logits [M, N] in x's dtype they were picked from), those of
    router.route(logits, top_k, renorm), the logits dense_gemv(x, w)'s up to summation order. `counter`: one
    int32 count on x's device, zero between calls (quant.counters gives them), not shared with a kernel that may run
    at the same time."""
    m, k = x.shape
    n = w.shape[0]
    if not 0 < m <= MAX_ROWS or w.shape[1] != k or not 0 < top_k <= n:
        raise ValueError(f"dense_gemv_topk: x {tuple(x.shape)}, w {tuple(w.shape)} and top_k {top_k} do not fit "
                         f"(1-{MAX_ROWS} rows, 1-{n} experts)")
    x = x if x.stride(1) == 1 else x.contiguous()
    pdl = launch() if w.stride(1) == 1 else {"PDL": False}
    w = w if w.stride(1) == 1 else w.contiguous()
    logits = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ids = torch.empty(m, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(m, top_k, dtype=x.dtype, device=x.device)
    _dense_gemv_topk_kernel[(triton.cdiv(n, BN),)](x, w, logits, ids, weights, counter, m, n, k, x.stride(0),
                                                   w.stride(0), BM=triton.next_power_of_2(m), BN=BN, BK=BK,
                                                   TOP_K=top_k, E_PAD=triton.next_power_of_2(n),
                                                   K_PAD=triton.next_power_of_2(top_k), RENORM=renorm,
                                                   num_warps=TOPK_WARPS, **pdl)
    return ids, weights, logits
