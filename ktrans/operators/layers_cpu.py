"""KGatedDeltaNetCPU, KAttentionCPU, KRMSNormCPU and KRouterCPU: the layer ops of the CPU placement on the C++ kernels.

A decode step of a CPU-only model spent its host time in the reference ops' tens of small torch calls per layer
(gathering the state slots, the conv window, the gates, the L2 norms, the delta rule, the gated norm; gathering
the KV pages, scores, softmax). These ops run each layer's decode core in one call into ktrans._cpu
(`ktrans/kernels/cpu_layers.py`, csrc/cpu/layers.*), in place on the engine's pools, on the process pool's threads
when it has more than one (else on the calling thread). Everything else (prefill, a mixed step with prefill chunks)
takes the torch op's path they inherit, so the two ops agree wherever the kernels do not run.

KRMSNormCPU (the residual add and the norm) and KRouterCPU (softmax/top-k and the gated sum of the MoE block) do in
one C++ call, on the calling thread, what the torch ops do in 3-10 dispatches: at one token the dispatches were the
time (~33 us for add + norm on the dev box). Tensors of more than SMALL_ELEMENTS values (128 tokens of the 80B's
hidden size 2048; rows of the q/k norms are heads) keep the torch path, whose intra-op threads then have real work.

Imported lazily by GDN_OPS and ATTENTION_OPS (declared in gdn.py and attention.py), so ktrans imports where the
extension is not built.
"""
from __future__ import annotations

import torch

from ktrans.kernels import cpu
from ktrans.kernels import cpu_layers
from ktrans.kernels.cpu_layers import attn_decode, gdn_decode
from ktrans.operators.attention import ATTENTION_OPS, KAttentionTorch, check_pool_device
from ktrans.operators.gdn import GDN_OPS, KGatedDeltaNetTorch
from ktrans.operators.moe import ROUTER_OPS, KRouterTorch
from ktrans.operators.norm import NORM_OPS, KRMSNormTorch
from ktrans.runtime.batch import ForwardBatch
from ktrans.weights.source import WeightSource


def _cpu_only(op: str, key: str, device: torch.device) -> None:
    if device.type != "cpu":
        raise RuntimeError(f"{key}: {op} runs on the CPU only, not on {device}")


@GDN_OPS.register("KGatedDeltaNetCPU", devices=("cpu",))
class KGatedDeltaNetCPU(KGatedDeltaNetTorch):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        _cpu_only("KGatedDeltaNetCPU", operator.key, device)
        super().__init__(operator, device, streaming)
        self.f32: tuple[torch.Tensor, ...] = ()

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        super().load(source, dtype)
        # The kernel reads float32: converted once here rather than on every step.
        self.f32 = tuple(t.detach().float().contiguous() for t in
                         (self.conv_weight.squeeze(1), self.A_log, self.dt_bias, self.norm_weight))

    def forward(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        if not self.planned_for(batch):
            self.plan(batch)
        step = self.step
        if step.prefill or step.decode_rows is None:  # prefill or a mixed step: the torch op's path
            return super().forward(mixed, z, b, a, batch)
        conv_pool, ssm_pool = batch.states.layer(self.layer_idx)
        check_pool_device(self.key, "DeltaNet state", conv_pool, self.device)
        conv_w, A_log, dt_bias, norm_w = self.f32
        out = gdn_decode(mixed, z, b, a, A_log, dt_bias, conv_w, norm_w, self.eps, conv_pool, ssm_pool,
                         step.decode_slots, self.num_k_heads, self.head_k_dim, pool=cpu.get_pool())
        return out.to(mixed.dtype)


@ATTENTION_OPS.register("KAttentionCPU", devices=("cpu",))
class KAttentionCPU(KAttentionTorch):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        _cpu_only("KAttentionCPU", operator.key, device)
        super().__init__(operator, device, streaming)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not self.planned_for(batch):
            self.plan(batch)
        if not self.step.decode:
            return super().forward(q, k, v, batch)
        k_cache, v_cache = batch.kv.layer(self.layer_idx)
        check_pool_device(self.key, "KV cache", k_cache, self.device)
        lens = batch.kv_lens_t if batch.kv_lens_t is not None else batch.positions + 1
        out = attn_decode(q, k, v, k_cache, v_cache, batch.slot_mapping, lens, batch.block_tables,
                          batch.kv.page_size, self.scaling, pool=cpu.get_pool())
        return out.to(q.dtype)


SMALL_ELEMENTS = 1 << 18  # values up to which the per-row C++ ops replace the torch ones (1 MiB of float32)


def _small(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in ts) and ts[0].numel() <= SMALL_ELEMENTS


@NORM_OPS.register("KRMSNormCPU", devices=("cpu",))
class KRMSNormCPU(KRMSNormTorch):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        _cpu_only("KRMSNormCPU", operator.key, device)
        super().__init__(operator, device, streaming)
        self.w32 = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        super().load(source, dtype)
        self.w32 = self.weight.detach().float().contiguous()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not _small(x) or residual is not None and not _small(residual):
            return super().forward(x, residual)
        return cpu_layers.rms_norm(x, self.w32, self.eps, residual)


@ROUTER_OPS.register("KRouterCPU", devices=("cpu",))
class KRouterCPU(KRouterTorch):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        _cpu_only("KRouterCPU", operator.key, device)
        super().__init__(operator, device, streaming)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not _small(router_logits) or router_logits.dim() != 2:
            return super().route(router_logits)
        return cpu_layers.moe_route(router_logits, self.top_k, self.norm_topk_prob)

    def combine(self, routed: torch.Tensor, shared: torch.Tensor, shared_gate: torch.Tensor) -> torch.Tensor:
        if not _small(routed, shared, shared_gate) or shared.shape != routed.shape:
            return super().combine(routed, shared, shared_gate)
        return cpu_layers.moe_gated_sum(routed, shared, shared_gate)

    forward = route
