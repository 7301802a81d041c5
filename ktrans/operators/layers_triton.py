"""The Triton ops of the layer operators: KRMSNormTriton, KRoPETriton, KAttentionTriton and KRouterTriton.

Each family's module declares its op by name (NORM_OPS, ROPE_OPS, ATTENTION_OPS, ROUTER_OPS), so rules naming one
validate without triton; building the model imports this module, which imports the kernels
(`ktrans/kernels/triton/`). They run on CUDA, and on the CPU only under Triton's interpreter (the CI tests).
Each does what its family's torch op does, with the same inputs and outputs.
"""
from __future__ import annotations

import torch

from ktrans.kernels.triton import interpreting, unavailable_reason
from ktrans.kernels.triton import attention as tri_attention
from ktrans.kernels.triton import attention_prep as tri_prep
from ktrans.kernels.triton import norm as tri_norm
from ktrans.kernels.triton import rope as tri_rope
from ktrans.kernels.triton import router as tri_router
from ktrans.operators.attention import ATTENTION_OPS, KQwen3NextAttention, check_pool_device
from ktrans.operators.base import Op, OpNotBuiltError
from ktrans.operators.moe import ROUTER_OPS, KRouterTorch
from ktrans.operators.norm import NORM_OPS, KRMSNormTorch
from ktrans.operators.rope import ROPE_OPS, KRoPETorch, RopeTables
from ktrans.runtime.batch import ForwardBatch


def check_runs_here(name: str, device: torch.device) -> None:
    """A Triton op needs a GPU Triton compiles for, or the interpreter for a CPU placement."""
    why = unavailable_reason()
    if why is None and device.type == "cpu" and not interpreting():
        why = "Triton kernels run on the CPU only under TRITON_INTERPRET=1 (tests); place it on cuda"
    if why is not None:
        raise OpNotBuiltError(f"{name} cannot run on {device}: {why}")


class Checked:
    """Mixin before an op class: refuse, when built, a device the Triton kernels cannot run on here."""

    def __init__(self, operator, device: torch.device, streaming: bool = False):
        check_runs_here(type(self).op_name, device)
        super().__init__(operator, device, streaming)


@NORM_OPS.register("KRMSNormTriton", devices=("cuda", "cpu"))
class KRMSNormTriton(Checked, KRMSNormTorch):
    """The zero-centred RMSNorm, with the residual add fused in when given one. Loads like KRMSNormTorch."""

    PREP_EXACT = True  # the attention prep kernel's norm arithmetic (attention._prep fuses only such norms)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return tri_norm.rms_norm(x, self.weight, self.eps, residual)


class TritonRopeTables(RopeTables):
    """Tables whose application rotates q and k in place, in one launch."""

    __slots__ = ()
    PREP_EXACT = True  # the attention prep kernel's rotation arithmetic (attention._prep fuses only such tables)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tri_rope.rope_qk_(q, k, self.cos, self.sin)


@ROPE_OPS.register("KRoPETriton", devices=("cuda", "cpu"))
class KRoPETriton(Checked, KRoPETorch):
    """The reference's tables (a few element-wise ops once per step), applied by the Triton kernel."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> TritonRopeTables:
        return TritonRopeTables(*super().forward(positions, dtype))


def step_pool(op: Op, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged attention op's step: planned (where its plan did not run for this step), the layer's pool checked
    to be on the op's device. Returns the layer's (k_cache, v_cache)."""
    if not op.planned_for(batch):
        op.plan(batch)
    k_cache, v_cache = batch.kv.layer(op.layer_idx)
    check_pool_device(op.key, "KV cache", k_cache, op.device)
    return k_cache, v_cache


