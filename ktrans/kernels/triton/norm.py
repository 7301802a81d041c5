"""Qwen3-Next's RMSNorms in Triton: the zero-centred norm (optionally fused with the residual add) and the gated
DeltaNet output norm.

The oracles are `rms_norm` and `rms_norm_gated` in `ktrans/operators/norm.py` (HF's Qwen3NextRMSNorm and
Qwen3NextRMSNormGated). Both compute in fp32 and round where HF rounds, so a bf16 model gets the same values up to
the order of the fp32 sum:

- `rms_norm(x, w, eps, residual)`: with a residual, s = x + residual is first rounded to x's dtype (the plain
  `x + h` of the decoder layer), stored as the new residual, and s is normed: one read of each input, two writes.
- `rms_norm_gated(x, gate, w, eps)`: the normed x is rounded to the dtype before the (plain, not zero-centred)
  weight, the product rounded again, then times SiLU(gate) in fp32.

Rows are the last dimension; several short rows (head_dim 128..256) share one program so a launch over [T * H, D]
is not one tiny program per row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter, launch


def _rows_and_block(d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    return max(1, min(16, 4096 // block_d)), block_d


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, D] with a unit stride along D (a view when it can be one, e.g. q's half of q_proj's output)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def _rms_norm_kernel(X, R, W, O, RO, n_rows, stride_x, stride_r, stride_o, stride_ro, eps, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like the plain add it replaces
        tl.store(RO + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = xf * rstd[:, None] * (1.0 + w[None, :])
    tl.store(O + rows[:, None] * stride_o + cols[None, :], out.to(O.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x / rms(x) * (1 + weight) in x's dtype; with `residual`, (norm(x + residual), x + residual)."""
    shape, d = x.shape, x.shape[-1]
    x2 = _as_rows(x)
    n = x2.shape[0]
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    r2 = _as_rows(residual) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    rows, block_d = _rows_and_block(d)
    if n:
        _rms_norm_kernel[(triton.cdiv(n, rows),)](x2, r2, weight, out, res_out, n, x2.stride(0), r2.stride(0),
                                                  out.stride(0), res_out.stride(0), eps, D=d, BLOCK_D=block_d,
                                                  ROWS=rows, HAS_RES=residual is not None, **launch())
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def gated_rows(x, g, w, eps, D: tl.constexpr):
    """RMSNorm(x) * w * SiLU(g) of the rows of x [rows, BLOCK_D] (columns past D zero) in fp32, rounded to x's dtype
    where HF's Qwen3NextRMSNormGated rounds: the normed x before the weight, the weighted product before the gate.
    Shared by the norm's launch and the DeltaNet decode step's fused form (gated_delta_decode's `norm`)."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps)
    normed = (xf * rstd[:, None]).to(x.dtype)
    weighted = (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    gf = g.to(tl.float32)
    return weighted.to(tl.float32) * (gf * tl.sigmoid(gf))


@triton.jit
def _rms_norm_gated_kernel(X, G, W, O, n_rows, stride_x, stride_g, stride_o, eps, D: tl.constexpr,
                           BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    w = tl.load(W + cols, mask=cols < D, other=0.0)
    tl.store(O + rows[:, None] * stride_o + cols[None, :], gated_rows(x, g, w, eps, D).to(O.dtype.element_ty),
             mask=mask)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * SiLU(gate) over the last dim, in x's dtype (the DeltaNet output norm)."""
    shape, d = x.shape, x.shape[-1]
    x2, g2 = _as_rows(x), _as_rows(gate)
    n = x2.shape[0]
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    rows, block_d = _rows_and_block(d)
    if n:
        _rms_norm_gated_kernel[(triton.cdiv(n, rows),)](x2, g2, weight, out, n, x2.stride(0), g2.stride(0),
                                                        out.stride(0), eps, D=d, BLOCK_D=block_d, ROWS=rows, **launch())
    return out.view(shape)
