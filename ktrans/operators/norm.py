"""KQwen3NextRMSNorm: the zero-centred RMSNorm of Qwen3-Next (x / rms(x) * (1 + w), in fp32) as an operator.

The two RMSNorm expressions of the network live here, once: `rms_norm` (every layer norm, q/k norms) and
`rms_norm_gated` (the DeltaNet output norm, which the DeltaNet op applies). Called with a residual, the operator
also does the decoder layer's residual add before the norm and returns (normed, new residual): the add+norm pair
is one kernel in KRMSNormTriton (`ktrans/operators/layers_triton.py`), and the same two ops in KRMSNormTorch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktrans.model.qwen3_next import Qwen3NextRMSNorm
from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, load_param, move, register_operator
from ktrans.weights.source import WeightSource

NORM_OPS = OpRegistry("rmsnorm")
NORM_OPS.declare("KRMSNormTriton", devices=("cuda", "cpu"), module="ktrans.operators.layers_triton",
                 provided_by="triton (the cpu device only under TRITON_INTERPRET=1)")
NORM_OPS.declare("KRMSNormCPU", devices=("cpu",), module="ktrans.operators.layers_cpu",
                 provided_by="the C++ extension (ktrans._cpu)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + weight), computed in fp32, returned in x's dtype (HF's Qwen3NextRMSNorm)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeltaNet output norm: RMSNorm with a plain (not zero-centred) weight, then times SiLU(gate)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)  # HF rounds to the input dtype before the weight; keep that for parity
    return (out * F.silu(gate.float())).to(dtype)


@NORM_OPS.register("KRMSNormTorch", devices=("cpu", "cuda"))
class KRMSNormTorch(Op):
    def __init__(self, operator: "KQwen3NextRMSNorm", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.spec = operator.param_specs()[0]
        self.eps = operator.eps
        self.weight = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        self.weight = load_param(source, self.spec, dtype, self.device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = residual + x
        return rms_norm(x, self.weight, self.eps), x


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(residual + x), residual + x): the decoder layer's add and norm."""
        phase, dev = self.phase_device()
        if residual is None:
            return self.leave(self.op_for(phase)(move(x, dev)), phase)
        return self.leave(self.op_for(phase)(move(x, dev), move(residual, dev)), phase)
