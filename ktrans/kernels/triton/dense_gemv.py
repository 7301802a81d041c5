"""A few activation rows times a float matrix (y = x W^T, W [N, K] bf16 / fp16 / fp32), in Triton: the decode-step
projections a GGUF keeps as floats (the MoE router's gate, F32 in the file and bf16 on the GPU), which KLinearMarlin
otherwise multiplies with F.linear. At one row cuBLAS took 5.4 us for the 80B's [512, 2048] router gate on the H200
(doc/benchmarks.md, session 15: 48 calls a token), for 2 MiB of weights.

One program per BN rows of W reads them once for all M <= MAX_ROWS activation rows, K in BK-wide steps, products in
fp32 and one reduction per step; the result is rounded once to x's dtype. The oracle is F.linear in fp32.
`dense_route` adds the router's top-k to the same launch (its oracle: dense_gemv, then ktrans.kernels.triton.router).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter, launch
from ktrans.kernels.triton.router import route_row

MAX_ROWS = 4  # activation rows this path takes (decode); more go to the caller's GEMM
BN, BK = 4, 512


@triton.jit
def _rows_times_w(X, W, Y, M, N, K, stride_x, stride_w, stride_y, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, PDL: tl.constexpr):
    """Rows pid*BN.. of y = x W^T, K in steps of BK, stored in Y's dtype. The first step's weights (resident: written
    before the last sync, never by a kernel of the step) are loaded before the PDL wait (ktrans.kernels.triton.pdl),
    x after it."""
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
    tl.store(Y + rows_m[:, None] * stride_y + rows_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dense_gemv_kernel(X, W, Y, M, N, K, stride_x, stride_w, stride_y, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, PDL: tl.constexpr = False):
    _rows_times_w(X, W, Y, M, N, K, stride_x, stride_w, stride_y, BM, BN, BK, PDL)


@triton.jit
def _dense_route_kernel(X, W, Y, IDS, RW, CNT, M, N, K, stride_x, stride_w, stride_y, n_experts, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
                        K_PAD: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr = False):
    """_dense_gemv_kernel's logits, then the last program to finish (counted at CNT, zero between calls) routes
    every row from them as the top-k launch does (router.route_row, the logits read from L2) and zeroes the count."""
    _rows_times_w(X, W, Y, M, N, K, stride_x, stride_w, stride_y, BM, BN, BK, PDL)
    tl.debug_barrier()  # every thread's logits stored before the count's release
    if tl.atomic_add(CNT, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for row in range(M):
            route_row(Y, IDS, RW, row, stride_y, n_experts, TOP_K, E_PAD, K_PAD, RENORM, SHARED, True)
        tl.atomic_xchg(CNT, 0)


def _operands(name: str, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(x, w, the PDL launch option) for a kernel of this module: the sizes checked (`name` in the error), both
    with unit stride along K."""
    if not 0 < x.shape[0] <= MAX_ROWS or w.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (1-{MAX_ROWS} rows)")
    x = x if x.stride(1) == 1 else x.contiguous()
    # a copy made here is written by the kernel just before ours: no PDL (it reads weights before its wait)
    pdl = launch() if w.stride(1) == 1 else {"PDL": False}
    return x, w if w.stride(1) == 1 else w.contiguous(), pdl


def dense_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ w [N, K]^T -> [M, N] in x's dtype, one launch."""
    x, w, pdl = _operands("dense_gemv", x, w)
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _dense_gemv_kernel[(triton.cdiv(n, BN),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                              BM=triton.next_power_of_2(m), BN=BN, BK=BK, num_warps=4, **pdl)
    return y


def dense_route(x: torch.Tensor, w: torch.Tensor, top_k: int, norm_topk_prob: bool,
                shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits x [M, K] @ w [N, K]^T (M <= MAX_ROWS, x cast to w's dtype) and the top-k routing of each
    row from them in one launch: (ids, weights) as router.route(dense_gemv(x, w)) gives them (shared=False: N
    experts, weights in x's dtype) or router.route_with_shared(dense_gemv(x, w)) (shared=True: the last row of w is
    the shared expert's gate, weights fp32): the same logits bitwise, so the same ids; the weights' sums are reduced
    over four warps here and one there, so they may differ in fp32's last bit. The row tiles' last program to
    finish does the top-k, where the two launches took a second launch a layer (48 a decoded token at the 80B's
    shapes); its count is quant.counters' last, past the split sums' row-tile counts."""
    from ktrans.kernels.triton.quant import _MAX_TILES, counters

    x, w, pdl = _operands("dense_route", x.to(w.dtype), w)  # x cast as KLinearMarlin's float part casts it
    (m, k), n = x.shape, w.shape[0]
    e = n - 1 if shared else n
    if not 0 < top_k <= e:
        raise ValueError(f"dense_route: top_k {top_k} of {e} experts")
    logits = torch.empty(m, n, dtype=x.dtype, device=x.device)
    slots = top_k + 1 if shared else top_k
    ids = torch.empty(m, slots, dtype=torch.int64, device=x.device)
    weights = torch.empty(m, slots, dtype=torch.float32 if shared else x.dtype, device=x.device)
    cnt = counters(x.device)[_MAX_TILES:]
    _dense_route_kernel[(triton.cdiv(n, BN),)](x, w, logits, ids, weights, cnt, m, n, k, x.stride(0), w.stride(0),
                                               logits.stride(0), e, BM=triton.next_power_of_2(m), BN=BN, BK=BK,
                                               TOP_K=top_k, E_PAD=triton.next_power_of_2(e),
                                               K_PAD=triton.next_power_of_2(slots), RENORM=norm_topk_prob,
                                               SHARED=shared, num_warps=4, **pdl)
    return ids, weights
