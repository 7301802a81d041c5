"""KQwen3NextRotaryEmbedding: cos/sin tables of the partial NeoX RoPE, computed on the operator's device.

It has no checkpoint tensors: inv_freq follows from the config, so each op builds it where it runs. `apply_rope`
is here too: the RoPE math of the network, once. The op hands the attention layers RopeTables, which carry the
way they are applied: the reference's `apply_rope` on q and on k, or KRoPETriton's one in-place launch for both
(`ktrans/operators/layers_triton.py`), so choosing the rotary op by rule also chooses how q and k are rotated.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ktrans.config import ModelConfig
from ktrans.model.qwen3_next import Qwen3NextRotaryEmbedding
from ktrans.operators.base import BaseOperator, Op, OpRegistry, move, register_operator

ROPE_OPS = OpRegistry("rotary embedding")
ROPE_OPS.declare("KRoPETriton", devices=("cuda", "cpu"), module="ktrans.operators.layers_triton",
                 provided_by="triton (the cpu device only under TRITON_INTERPRET=1)")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies of the first head_dim * partial_rotary_factor dims."""
    dim = config.rotary_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] in `dtype` for positions [T]."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, rotary_dim]. Rotates the first rotary_dim dims (NeoX halves), passes the rest."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((rot, rest), dim=-1)


class RopeTables(NamedTuple):
    """cos, sin [T, rotary_dim] of one step, and (by subclass) how they are applied to q and k."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated (new tensors here; a subclass may rotate in place)."""
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)


@ROPE_OPS.register("KRoPETorch", devices=("cpu", "cuda"))
class KRoPETorch(Op):
    def __init__(self, operator: "KQwen3NextRotaryEmbedding", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.config = operator.config
        self.inv_freq = None

    def load(self, source, dtype: torch.dtype) -> None:
        # Built, not loaded: the tables follow from the config.
        self.inv_freq = rope_inv_freq(self.config).to(self.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        return RopeTables(*rope_cos_sin(positions, self.inv_freq, dtype))


@register_operator("KQwen3MoeRotaryEmbedding", "RotaryEmbedding")
class KQwen3NextRotaryEmbedding(BaseOperator):
    REPLACES = (Qwen3NextRotaryEmbedding,)
    OPS = ROPE_OPS
    DEFAULT_OP = "KRoPETorch"

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        phase, dev = self.phase_device()
        return self.leave(self.op_for(phase)(move(positions, dev), dtype), phase)
