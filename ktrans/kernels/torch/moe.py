"""Reference routed-experts MoE (what the C++ CPUMoE computes) in plain torch.

out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]) with e = ids[t, k], on float expert weights
stacked like GGUF's ffn_*_exps: gate, up [E, I, H]; down [E, H, I]. Negative ids are skipped. One matmul per
distinct expert over the tokens routed to it, in the weights' dtype (float64 in tests for an exact oracle).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """x [T, H]; ids [T, K] int; weights [T, K]; returns [T, H] in the weights' dtype."""
    dtype = gate.dtype
    xd = x.to(dtype)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = xd[tok]
        h = F.silu(xe @ gate[e].T) * (xe @ up[e].T)
        out.index_add_(0, tok, (h @ down[e].T) * weights[tok, slot, None].to(dtype))
    return out


def split_resident(ids: torch.Tensor, slot_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, cpu_ids) like ids [T, k]: a pair whose expert has a resident slot (slot_of [E] >= 0) gets it in slots
    and -1 in cpu_ids; any other pair, a masked one (-1) or one past the table included, -1 in slots and its id in
    cpu_ids."""
    inside = (ids >= 0) & (ids < slot_of.numel())
    slots = torch.where(inside, slot_of[ids.clamp(0, slot_of.numel() - 1)].to(ids.dtype), -1)
    return slots, torch.where(slots >= 0, -1, ids)
