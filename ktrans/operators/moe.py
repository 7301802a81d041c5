"""KQwen3NextSparseMoeBlock (routing, routed experts, sigmoid-gated shared expert) and KQwen3NextMLP.

Their weights live in their children (the router and projections are Linears, the experts a KTransformersExperts),
which rules place on their own. The block decides where routing and the final sum run, and its op (ROUTER_OPS, no
weights) does them: top-k over the router's softmax, and routed + sigmoid(shared gate) * shared. KRouterTorch is
the reference; KRouterTriton (`ktrans/operators/layers_triton.py`) does each in one launch. The routed experts are
submitted before the shared expert runs and synced after, so a CPU expert op overlaps the GPU's shared expert.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktrans.model.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock
from ktrans.operators.base import BaseOperator, Op, OpRegistry, move, register_operator
from ktrans.operators.linear import project

ROUTER_OPS = OpRegistry("router")
ROUTER_OPS.declare("KRouterTriton", devices=("cuda", "cpu"), module="ktrans.operators.layers_triton",
                   provided_by="triton (the cpu device only under TRITON_INTERPRET=1)")


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        x = move(x, dev)
        router = self.op_for(phase)
        ids, weights = router.route(move(self.gate(x), dev))
        asynchronous = hasattr(self.experts, "submit")  # an expert operator (a skeleton raises when called)
        if asynchronous:
            self.experts.submit(x, ids, weights)
        else:
            routed = self.experts(x, ids, weights)
        # Meanwhile: the shared expert and its gate, on this block's device.
        shared = move(self.shared_expert(x), dev)
        shared_gate = move(self.shared_expert_gate(x), dev)
        if asynchronous:
            routed = self.experts.sync()
        return self.leave(router.combine(move(routed, dev), shared, shared_gate), phase)


@register_operator("KQwen2MoeMLP")
class KQwen3NextMLP(BaseOperator):
    """SwiGLU MLP (the shared expert, or a dense layer): down(silu(gate x) * up x)."""

    REPLACES = (Qwen3NextMLP,)
    ADOPT = ("gate_proj", "up_proj", "down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        x = move(x, dev)
        g, u = project(x, self.gate_proj, self.up_proj)
        h = F.silu(move(g, dev)) * move(u, dev)
        return self.leave(move(self.down_proj(h), dev), phase)
