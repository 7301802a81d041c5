"""KQwen3NextSparseMoeBlock (routing, routed experts, sigmoid-gated shared expert) and KQwen3NextMLP.

Their weights live in their children (the router and projections are Linears, the experts a KTransformersExperts),
which rules place on their own. The block decides where routing and the final sum run, and its op (ROUTER_OPS, no
weights) does them: top-k over the router's softmax, and routed + sigmoid(shared gate) * shared. KRouterTorch is
the reference; KRouterTriton (`ktrans/operators/layers_triton.py`) does each in one launch. The routed experts are
submitted before the shared expert runs and synced after, so a CPU expert op overlaps the GPU's shared expert.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ktrans.model.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock
from ktrans.operators.base import BaseOperator, Op, OpRegistry, move, register_operator
from ktrans.operators.experts import layer_index
from ktrans.operators.linear import project
from ktrans.operators.routing_stats import ROUTING
from ktrans.runtime.batch import current_batch

# The shared expert as one more pair a token of the routed GPU MoE (`_SharedFused`): off until measured on a GPU
# (KTRANS_MOE_FUSED_SHARED=1 turns it on).
FUSED_SHARED = os.environ.get("KTRANS_MOE_FUSED_SHARED", "0") == "1"
# The CPU experts' hand-off folded into the Triton router's launches, on the flag path: its top-k inside the
# stage-in launch (ktrans.kernels.triton.stage.route_stage_in) and the stage-out inside the gated sum, which reads
# the pinned output rows in place (router.gated_sum_dot's staged_dtype): two launches a layer less under the serve
# rules, the same sums bitwise; off until measured on a GPU (KTRANS_ROUTE_STAGE=1 turns it on).
ROUTE_STAGE = os.environ.get("KTRANS_ROUTE_STAGE", "0") == "1"
# The router's logits GEMV and its top-k in one launch for decode rows (ktrans.kernels.triton.dense_gemv.dense_route:
# the GEMV's last program routes), where the router op has it and the gate is a float weight on the block's GPU; also
# the fused shared expert's stacked gate. One launch a layer less; off until measured on a GPU
# (KTRANS_ROUTER_FUSED=1 turns it on).
ROUTER_FUSED = os.environ.get("KTRANS_ROUTER_FUSED", "0") == "1"
ROUTER_OPS = OpRegistry("router")
ROUTER_OPS.declare("KRouterTriton", devices=("cuda", "cpu"), module="ktrans.operators.layers_triton",
                   provided_by="triton (the cpu device only under TRITON_INTERPRET=1)")
ROUTER_OPS.declare("KRouterCPU", devices=("cpu",), module="ktrans.operators.layers_cpu",
                   provided_by="the C++ extension (ktrans._cpu)")


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top k, renormalise them when norm_topk_prob. On the logits'
    device, nothing read back: the expert op takes the ids as a tensor."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


@ROUTER_OPS.register("KRouterTorch", devices=("cpu", "cuda"))
class KRouterTorch(Op):
    """The block's routing and final sum in torch ops."""

    def __init__(self, operator: "KQwen3NextSparseMoeBlock", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.top_k = operator.top_k
        self.norm_topk_prob = operator.norm_topk_prob

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(router_logits, self.top_k, self.norm_topk_prob)

    def combine(self, routed: torch.Tensor, shared: torch.Tensor, shared_gate: torch.Tensor) -> torch.Tensor:
        return routed + torch.sigmoid(shared_gate) * shared

    FUSES_GATE = False  # whether combine_dot computes the gate logit in the sum's own launch

    def combine_dot(self, routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                    gate_weight: torch.Tensor) -> torch.Tensor:
        """combine() with the gate logit x . gate_weight computed here."""
        return self.combine(routed, shared, F.linear(x, gate_weight))

    forward = route


@register_operator("KQwen3NextSparseMoeBlockV2")
class KQwen3NextSparseMoeBlock(BaseOperator):
    REPLACES = (Qwen3NextSparseMoeBlock,)
    OPS = ROUTER_OPS
    DEFAULT_OP = "KRouterTorch"
    ADOPT = ("gate", "experts", "shared_expert", "shared_expert_gate")

    def __init__(self, key, orig: Qwen3NextSparseMoeBlock, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.top_k = orig.top_k
        self.norm_topk_prob = orig.norm_topk_prob
        self._shared_fused: dict[str, "_SharedFused | None"] = {}  # per phase, built at its first call
        self.layer = layer_index(key, "KQwen3NextSparseMoeBlock")  # the routing statistics' key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        x = move(x, dev)
        router = self.op_for(phase)
        if FUSED_SHARED and x.dim() == 2:
            # built eagerly (its stacked gate weight is a new tensor): a first call inside a capture runs unfused
            if phase not in self._shared_fused and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._shared_fused[phase] = _SharedFused.build(self, phase, dev, router, x)
            fused = self._shared_fused.get(phase)
            if fused is not None and fused.takes(x.shape[0]):
                return self.leave(fused(x), phase)
        asynchronous = hasattr(self.experts, "submit")  # an expert operator (a skeleton raises when called)
        staged = asynchronous and ROUTE_STAGE and getattr(router, "STAGES", False) and x.dim() == 2 \
            and self.experts.takes_logits(x, self.top_k)
        gate_w = self._fused_gate(router, phase, x) if ROUTER_FUSED and not staged and not ROUTING.on else None
        logits = move(self.gate(x), dev) if gate_w is None else None
        if staged:
            self.experts.submit_logits(x, logits, self.top_k, self.norm_topk_prob)
        else:
            ids, weights = router.route(logits) if gate_w is None else router.route_dense(x, gate_w)
            if ROUTING.on:  # --routing_stats_out: eager steps' live rows
                batch = current_batch()
                ROUTING.record(self.layer, ids, logits.shape[-1], batch.num_live if batch is not None else None)
            if asynchronous:
                self.experts.submit(x, ids, weights)
            else:
                routed = self.experts(x, ids, weights)
        # Meanwhile: the shared expert and its gate, on this block's device (the gate in the final sum's launch
        # where the router op can: a [1, hidden] projection is a dot product a token).
        shared = move(self.shared_expert(x), dev)
        gate_row = gate_weight_row(self.shared_expert_gate, x, phase) if router.FUSES_GATE else None
        if gate_row is None:
            shared_gate = move(self.shared_expert_gate(x), dev)
        if staged and gate_row is not None:  # the stage-out folded into the sum: it reads the pinned rows in place
            got = self.experts.sync_staged()
            if got is not None:
                return self.leave(router.combine_dot_staged(got[0], shared, x, gate_row, got[1]), phase)
        if asynchronous:
            routed = self.experts.sync()
        if gate_row is not None:
            return self.leave(router.combine_dot(move(routed, dev), shared, x, gate_row), phase)
        return self.leave(router.combine(move(routed, dev), shared, shared_gate), phase)

    def _fused_gate(self, router: Op, phase: str, x: torch.Tensor) -> torch.Tensor | None:
        """The router gate's float weight where this step routes in one launch from x (ROUTER_FUSED): a router op
        with route_dense (the Triton router, whose kernels run where it does), decode rows of the dense GEMV, the
        gate one float matrix on x's device in x's dtype (KLinearMarlin rounds the logits to x's dtype after a GEMV in
        the weight's: another dtype would route from other logits)."""
        from ktrans.kernels.triton.dense_gemv import MAX_ROWS

        if not getattr(router, "ROUTES_DENSE", False) or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
            return None
        w = dense_gate(self.gate, phase)
        return w if w is not None and (w.device, w.dtype, w.shape[1]) == (x.device, x.dtype, x.shape[1]) else None


def dense_gate(gate: torch.nn.Module, phase: str) -> torch.Tensor | None:
    """The MoE router gate as one float [E, H] weight without a bias, where it is one: KLinearMarlin's single dense
    part (no split placement) or a plain Linear; else None."""
    from ktrans.operators.linear import KTransformersLinear

    op = gate.impl.get(phase) if isinstance(gate, KTransformersLinear) else None
    parts = getattr(op, "parts", None)
    if parts and len(parts) == 1 and getattr(op, "place", None) is None and getattr(op, "bias", None) is None:
        return parts[0].dense
    if type(gate) is torch.nn.Linear and gate.bias is None:
        return gate.weight
    return None


def gate_weight_row(gate: torch.nn.Module, x: torch.Tensor, phase: str) -> torch.Tensor | None:
    """The shared expert's gate as a float [1, hidden] weight on x's device, when it is one without a bias: a plain
    Linear (the shipped GPU rules keep it so) or one running KLinearTorch there; else None."""
    from ktrans.operators.linear import KLinearTorch, KTransformersLinear

    if type(gate) is torch.nn.Linear:
        w, bias = gate.weight, gate.bias
    elif isinstance(gate, KTransformersLinear) and isinstance(gate.impl.get(phase), KLinearTorch) \
            and gate.out_devices[phase] == x.device:
        w, bias = gate.impl[phase].weight, gate.impl[phase].bias
    else:
        return None
    ok = bias is None and w is not None and w.dim() == 2 and w.shape[0] == 1 and w.device == x.device
    return w if ok and x.dim() == 2 else None


@register_operator("KQwen2MoeMLP")
class KQwen3NextMLP(BaseOperator):
    """SwiGLU MLP (the shared expert, or a dense layer): down(silu(gate x) * up x).

    Where all three projections run KLinearCPUInfer on the blocks as stored, the MLP runs as one job of the C++ CPU
    experts instead (a CPUMoE of one expert, every token routed to it with weight 1, built from the same blocks at
    its first call): gate and up, SiLU times up, and down in one pass over the pool, where the three projections
    were three jobs with the SiLU and product in torch between them. The same kernels on the same blocks; the SiLU
    is the C++ one (exp to ~1e-7 relative) and the down projection's input is quantized there.

    Where all three run KLinearMarlin (one packed matrix each, gate and up of one type) on the MLP's GPU, steps of up
    to moe_quant.DIRECT_MAX_TOKENS rows (decode) run it as a one-expert GPU MoE the same way: the MoE kernel's
    few-token path does gate and up with SiLU times up in one launch and down in a second, where the projections
    took three GEMVs (six launches with their split-K sums as separate kernels) and torch two more (SiLU, product),
    the shared expert of every layer of every decoded token. The same blocks and lane-wise decoding; h = silu(g) * u is formed in fp32 before its
    one rounding to the activations' dtype (the projections rounded g and u first). Longer steps keep the
    projections (their GEMM tiles). The gate and up planes are stacked once: the shared expert's gate and up twice
    on the GPU (~1.2 MiB a layer at the 80B's shapes).
    """

    REPLACES = (Qwen3NextMLP,)
    ADOPT = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, key, orig, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        # per phase: the one-expert CPUMoE or GPU MoE, or None where it does not apply; phases whose projections run
        # the same ops share one (one copy of the stacked weights, not one a phase)
        self._fused: dict[str, object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        x = move(x, dev)
        fused = self._fused.get(phase, False)
        if fused is False:
            ops = self._projection_ops(phase)
            same = next((p for p in self._fused if self._projection_ops(p) == ops), None)
            fused = self._fused[phase] = self._fused[same] if same is not None else self._fuse(phase, dev)
        if isinstance(fused, _GPUMLP) and 0 < x.shape[:-1].numel() <= fused.max_rows:
            y = fused(x.reshape(-1, x.shape[-1]))
            return self.leave(y.reshape(x.shape[:-1] + (y.shape[-1],)), phase)
        if fused is not None and not isinstance(fused, _GPUMLP) and x.device.type == "cpu":
            flat = x.reshape(-1, x.shape[-1])
            t = flat.shape[0]
            ones = torch.ones(t, 1)
            y = fused.submit(flat, torch.zeros(t, 1, dtype=torch.int64), ones).wait()
            return self.leave(y.to(x.dtype).reshape(x.shape[:-1] + (y.shape[-1],)), phase)
        g, u = project(x, self.gate_proj, self.up_proj)
        h = F.silu(move(g, dev)) * move(u, dev)
        return self.leave(move(self.down_proj(h), dev), phase)

    def _projection_ops(self, phase: str) -> tuple:
        """Identities of the three projections' ops in a phase (and their devices): equal where two phases run the
        same op instances, so what _fuse builds from them serves both."""
        lins = (self.gate_proj, self.up_proj, self.down_proj)
        return tuple((id(lin.impl.get(phase)), lin.devices.get(phase), lin.out_devices.get(phase))
                     if isinstance(lin, BaseOperator) else id(lin) for lin in lins)

    def _fuse(self, phase: str, dev: torch.device):
        """The one-expert CPUMoE over the three projections' stored blocks, or None: projections not all read as
        stored by KLinearCPUInfer on this device (other ops, floats converted at load, two-part matrices, a bias).
        On a GPU (or the CPU under Triton's interpreter): the one-expert GPU MoE where all three are KLinearMarlin."""
        gpu = _GPUMLP.build(self, phase, dev)
        if gpu is not None or dev.type != "cpu":
            return gpu
        raws = []
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            op = lin.op_for(phase) if isinstance(lin, BaseOperator) and phase in lin.impl else None
            raw = getattr(op, "raw", None)
            if raw is None or getattr(op, "bias", None) is not None or op.parts or lin.out_devices[phase] != dev \
                    or lin.devices[phase] != dev or raw.type_name in ("F32", "F16", "BF16"):
                return None
            raws.append((raw, op.repack))
        from ktrans.kernels import cpu

        (g, rg), (u, _), (d, _) = raws
        inter, hidden = g.shape
        if u.shape != (inter, hidden) or d.shape != (hidden, inter):
            return None
        return cpu.CPUMoE(g.data[None], u.data[None], d.data[None], n_experts=1, hidden=hidden, intermediate=inter,
                          types=(g.type_name, u.type_name, d.type_name), hugepages=False, repack=rg)


class _GPUMLP:
    """A SwiGLU MLP on KLinearMarlin's packed matrices as a one-expert MoE (ktrans.kernels.triton.moe_quant): every
    row routed to expert 0 with weight 1, through the few-token path."""

    def __init__(self, gate_up, down, device: torch.device):
        from ktrans.kernels.triton.moe_quant import DIRECT_MAX_TOKENS

        self.gate_up, self.down, self.max_rows = gate_up, down, DIRECT_MAX_TOKENS
        # the routing, made here, eagerly: a CUDA-graph capture only records the kernels that would fill them
        self.ids = torch.zeros(self.max_rows, 1, dtype=torch.int32, device=device)
        self.weights = torch.ones(self.max_rows, 1, dtype=torch.float32, device=device)

    @classmethod
    def build(cls, mlp: "KQwen3NextMLP", phase: str, dev: torch.device) -> "_GPUMLP | None":
        from ktrans.kernels.triton import interpreting

        if dev.type != "cuda" and not (dev.type == "cpu" and interpreting()):
            return None
        packed = []
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            op = lin.op_for(phase) if isinstance(lin, BaseOperator) and phase in lin.impl else None
            w = op.packed_weight() if hasattr(op, "packed_weight") else None
            if w is None or lin.devices[phase] != dev or lin.out_devices[phase] != dev:
                return None
            packed.append(w)
        g, u, d = packed
        if g.qtype != u.qtype or (g.n, g.k) != (u.n, u.k) or (d.n, d.k) != (g.k, g.n):
            return None
        from ktrans.kernels.triton.quant_layout import as_stack, concat_rows

        return cls(as_stack(concat_rows([g, u])), as_stack(d), dev)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from ktrans.kernels.triton.moe_quant import moe_quant

        t = x.shape[0]
        return moe_quant(x, self.ids[:t], self.weights[:t], self.gate_up, self.down)  # (it makes rows unit-stride)


class _SharedFused:
    """The block's decode step as one GPU MoE over k + 1 pairs a token: the shared expert is the extra pair (id E,
    weight sigmoid of its gate logit), so its gate and up ride the routed experts' gate-and-up launch and its down
    their down launch, whose top-k sum adds it (ktrans.kernels.triton.moe_quant's extra expert); the router's logits
    and the shared gate's come from one GEMV over the two weights stacked ([E + 1, H]), and one top-k launch writes
    the k + 1 ids and weights (router.route_with_shared). Four launches a layer where the block took seven (router
    GEMV, top-k, two routed, two shared, the gated sum). Applies where the routed experts are KExpertsMarlin's packed
    stacks, the shared expert's projections KLinearMarlin matrices of the same types and shapes (the one-expert GPU
    MoE of KQwen3NextMLP), the router a float weight and the shared gate a plain [1, H] row (whatever the router op:
    the routed experts' op runs Triton kernels already), for steps on the lanes path (moe_quant.LANES["max_tokens"]
    rows); else the block runs as before. The sum
    differs from the unfused block's in rounding only: the shared expert's output enters the fp32 top-k sum instead
    of a bf16 tensor added after, and its gate logit is the GEMV's (rounded to the activations' dtype)."""

    def __init__(self, gate_w: torch.Tensor, top_k: int, renorm: bool, gate_up, down, extra):
        from ktrans.operators.linear_marlin import Matrix

        self.gate = Matrix(None, gate_w, str(gate_w.dtype))  # floats: the Triton GEMV for decode rows, else F.linear
        self.top_k, self.renorm = top_k, renorm
        self.gate_up, self.down, self.extra = gate_up, down, extra
        self.max_rows: int | None = None  # None: the lanes path's limits as they are at the call

    def takes(self, rows: int) -> bool:
        """Whether a step of `rows` tokens rides the lanes path (the extra expert's only path)."""
        from ktrans.kernels.triton.moe_quant import LANES

        limit = self.max_rows if self.max_rows is not None else (LANES["max_tokens"] if LANES["on"] else 0)
        return 0 < rows <= limit

    @classmethod
    def build(cls, block: "KQwen3NextSparseMoeBlock", phase: str, dev: torch.device, router: Op,
              x: torch.Tensor) -> "_SharedFused | None":
        if not isinstance(block.shared_expert, KQwen3NextMLP):
            return None
        experts = block.experts.impl.get(phase) if isinstance(block.experts, BaseOperator) else None
        gate_up, down = getattr(experts, "gate_up", None), getattr(experts, "down", None)
        if gate_up is None or down is None or getattr(experts, "streaming", True) or gate_up.device != dev:
            return None
        mlp = _GPUMLP.build(block.shared_expert, phase, dev)
        if mlp is None or (mlp.gate_up.qtype, mlp.gate_up.n, mlp.gate_up.k, mlp.down.qtype, mlp.down.n,
                           mlp.down.k) != (gate_up.qtype, gate_up.n, gate_up.k, down.qtype, down.n, down.k):
            return None
        row = gate_weight_row(block.shared_expert_gate, x, phase)
        dense = dense_gate(block.gate, phase)
        if row is None or dense is None or dense.device != dev or dense.shape != (gate_up.experts, x.shape[1]):
            return None
        gate_w = torch.cat([dense.detach(), row.detach().to(dense.dtype)]).contiguous()  # [E + 1, H], ~2 MiB at bf16
        if gate_w.is_cuda:  # resident before its GEMV reads it (under KTRANS_PDL, before waiting for the cat); once
            torch.cuda.current_stream(gate_w.device).synchronize()
        return cls(gate_w, block.top_k, block.norm_topk_prob, gate_up, down, (mlp.gate_up, mlp.down))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from ktrans.kernels.triton.dense_gemv import MAX_ROWS, dense_route
        from ktrans.kernels.triton.moe_quant import moe_quant
        from ktrans.kernels.triton.router import route_with_shared

        if ROUTER_FUSED and x.shape[0] <= MAX_ROWS:  # the stacked GEMV and the routing in one launch
            ids, weights = dense_route(x, self.gate.dense, self.top_k, self.renorm, shared=True)
        else:
            ids, weights = route_with_shared(self.gate(x), self.top_k, self.renorm)
        return moe_quant(x, ids, weights, self.gate_up, self.down, extra=self.extra)
