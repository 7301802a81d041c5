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

import re

import torch
import torch.nn.functional as F
from torch import nn

from ktrans.model.qwen3_next import Qwen3NextExperts
from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, move, register_operator, use_device
from ktrans.runtime.batch import GENERATE, current_phase
from ktrans.weights.source import WeightSource

EXPERT_OPS = OpRegistry("experts")
EXPERT_OPS.declare("KExpertsCPU", devices=("cpu",), module="ktrans.operators.experts_cpu",
                   provided_by="the C++ CPU expert kernels (ktrans._cpu, issue 5)")
EXPERT_OPS.declare("KExpertsSplit", devices=("cuda",), module="ktrans.operators.experts_split",
                   provided_by="ktrans.operators.experts_split (prefill split between the CPU experts and the Triton "
                               "MoE on the GPU; needs triton)")
EXPERT_OPS.declare("KExpertsMarlin", devices=("cuda",), module="ktrans.operators.experts_marlin",
                   provided_by="ktrans.operators.experts_marlin (the Triton MoE on the GGUF blocks; needs triton)")

PROJS = ("gate_proj", "up_proj", "down_proj")


def layer_index(key: str, op: str) -> int:
    """The layer of an experts module name (`model.layers.7.mlp.experts` -> 7): GGUF stores experts per layer."""
    m = re.search(r"layers\.(\d+)\.", key)
    if not m:
        raise ValueError(f"{op}: cannot tell the layer of {key!r}")
    return int(m.group(1))


