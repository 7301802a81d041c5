"""KQwen3NextRMSNorm: the zero-centred RMSNorm of Qwen3-Next (x / rms(x) * (1 + w), in fp32) as an operator."""
from __future__ import annotations

import torch

from ktrans.model.qwen3_next import Qwen3NextRMSNorm
from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, load_param, move, register_operator
from ktrans.weights.source import WeightSource

NORM_OPS = OpRegistry("rmsnorm")


@NORM_OPS.register("KRMSNormTorch", devices=("cpu", "cuda"))
class KRMSNormTorch(Op):
    def __init__(self, operator: "KQwen3NextRMSNorm", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.spec = operator.param_specs()[0]
        self.eps = operator.eps
        self.weight = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        self.weight = load_param(source, self.spec, dtype, self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The same expression as Qwen3NextRMSNorm.forward: the injected model must match the plain one bit for bit.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


@register_operator()
class KQwen3NextRMSNorm(BaseOperator):
    REPLACES = (Qwen3NextRMSNorm,)
    OPS = NORM_OPS
    DEFAULT_OP = "KRMSNormTorch"

    def __init__(self, key, orig: Qwen3NextRMSNorm, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.eps = orig.eps
        self.dim = orig.weight.shape[0]

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(f"{self.key}.weight", (self.dim,))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        return self.leave(self.op_for(phase)(move(x, dev)), phase)
