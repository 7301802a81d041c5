"""KQwen3NextSparseMoeBlock (routing, routed experts, sigmoid-gated shared expert) and KQwen3NextMLP.

Both are composites: their weights live in their children (the router and projections are Linears, the experts a
KTransformersExperts), which rules place on their own. The block only decides where routing and the final sum run.
The routed experts are submitted before the shared expert runs and synced after, so a CPU expert op overlaps the
GPU's shared expert.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktrans.model.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock
from ktrans.operators.base import BaseOperator, move, register_operator


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top k, renormalise them when norm_topk_prob. On the logits'
    device, nothing read back: the expert op takes the ids as a tensor."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


@register_operator("KQwen3NextSparseMoeBlockV2")
class KQwen3NextSparseMoeBlock(BaseOperator):
    REPLACES = (Qwen3NextSparseMoeBlock,)
    ADOPT = ("gate", "experts", "shared_expert", "shared_expert_gate")

    def __init__(self, key, orig: Qwen3NextSparseMoeBlock, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.top_k = orig.top_k
        self.norm_topk_prob = orig.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        x = move(x, dev)
        ids, weights = route(move(self.gate(x), dev), self.top_k, self.norm_topk_prob)
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
        return self.leave(move(routed, dev) + torch.sigmoid(shared_gate) * shared, phase)


@register_operator("KQwen2MoeMLP")
class KQwen3NextMLP(BaseOperator):
    """SwiGLU MLP (the shared expert, or a dense layer): down(silu(gate x) * up x)."""

    REPLACES = (Qwen3NextMLP,)
    ADOPT = ("gate_proj", "up_proj", "down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        x = move(x, dev)
        h = F.silu(move(self.gate_proj(x), dev)) * move(self.up_proj(x), dev)
        return self.leave(move(self.down_proj(h), dev), phase)
