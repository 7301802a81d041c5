"""KQwen3NextRotaryEmbedding: cos/sin tables of the partial NeoX RoPE, computed on the operator's device.

It has no checkpoint tensors: inv_freq follows from the config, so each op builds it where it runs.
"""
from __future__ import annotations

import torch

from ktrans.model.qwen3_next import Qwen3NextRotaryEmbedding
from ktrans.operators.base import BaseOperator, Op, OpRegistry, move, register_operator

ROPE_OPS = OpRegistry("rotary embedding")


@ROPE_OPS.register("KRoPETorch", devices=("cpu", "cuda"))
class KRoPETorch(Op):
    def __init__(self, operator: "KQwen3NextRotaryEmbedding", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.config = operator.config
        self.rope = None

    def load(self, source, dtype: torch.dtype) -> None:
        # Built, not loaded: the same module the plain model uses, so the tables are identical.
        self.rope = Qwen3NextRotaryEmbedding(self.config).to(self.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(positions, dtype)


@register_operator("KQwen3MoeRotaryEmbedding", "RotaryEmbedding")
class KQwen3NextRotaryEmbedding(BaseOperator):
    REPLACES = (Qwen3NextRotaryEmbedding,)
    OPS = ROPE_OPS
    DEFAULT_OP = "KRoPETorch"

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        phase, dev = self.phase_device()
        return self.leave(self.op_for(phase)(move(positions, dev), dtype), phase)
