"""KTransformersLinear: a torch.nn.Linear replaced by a phase-aware operator with a choice of kernels.

KLinearTorch (F.linear on float weights, CPU or CUDA), KLinearCPUInfer (the C++ quantized dense kernel on the
stored GGUF blocks, ktrans.operators.linear_cpu) and KLinearMarlin (the Triton quantized GEMV/GEMM on the GGUF blocks
repacked for the GPU, ktrans.operators.linear_marlin; on the CPU only under Triton's interpreter) are built; the last
two are imported when a rule names them. KTransformers' VLinearMarlin maps to KLinearMarlin.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, load_param, move, register_operator
from ktrans.weights.source import WeightSource

LINEAR_OPS = OpRegistry("linear")
LINEAR_OPS.declare("KLinearMarlin", devices=("cuda",), module="ktrans.operators.linear_marlin",
                   provided_by="ktrans.operators.linear_marlin (Triton kernels on the GGUF blocks; needs triton)",
                   aliases=("VLinearMarlin",))
LINEAR_OPS.declare("KLinearCPUInfer", devices=("cpu",), module="ktrans.operators.linear_cpu",
                   provided_by="the C++ CPU kernels issue (ktrans._cpu dense quantized linear)")


@LINEAR_OPS.register("KLinearTorch", devices=("cpu", "cuda"), float_weights=True)
class KLinearTorch(Op):
    """y = x W^T (+ b) with W in the model dtype: the reference every other linear op is compared with."""

    def __init__(self, operator: "KTransformersLinear", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.specs = operator.param_specs()
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        self.weight = load_param(source, self.specs[0], dtype, self.device)
        if len(self.specs) > 1:
            self.bias = load_param(source, self.specs[1], dtype, self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@register_operator()
class KTransformersLinear(BaseOperator):
    REPLACES = (nn.Linear,)
    OPS = LINEAR_OPS
    DEFAULT_OP = "KLinearTorch"
    # Read by KLinearCPUInfer: `quant` ("Q8_0", "Q4_K", "Q5_K", "Q6_K") quantizes a float checkpoint's weight at load;
    # `repack` (default true) repacks Q4_K / Q5_K weights 16 rows at a time for the AVX-512 kernels.
    EXTRA_KWARGS = {"quant": str, "repack": bool}

    def __init__(self, key, orig: nn.Linear, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.in_features = orig.in_features
        self.out_features = orig.out_features
        self.has_bias = orig.bias is not None

    def param_specs(self) -> list[ParamSpec]:
        specs = [ParamSpec(f"{self.key}.weight", (self.out_features, self.in_features))]
        if self.has_bias:
            specs.append(ParamSpec(f"{self.key}.bias", (self.out_features,)))
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        return self.leave(self.op_for(phase)(move(x, dev)), phase)


# One-row decode steps run two projections of one input, of one type and width, in one GEMV launch where both are
# KLinearMarlin matrices (ktrans.kernels.triton.quant.qlinear_pair): a DeltaNet's in_proj_ba with the part of
# in_proj_qkvz of its type, two of an attention layer's q/k/v projections; off until measured on a GPU
# (KTRANS_GEMV_PAIR=1 turns it on).
GEMV_PAIR = os.environ.get("KTRANS_GEMV_PAIR", "0") == "1"


def pair_of(mats) -> tuple[int, int] | None:
    """The first two of `mats` (packed matrices) of one type and width, which one GEMV launch takes together."""
    return next(((i, j) for i in range(len(mats)) for j in range(i + 1, len(mats))
                 if (mats[i].qtype, mats[i].k) == (mats[j].qtype, mats[j].k)), None)


def project(x: torch.Tensor, *linears: "KTransformersLinear") -> list[torch.Tensor]:
    """Each of `linears` applied to x, as calling them one by one would. Where every one of them runs an op that can
    queue its work and return (`begin`: KLinearCPUInfer) on x's device, all are queued before any is waited for, so
    the CPU pool goes from one projection to the next without a round trip through Python between them (a CPU-only
    decode step has ~30 small projections)."""
    ops = []
    for lin in linears:
        if not isinstance(lin, KTransformersLinear):
            return [lin(x) for lin in linears]
        phase, dev = lin.phase_device()
        op = lin.op_for(phase)
        if not hasattr(op, "begin") or dev != x.device or lin.out_devices[phase] != dev:
            return [lin(x) for lin in linears]
        ops.append(op)
    finishes = [op.begin(x) for op in ops]
    return [f() for f in finishes]
