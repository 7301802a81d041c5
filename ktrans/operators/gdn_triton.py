"""KGatedDeltaNetTriton: the Gated DeltaNet op on the Triton kernels (`ktrans/kernels/triton/`).

The same call and the same batching policy as KGatedDeltaNetTorch (`plan_deltanet`): the one-token rows of started
sequences take the fused decode kernel (conv window, gates, L2 norm and recurrent update in one launch, in place
in the state pool), every other sequence of the step goes through the varlen conv and the chunked delta rule
together, three launches for all of them. A mixed step runs both. The gated output norm stays the torch function
the torch op uses.

Imported lazily by GDN_OPS (declared in gdn.py), so ktrans imports where Triton does not. On a CPU device it runs
only under Triton's interpreter (TRITON_INTERPRET=1: the tests).
"""
from __future__ import annotations

import torch

from ktrans.kernels.triton import interpreting, unavailable_reason
from ktrans.kernels.triton.conv import causal_conv1d_varlen
from ktrans.kernels.triton.gated_delta import ChunkPlan, chunk_gated_delta_rule_varlen, plan_chunks
from ktrans.kernels.triton.gated_delta_decode import gated_delta_decode
from ktrans.operators.attention import check_pool_device
from ktrans.operators.gdn import GDN_OPS, KGatedDeltaNetTorch, plan_deltanet
from ktrans.operators.norm import rms_norm_gated
from ktrans.runtime.batch import ForwardBatch

# The chunk table of the step last planned, shared by every DeltaNet layer of that step (one host-to-device copy
# per step, not per layer). Keyed by the batch object itself: a step's layers all see the same one.
_last_chunks: list[tuple[ForwardBatch, ChunkPlan]] = []


def _chunk_plan(batch: ForwardBatch, prefill: list[tuple[int, int, int, bool]], device: torch.device) -> ChunkPlan:
    if _last_chunks and _last_chunks[0][0] is batch:
        return _last_chunks[0][1]
    plan = plan_chunks(prefill, device)
    _last_chunks[:] = [(batch, plan)]
    return plan


@GDN_OPS.register("KGatedDeltaNetTriton", devices=("cpu", "cuda"))
class KGatedDeltaNetTriton(KGatedDeltaNetTorch):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        why = unavailable_reason()
        if why is None and device.type == "cpu" and not interpreting():
            why = "on the CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, for tests)"
        if why:
            raise RuntimeError(f"{operator.key}: KGatedDeltaNetTriton cannot run on {device}: {why}")
        super().__init__(operator, device, streaming)
        self.chunks: ChunkPlan | None = None

    def plan(self, batch: ForwardBatch) -> None:
        batch = self.mark_planned(batch)
        self.step = plan_deltanet(batch, self.device)
        self.chunks = _chunk_plan(batch, self.step.prefill, self.device) if self.step.prefill else None

    def forward(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """mixed [T, conv_dim] (q|k|v before the conv), z [T, Hv, Dv], b and a [T, Hv] -> normed core [T, value_dim]."""
        if not self.planned_for(batch):
            self.plan(batch)
        t = mixed.shape[0]
        conv_pool, ssm_pool = batch.states.layer(self.layer_idx)
        check_pool_device(self.key, "DeltaNet state", conv_pool, self.device)
        conv_w = self.conv_weight.squeeze(1)
        mixed, a, b = mixed.contiguous(), a.contiguous(), b.contiguous()
        core = mixed.new_empty(t, self.num_v_heads, self.head_v_dim)
        step = self.step
        if step.decode_rows is not None:
            rows = None if isinstance(step.decode_rows, slice) else step.decode_rows
            gated_delta_decode(mixed, a, b, self.A_log, self.dt_bias, conv_w, conv_pool, ssm_pool, step.decode_slots,
                               self.num_k_heads, self.head_k_dim, rows=rows, out=core)
        if self.chunks is not None:
            y = causal_conv1d_varlen(mixed, conv_w, conv_pool, self.chunks)
            kd, hk, dk = self.key_dim, self.num_k_heads, self.head_k_dim
            q = y[:, :kd].view(t, hk, dk)
            k = y[:, kd:2 * kd].view(t, hk, dk)
            v = y[:, 2 * kd:].view(t, self.num_v_heads, self.head_v_dim)
            chunk_gated_delta_rule_varlen(q, k, v, a, b, self.A_log, self.dt_bias, ssm_pool, self.chunks, out=core)
        core = rms_norm_gated(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm_weight,
                              self.eps)
        return core.reshape(t, self.value_dim)
