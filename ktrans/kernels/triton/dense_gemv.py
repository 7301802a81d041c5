"""A few activation rows times a float matrix (y = x W^T, W [N, K] bf16 / fp16 / fp32), in Triton: the decode-step
projections a GGUF keeps as floats (the MoE router's gate, F32 in the file and bf16 on the GPU), which KLinearMarlin
otherwise multiplies with F.linear. At one row cuBLAS took 5.4 us for the 80B's [512, 2048] router gate on the H200
(doc/benchmarks.md, session 15: 48 calls a token), for 2 MiB of weights.

One program per BN rows of W reads them once for all M <= MAX_ROWS activation rows, K in BK-wide steps, products in
fp32 and one reduction per step; the result is rounded once to x's dtype. The oracle is F.linear in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter, launch

MAX_ROWS = 4  # activation rows this path takes (decode); more go to the caller's GEMM
BN, BK = 4, 512


@triton.jit
def _dense_gemv_kernel(X, W, Y, M, N, K, stride_x, stride_w, stride_y, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, PDL: tl.constexpr = False):
    """Rows pid*BN.. of y = x W^T, K in steps of BK. The first step's weights (resident: written before the last
    sync, never by a kernel of the step) are loaded before the PDL wait (ktrans.kernels.triton.pdl), x after it."""
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
