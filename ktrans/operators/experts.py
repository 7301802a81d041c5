"""KTransformersExperts: the routed experts of one MoE layer, with an asynchronous submit()/sync() interface.

The MoE block submits the routed experts, runs the shared expert meanwhile, then syncs: with the C++ KExpertsCPU op
the CPU cores stream expert weights while the GPU works. KExpertsTorch (built now) computes inside submit(), so its
"async" is synchronous, but callers already use the two-step interface.

Expert ops plug in by name through EXPERT_OPS. KExpertsCPU is declared here and registered by the module
`ktrans.operators.experts_cpu` (the C++ experts issue), roughly:

    from ktrans.operators.experts import EXPERT_OPS, ExpertsOp

    @EXPERT_OPS.register("KExpertsCPU", devices=("cpu",))
    class KExpertsCPU(ExpertsOp):
        def load(self, source, dtype): ...  # source.raw_experts(self.key, "gate_proj", self.num_experts), ...
        def submit(self, x, topk_ids, topk_weights): ...  # start the work, return at once
        def sync(self): ...  # wait, return [T, hidden] in x's dtype on self.device

When the prefill placement differs from the generate one (Qwen3Next-serve.yaml: prefill on cuda, decode on cpu),
the prefill op is *streaming*: it keeps no weights resident and reads the experts a batch routes to from the
WeightSource on each call. Memory is then planned for the decode placement only; GPU prefill of experts pays a
host-to-device copy per layer (a pinned staging buffer is future work).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktrans.model.qwen3_next import Qwen3NextExperts
from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, move, register_operator
from ktrans.runtime.batch import current_phase
from ktrans.weights.source import WeightSource

EXPERT_OPS = OpRegistry("experts")
EXPERT_OPS.declare("KExpertsCPU", devices=("cpu",), module="ktrans.operators.experts_cpu",
                   provided_by="the C++ CPU expert kernels (ktrans._cpu, issue 5)")
EXPERT_OPS.declare("KExpertsMarlin", devices=("cuda",), module="ktrans.operators.experts_marlin",
                   provided_by="the GPU kernels issue")

PROJS = ("gate_proj", "up_proj", "down_proj")


class _ExpertWeights(nn.ParameterList):
    """One matrix per expert; printed as a count, not 512 lines."""

    def extra_repr(self) -> str:
        return f"{len(self)} x {tuple(self[0].shape)} {self[0].dtype}" if len(self) else "empty"


class ExpertsOp(Op):
    """Contract of an expert op: submit(x [T, H], topk_ids [T, k], topk_weights [T, k]) starts
    sum_k w_k * down(silu(gate x) * up x); sync() returns it [T, H] in x's dtype. One submit, then one sync."""

    def __init__(self, operator: "KTransformersExperts", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.num_experts = operator.num_experts
        self.hidden_size = operator.hidden_size
        self.intermediate_size = operator.intermediate_size
        self.specs = operator.param_specs()

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        raise NotImplementedError

    def sync(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(x, topk_ids, topk_weights)
        return self.sync()


@EXPERT_OPS.register("KExpertsTorch", devices=("cpu", "cuda"))
class KExpertsTorch(ExpertsOp):
    """Per-expert F.linear in the model dtype, the same sequence of operations as the plain Qwen3NextExperts."""

    def __init__(self, operator, device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.w = nn.ModuleDict()  # proj -> ParameterList over experts; views of the mmap when dtypes agree
        self.source: WeightSource | None = None
        self._result: torch.Tensor | None = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        by_proj = {p: [] for p in PROJS}
        for spec in self.specs:  # ordered expert by expert, gate/up/down
            proj = spec.name.rsplit(".", 2)[-2]
            by_proj[proj].append(nn.Parameter(source.require(spec.name, spec.shape, dtype, self.device),
                                              requires_grad=False))
        for p in PROJS:
            self.w[p] = _ExpertWeights(by_proj[p])

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.streaming:
            return tuple(self.w[p][e] for p in PROJS)
        # Streaming (prefill away from the decode placement): fetch this expert now; freed after the call.
        return tuple(self.source.get(f"{self.key}.{e}.{p}.weight", self.dtype, self.device) for p in PROJS)

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._result is not None:
            raise RuntimeError(f"{self.key}: submit() called twice without sync()")
        out = torch.zeros_like(x)
        for e in torch.unique(topk_ids).tolist():
            tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            gate, up, down = self._weights(e)
            xe = x[tok]
            y = F.linear(F.silu(F.linear(xe, gate)) * F.linear(xe, up), down) * topk_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        self._result = out

    def sync(self) -> torch.Tensor:
        if self._result is None:
            raise RuntimeError(f"{self.key}: sync() without submit()")
        out, self._result = self._result, None
        return out


@register_operator("KTransformersExpertsV2")
class KTransformersExperts(BaseOperator):
    REPLACES = (Qwen3NextExperts,)
    OPS = EXPERT_OPS
    DEFAULT_OP = "KExpertsTorch"
    STREAM_PREFILL = True
    # Read by KExpertsCPU: `quant` repacks float checkpoints at load ("Q8_0", "Q4_K", ..., "BF16", "F32");
    # `hugepages` (default true) copies the expert weights into transparent huge pages instead of reading the GGUF
    # file's 4 KiB-page mmap (3-4% faster decode on the 16-core Xeon, 5-8% on a 2-core Zen 4; doc/benchmarks.md).
    # `repack` (default true) repacks Q4_K and Q5_K experts 16 rows at a time for the AVX-512 kernels (Q4_K_X16,
    # Q5_K_X16; see ktrans.kernels.cpu.CPUMoE).
    EXTRA_KWARGS = {"quant": str, "hugepages": bool, "repack": bool, "cpu_config": dict}

    def __init__(self, key, orig: Qwen3NextExperts, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.num_experts = len(orig)
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_intermediate_size
        self._pending: tuple[str, Op] | None = None  # between submit and sync of one step, never across steps

    def param_specs(self) -> list[ParamSpec]:
        h, i = self.hidden_size, self.intermediate_size
        shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        return [ParamSpec(f"{self.key}.{e}.{p}.weight", shapes[p]) for e in range(self.num_experts) for p in PROJS]

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        phase = current_phase()
        dev = self.devices[phase]
        op = self.op_for(phase)
        op.submit(move(x, dev), move(topk_ids, dev), move(topk_weights, dev))
        self._pending = (phase, op)

    def sync(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError(f"{self.key}: sync() without submit()")
        (phase, op), self._pending = self._pending, None
        return self.leave(op.sync(), phase)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(x, topk_ids, topk_weights)
        return self.sync()
