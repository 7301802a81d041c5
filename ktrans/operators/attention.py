"""KQwen3NextAttention: gated full attention over the paged KV cache, with a choice of attention kernels.

The projections and q/k norms are the replaced module's children, placed by their own rules. The op is the part
that touches the KV pool: write this step's keys and values, then attend. KAttentionTorch (the reference kernels)
is built now; a FlashInfer/Triton op registers into ATTENTION_OPS the same way. The KV pool pins the operator to
one device for both phases.
"""
from __future__ import annotations

import torch

from ktrans.kernels.torch.attention import paged_attention, write_kv
from ktrans.model.qwen3_next import Qwen3NextAttention, apply_rope
from ktrans.operators.base import BaseOperator, Op, OpRegistry, move, register_operator
from ktrans.runtime.batch import ForwardBatch

ATTENTION_OPS = OpRegistry("attention")


@ATTENTION_OPS.register("KAttentionTorch", devices=("cpu", "cuda"))
class KAttentionTorch(Op):
    def __init__(self, operator: "KQwen3NextAttention", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.layer_idx = operator.layer_idx
        self.scaling = operator.scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> o [T, Hq, D]."""
        k_cache, v_cache = batch.kv.layer(self.layer_idx)
        check_pool_device(self.key, "KV cache", k_cache, self.device)
        write_kv(k_cache, v_cache, batch.slot_mapping, k.to(k_cache.dtype), v.to(v_cache.dtype))
        return paged_attention(q, k_cache, v_cache, batch.cu_seqlens, batch.kv_lens, batch.block_tables,
                               batch.kv.page_size, self.scaling)


def check_pool_device(key: str, what: str, pool: torch.Tensor, device: torch.device) -> None:
    if pool.device != device:
        raise RuntimeError(f"{key} runs on {device} but its {what} is on {pool.device}: create the pools on the "
                           f"devices ktrans.inject.pool_devices(model) reports")


@register_operator()
class KQwen3NextAttention(BaseOperator):
    REPLACES = (Qwen3NextAttention,)
    OPS = ATTENTION_OPS
    DEFAULT_OP = "KAttentionTorch"
    ADOPT = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    ONE_DEVICE = "its KV cache pages live on one device"

    def __init__(self, key, orig: Qwen3NextAttention, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.layer_idx = orig.layer_idx
        self.num_heads = orig.num_heads
        self.num_kv_heads = orig.num_kv_heads
        self.head_dim = orig.head_dim
        self.scaling = orig.scaling

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        phase, dev = self.phase_device()
        x, (cos, sin), batch = move(x, dev), move(rope, dev), batch.on(dev)
        t, d = x.shape[0], self.head_dim
        # Same steps as Qwen3NextAttention.forward; children may sit elsewhere, so their outputs come back here.
        q, gate = move(self.q_proj(x), dev).view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(t, -1)
        q = move(self.q_norm(q), dev)
        k = move(self.k_norm(move(self.k_proj(x), dev).view(t, self.num_kv_heads, d)), dev)
        v = move(self.v_proj(x), dev).view(t, self.num_kv_heads, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.op_for(phase)(q, k, v, batch)
        out = out.reshape(t, -1) * torch.sigmoid(gate)
        return self.leave(move(self.o_proj(out), dev), phase)
