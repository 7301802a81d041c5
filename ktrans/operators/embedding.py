"""KEmbedding: the token embedding table as an operator (KTransformers keeps it with `class: default`; both work)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, load_param, move, register_operator
from ktrans.weights.source import WeightSource

EMBEDDING_OPS = OpRegistry("embedding")


@EMBEDDING_OPS.register("KEmbeddingTorch", devices=("cpu", "cuda"))
class KEmbeddingTorch(Op):
    def __init__(self, operator: "KEmbedding", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.spec = operator.param_specs()[0]
        self.weight = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        self.weight = load_param(source, self.spec, dtype, self.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


@register_operator()
class KEmbedding(BaseOperator):
    REPLACES = (nn.Embedding,)
    OPS = EMBEDDING_OPS
    DEFAULT_OP = "KEmbeddingTorch"

    def __init__(self, key, orig: nn.Embedding, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.shape = tuple(orig.weight.shape)

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(f"{self.key}.weight", self.shape)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        return self.leave(self.op_for(phase)(move(ids, dev)), phase)
