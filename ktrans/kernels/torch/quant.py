"""Reference dequantization and matmul of the packed GGUF layout (ktrans.kernels.triton.quant_layout) in plain torch:
the oracle of the Triton quantized GEMV / GEMM and of the quantized MoE.

`dequantize_packed` computes ggml's arithmetic (w = (d * sc) * q - dmin * m in float32, one rounding per operation,
no fused multiply-add), so on the CPU it reproduces gguf-py's dequantize bit for bit, which the tests check.
"""
from __future__ import annotations

import torch

from ktrans.kernels.triton.quant_layout import QK, SUB, PackedWeight


def _fields(words: torch.Tensor, sub: int, bits: int, width: int) -> torch.Tensor:
    """Inverse of quant_layout._pack_bits: words [..., W] -> values [..., 256] in element order."""
    per = width // bits
    w = words.to(torch.int64) & ((1 << width) - 1)
    w = w.reshape(*words.shape[:-1], QK // sub // per, sub, 1)
    shifts = torch.arange(per, device=words.device, dtype=torch.int64) * bits
    vals = (w >> shifts) & ((1 << bits) - 1)                       # [.., group, i, field]
    return vals.transpose(-1, -2).reshape(*words.shape[:-1], QK)  # element (group * per + field) * sub + i


def codes_and_scales(p: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [.., NSB, N, 256] float32 integer codes, scale and min per sub-block [.., NSB, N, 256 / SUB])."""
    d = p.d.float()
    if p.qtype == "Q8_0":
        return p.lo.float(), d, torch.zeros_like(d)
    if p.qtype in ("Q4_K", "Q5_K"):
        q = _fields(p.lo, 32, 4, 32)
        if p.qtype == "Q5_K":
            q = q | (_fields(p.hi, 32, 1, 8) << 4)
        sc = p.sc.float()
        return q.float(), d[..., 0:1] * sc[..., :8], d[..., 1:2] * sc[..., 8:]
    if p.qtype == "Q6_K":
        q = (_fields(p.lo, 16, 4, 32) | (_fields(p.hi, 16, 2, 32) << 4)) - 32
        s = d * p.sc.float()
        return q.float(), s, torch.zeros_like(s)
    raise ValueError(f"unknown packed type {p.qtype}")


def dequantize_packed(p: PackedWeight) -> torch.Tensor:
    """The float32 weights [N, K] (or [E, N, K]) of a packed matrix, as gguf-py dequantizes its blocks."""
    q, s, m = codes_and_scales(p)
    sub = SUB[p.qtype]
    q = q.reshape(*q.shape[:-1], QK // sub, sub)
    w = s[..., None] * q - m[..., None]                         # [.., NSB, N, subs, sub]
    w = w.reshape(*w.shape[:-2], QK).movedim(-3, -2)            # [.., N, NSB, 256]
    return w.reshape(*w.shape[:-2], p.k)


def quant_linear(x: torch.Tensor, p: PackedWeight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """x [M, K] @ W^T on the dequantized weights, in `dtype` (float64: an exact oracle for the fp32 kernels)."""
    return x.to(dtype) @ dequantize_packed(p).to(dtype).T