def write_step_kv(op: Op, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """step_pool, then this step's keys and values written (the Triton write_kv). Returns (k_cache, v_cache)."""
    k_cache, v_cache = step_pool(op, batch)
    tri_attention.write_kv(k_cache, v_cache, batch.slot_mapping, k, v)
    return k_cache, v_cache


@ATTENTION_OPS.register("KAttentionTriton", devices=("cuda", "cpu"))
class KAttentionTriton(Checked, Op):
    """write_kv, then varlen prefill or split-K decode, over the layer's pages of the KV pool."""

    def __init__(self, operator: KQwen3NextAttention, device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.layer_idx = operator.layer_idx
        self.scaling = operator.scaling
        self.num_kv_heads, self.num_heads = operator.num_kv_heads, operator.num_heads
        self.decode: tri_attention.DecodePlan | None = None
        self.prefill: tuple[torch.Tensor, torch.Tensor, int] | None = None  # cu_seqlens, kv_lens, max new tokens
        self._out: dict[tuple, torch.Tensor] = {}  # decode outputs by shape: no allocation in a captured step

    def plan(self, batch: ForwardBatch) -> None:
        b = self.mark_planned(batch)
        if all(n == 1 for n in b.seq_lens):
            # Sized from the planned length (a graph's KV bucket), never from the live lengths: the grid is fixed.
            self.decode = tri_attention.plan_decode(b.num_seqs, self.num_kv_heads, b.max_kv_len, self.device)
            self.prefill = None
            return
        as_t = lambda x: torch.tensor(x, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        cu = b.cu_seqlens_t if b.cu_seqlens_t is not None else as_t(b.cu_seqlens_host)
        lens = b.kv_lens_t if b.kv_lens_t is not None else as_t(b.kv_lens)
        self.decode, self.prefill = None, (cu, lens, max(b.seq_lens))

    def pretune(self, kv) -> list[int]:
        """The decode autotuner's configs timed for every split-length class on this layer's cache (the warm-up;
        ktrans.kernels.triton.attention.pretune_decode): the classes of long contexts included."""
        k_cache, v_cache = kv.layer(self.layer_idx)
        return tri_attention.pretune_decode(k_cache, v_cache, kv.page_size, self.num_heads, self.scaling)

    def takes_prep(self) -> bool:
        """Whether the operator may hand q and k over as projected, with their norms and RoPE (`prep`)."""
        return tri_prep.FUSED

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                gate: torch.Tensor | None = None, prep: tuple | None = None) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> o [T, Hq, D]. Reads nothing back from the device once planned.
        gate: q_proj's output [T, Hq * 2D], applied by a decode step's merge (attend_gated), ignored by prefill.
        prep: ((q norm weight, eps), (k norm weight, eps), rope tables) where q and k come as projected: their norms,
        RoPE and the KV write in one launch (attention_prep.qk_prep, KTRANS_ATTN_PREP)."""
        if prep is None:
            k_cache, v_cache = write_step_kv(self, k, v, batch)
            q = q if q.stride(-1) == 1 else q.contiguous()
        else:
            k_cache, v_cache = step_pool(self, batch)
            (wq, eps_q), (wk, eps_k), rope = prep
            q = tri_prep.qk_prep(q, k, v, wq, wk, eps_q, eps_k, rope.cos, rope.sin, k_cache, v_cache,
                                 batch.slot_mapping)
        page = batch.kv.page_size
        if self.decode is not None:
            lens = batch.kv_lens_t if batch.kv_lens_t is not None else batch.positions + 1
            key = (tuple(q.shape), q.dtype)
            if key not in self._out:
                self._out[key] = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            return tri_attention.paged_decode(q, k_cache, v_cache, lens, batch.block_tables, page, self.scaling,
                                              self.decode, out=self._out[key], gate=gate)
        cu, lens, max_new = self.prefill
        return tri_attention.paged_prefill(q, k_cache, v_cache, cu, lens, batch.block_tables, page, self.scaling,
                                           max_new)


    def attend_gated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, qg: torch.Tensor,
                     head_dim: int, prep: tuple | None = None) -> torch.Tensor:
        """The attention output times sigmoid of the gate halves of qg (q_proj's output [T, Hq * 2D], unit stride),
        [T, Hq * D] (see KQwen3NextAttention.forward): a decode step's in its merge's launch where
        KTRANS_ATTN_GATE_MERGE is on, else in one launch of its own after the attention. prep: as forward's."""
        fused = tri_attention.DECODE_GATE and all(n == 1 for n in batch.seq_lens)
        out = self(q, k, v, batch, gate=qg if fused else None, prep=prep)
        return out.reshape(q.shape[0], -1) if fused else tri_attention.output_gate(out, qg, head_dim)


@ROUTER_OPS.register("KRouterTriton", devices=("cuda", "cpu"))
class KRouterTriton(Checked, KRouterTorch):
    """Top-k softmax routing in one launch, and the gated sum of the routed and shared experts in one launch."""

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tri_router.route(router_logits, self.top_k, self.norm_topk_prob)

    ROUTES_DENSE = True  # route_dense: the logits' GEMV and the top-k in one launch (KTRANS_ROUTER_FUSED)

    def route_dense(self, x: torch.Tensor, gate_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route(x @ gate_weight^T) for decode rows x [M, H] and the float gate [E, H], in one launch."""
        from ktrans.kernels.triton.dense_gemv import dense_route

        return dense_route(x, gate_weight, self.top_k, self.norm_topk_prob)

    def combine(self, routed: torch.Tensor, shared: torch.Tensor, shared_gate: torch.Tensor) -> torch.Tensor:
        return tri_router.gated_sum(routed, shared, shared_gate)

    FUSES_GATE = True  # the shared expert's [1, hidden] gate logit in the final sum's launch: one launch a layer fewer
    STAGES = True  # its top-k may run inside the CPU experts' stage-in launch, its sum read their output (ROUTE_STAGE)

    def combine_dot_staged(self, routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                           gate_weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """combine_dot() with routed the CPU experts' fp32 rows in the pinned staging, read as `dtype` rows."""
        return tri_router.gated_sum_dot(routed, shared, x, gate_weight, staged_dtype=dtype)

    def combine_dot(self, routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor,
                    gate_weight: torch.Tensor) -> torch.Tensor:
        return tri_router.gated_sum_dot(routed, shared, x, gate_weight)

    forward = route
