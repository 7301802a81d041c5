"""The CPU experts' hand-off as torch copies: the oracle of ktrans.kernels.triton.stage and the stream path's default
(ktrans.kernels.cpu_stream)."""
from __future__ import annotations

import torch


def stage_in(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, sx: torch.Tensor, sids: torch.Tensor,
             sw: torch.Tensor) -> None:
    """x, ids, weights [T, ...] into the staging's first T rows: three copies (device to host) and a cast."""
    t = x.shape[0]
    sx[:t].copy_(x.float(), non_blocking=True)
    sids[:t].copy_(ids, non_blocking=True)
    sw[:t].copy_(weights.float(), non_blocking=True)


def stage_out(src: torch.Tensor, rows: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The staging's first `rows` output rows on `device` in `dtype`: a copy (host to device), then a cast."""
    out = src[:rows].to(device, non_blocking=True)
    return out if out.dtype == dtype else out.to(dtype)