class ExpertsOp(Op):
    """Contract of an expert op: submit(x [T, H], topk_ids [T, k], topk_weights [T, k]) starts
    sum_k w_k * down(silu(gate x) * up x); sync() returns it [T, H] in x's dtype. One submit, then one sync."""

    def __init__(self, operator: "KTransformersExperts", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.num_experts = operator.num_experts
        self.hidden_size = operator.hidden_size
        self.intermediate_size = operator.intermediate_size
        self.specs = operator.param_specs()

    def input_device(self, device: torch.device) -> torch.device:
        """Where submit() wants its inputs when the caller has them on `device` (default: the op's own device)."""
        return self.device

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        raise NotImplementedError

    def sync(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(x, topk_ids, topk_weights)
        return self.sync()


@EXPERT_OPS.register("KExpertsTorch", devices=("cpu", "cuda"), float_weights=True)
class KExpertsTorch(ExpertsOp):
    """The reference expert op: float weights in the model dtype, stacked per projection like GGUF's ffn_*_exps
    (gate, up [E, I, H]; down [E, H, I]).

    Prefill groups tokens by expert (one matmul per routed expert; finding the groups reads the routing back to
    the host). A decode step must not read the device, so it gathers each token's k experts' weights and runs
    batched matmuls instead: w[ids] @ x, no host sync, at the cost of copying k matrices per token (fine at decode
    batch sizes; chunked so the gathered copies stay under GATHER_BYTES).
    """

    GATHER_BYTES = 256 << 20

    def __init__(self, operator, device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.w = nn.ParameterDict()  # proj -> [E, out, in]; w[proj][e] is expert e's matrix
        self.source: WeightSource | None = None
        self._result: torch.Tensor | None = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        by_proj = {p: [s for s in self.specs if s.name.rsplit(".", 2)[-2] == p] for p in PROJS}
        for p, specs in by_proj.items():  # expert by expert, in order
            stacked = torch.empty(len(specs), *specs[0].shape, dtype=dtype, device=self.device)
            for e, spec in enumerate(specs):
                stacked[e].copy_(source.require(spec.name, spec.shape, dtype, self.device))
            self.w[p] = nn.Parameter(stacked, requires_grad=False)

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.streaming:
            return tuple(self.w[p][e] for p in PROJS)
        # Streaming (prefill away from the decode placement): fetch this expert now; freed after the call.
        return tuple(self.source.get(f"{self.key}.{e}.{p}.weight", self.dtype, self.device) for p in PROJS)

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._result is not None:
            raise RuntimeError(f"{self.key}: submit() called twice without sync()")
        if current_phase() == GENERATE and not self.streaming:
            self._result = self._gathered(x, topk_ids, topk_weights)
        else:
            self._result = self._grouped(x, topk_ids, topk_weights)

    def _grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(topk_ids).tolist():
            tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            gate, up, down = self._weights(e)
            xe = x[tok]
            y = F.linear(F.silu(F.linear(xe, gate)) * F.linear(xe, up), down) * topk_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _gathered(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self.w[p] for p in PROJS)
        t, k = topk_ids.shape
        per_token = k * sum(w[0].numel() for w in (gate, up, down)) * gate.element_size()
        step = max(1, self.GATHER_BYTES // per_token)
        outs = []
        for s in range(0, t, step):  # over token counts, known on the host
            ids = topk_ids[s: s + step].reshape(-1)
            n = ids.shape[0] // k
            xs = x[s: s + step, None, :].expand(n, k, x.shape[-1]).reshape(n * k, -1, 1)  # [N, H, 1]
            h = F.silu(torch.bmm(gate[ids], xs)) * torch.bmm(up[ids], xs)                 # [N, I, 1]
            y = torch.bmm(down[ids], h).view(n, k, -1) * topk_weights[s: s + step, :, None]
            outs.append(y.sum(dim=1).to(x.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

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
    # Read by KExpertsSplit (the prefill op that splits a chunk's experts between the CPU and the GPU):
    # `gpu_prefill_min_tokens` (default 512): steps with fewer tokens run on the CPU experts alone; `cpu_share` (a
    # number in [0, 1]): the CPU's share of each layer's experts, fixed (default: balanced from measured rates);
    # `cpu_on_stream` (default false): the CPU's share enqueued on the CUDA stream as decode's is, not yet measured
    # at full size (see ktrans.operators.experts_split).
    # Read by KExpertsCPU: `gpu_experts` (default 0): experts 0..N-1 of each layer also resident on `gpu_device`
    # (default "cuda"), where the pairs routed to them run beside the CPU's share (opt-in, not yet timed at full size);
    # `gpu_experts_from` (a routing statistics file, --routing_stats_out): each layer's N most-routed experts instead.
    EXTRA_KWARGS = {"quant": str, "hugepages": bool, "repack": bool, "cpu_config": dict,
                    "gpu_prefill_min_tokens": int, "cpu_share": (int, float), "cpu_on_stream": bool,
                    "gpu_experts": int, "gpu_device": str, "gpu_experts_from": str}

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

    def build_ops(self, source: WeightSource | None = None) -> None:
        super().build_ops(source)
        for op in {id(o): o for o in self.impl.values()}.values():
            if hasattr(op, "attach"):  # an op that works with the other phase's op (KExpertsSplit: the CPU experts)
                op.attach(self.impl)

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        phase = current_phase()
        op = self.op_for(phase)
        if op.device.type == "cuda":
            use_device(op.device)  # its kernels launch on the current device (the model may span several GPUs)
        dev = op.input_device(x.device)
        op.submit(move(x, dev), move(topk_ids, dev), move(topk_weights, dev))
        self._pending = (phase, op)

    def takes_logits(self, x: torch.Tensor, k: int) -> bool:
        """Whether this phase's op routes itself from the router's logits (submit_logits) for x."""
        op = self.op_for(current_phase())
        return hasattr(op, "submit_logits") and op.input_device(x.device) == x.device and op.takes_logits(x, k)

    def submit_logits(self, x: torch.Tensor, logits: torch.Tensor, k: int, renorm: bool) -> None:
        """submit() with the top k of `logits` taken by the op itself (where takes_logits said so)."""
        phase = current_phase()
        op = self.op_for(phase)
        if op.device.type == "cuda":
            use_device(op.device)
        op.submit_logits(x, logits, k, renorm)
        self._pending = (phase, op)

    def sync_staged(self) -> tuple[torch.Tensor, torch.dtype] | None:
        """sync() leaving the output where the op's stream path put it (pinned host rows, fp32) and the dtype sync()
        would have given, for a kernel that reads them in place; None (nothing synced) where the op cannot."""
        if self._pending is None:
            raise RuntimeError(f"{self.key}: sync() without submit()")
        phase, op = self._pending
        got = op.sync_staged() if hasattr(op, "sync_staged") else None
        if got is not None:
            self._pending = None
        return got

    def sync(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError(f"{self.key}: sync() without submit()")
        (phase, op), self._pending = self._pending, None
        return self.leave(op.sync(), phase)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(x, topk_ids, topk_weights)
        return self.sync()
