"""KQwen3NextGatedDeltaNet: the Gated DeltaNet layer with its state in the engine's slot pool.

The operator holds the layer's math around its op: the input projections (children placed by their own rules)
split per key head, then its op, then out_proj. The op owns what runs on the state: the causal conv
(conv1d.weight), the gates (A_log, dt_bias), the gated delta rule with its batching policy (`deltanet_core`) and
the gated output norm. KGatedDeltaNetTorch uses the reference kernels; KGatedDeltaNetTriton (gdn_triton.py, the
FLA-style chunked Triton kernels) registers into GDN_OPS with the same call. The state pool pins the operator to one
device for both phases.

Batching policy, planned from the batch's host lists before the forward (`plan_deltanet`): one-token steps of
already-started sequences run together through the batched decode kernels, also when prefill chunks share the
batch; every other sequence runs the chunked rule alone. A sequence whose cached length is 0 starts from zero
state, so a reused slot never leaks its previous owner's state. A decode-only step reads nothing back from the
device: its rows are all of the batch and its slots are the batch's state_slots tensor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ktrans.kernels.torch.conv import causal_conv1d, causal_conv1d_update
from ktrans.kernels.torch.gated_delta import chunk_gated_delta_rule, gated_delta_rule_decode
from ktrans.model.qwen3_next import Qwen3NextGatedDeltaNet
from ktrans.operators import linear as linear_ops
from ktrans.operators.attention import check_pool_device
from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, load_param, move, register_operator
from ktrans.operators.linear import project
from ktrans.operators.norm import rms_norm_gated
from ktrans.runtime.batch import ForwardBatch
from ktrans.weights.source import WeightSource

GDN_OPS = OpRegistry("gated deltanet")
# b and a handed to an op that takes them so (TAKES_GROUPED_BA: KGatedDeltaNetTriton) as the [T, HK, R] views of
# in_proj_ba's output, not copied to [T, HV] rows: two copy kernels a layer fewer in a decode step (the 72 torch
# elementwise launches of the all-GPU profile, session 23); the same values read. KTRANS_GDN_GROUPED_BA=0: copies.
GROUPED_BA = os.environ.get("KTRANS_GDN_GROUPED_BA", "1") == "1"
# The Triton kernels (FLA-style chunked rule, fused decode step): on CUDA, and on the CPU under Triton's interpreter.
GDN_OPS.declare("KGatedDeltaNetTriton", devices=("cpu", "cuda"), module="ktrans.operators.gdn_triton",
                provided_by="Triton (`pip install triton`)")
# fla-core's recurrent kernel for decode steps (an optional backend), our Triton kernels for the rest.
GDN_OPS.declare("KGatedDeltaNetFLA", devices=("cpu", "cuda"), module="ktrans.operators.gdn_fla",
                provided_by="fla-core (`pip install fla-core`) and Triton")
# The C++ fused decode step (ktrans._cpu) for the CPU placement; prefill and mixed steps take the torch op's path.
GDN_OPS.declare("KGatedDeltaNetCPU", devices=("cpu",), module="ktrans.operators.layers_cpu",
                provided_by="the C++ extension ktrans._cpu (built by `pip install -e .`)")


@dataclass
class DeltaNetPlan:
    """Which tokens of a step take the batched decode kernels and which sequences the chunked rule."""

    decode_rows: torch.Tensor | slice | None  # token rows of the decode sequences (slice(None): every row)
    decode_slots: torch.Tensor | None         # [n] their state slots, on the op's device
    prefill: list[tuple[int, int, int, bool]]  # (start, end, slot, fresh) of every other sequence
    # per prefill entry: (n, slot) pairs, the state after its first n tokens also goes to that slot (SeqChunk.emit)
    emits: list[tuple[tuple[int, int], ...]] | None = None


_LAST_PLAN: list = []  # [(batch, device, plan)] of the last step: its DeltaNet layers all see the same batch object


def plan_deltanet(batch: ForwardBatch, device: torch.device) -> DeltaNetPlan:
    """The batching policy of one step, from host lists only. `batch` is the step's batch on `device`. Made once per
    step and device (the 80B's 36 DeltaNet layers plan the same step; mixed steps' plans hold small device tensors)."""
    last = _LAST_PLAN[0] if _LAST_PLAN else None
    if last is not None and last[0] is batch and last[1] == device:
        return last[2]
    plan = _plan_deltanet(batch, device)
    _LAST_PLAN[:] = [(batch, device, plan)]
    return plan


def _plan_deltanet(batch: ForwardBatch, device: torch.device) -> DeltaNetPlan:
    slots = batch.slots if len(batch.slots) == batch.num_seqs else batch.state_slots.tolist()
    cu = batch.cu_seqlens_host
    steps = batch.decode_seqs
    if len(steps) == batch.num_seqs:
        rows, slot_t = slice(None), batch.state_slots
    elif steps:
        rows = torch.tensor([cu[i] for i in steps], dtype=torch.int64, device=device)
        slot_t = torch.tensor([slots[i] for i in steps], dtype=torch.int64, device=device)
    else:
        rows = slot_t = None
    step_set = set(steps)
    others = [i for i in range(batch.num_seqs) if i not in step_set]
    prefill = [(cu[i], cu[i + 1], slots[i], batch.cached_lens[i] == 0) for i in others]
    emits = None
    if batch.emits is not None:
        emits = [tuple((pos - batch.cached_lens[i], slot) for pos, slot in batch.emits[i]) for i in others]
    return DeltaNetPlan(rows, slot_t, prefill, emits)


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The DeltaNet's log-space decay per token and value head, fp32: g = -exp(A_log) softplus(a + dt_bias)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def deltanet_core(layout, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, conv_weight: torch.Tensor, batch: ForwardBatch,
                  plan: DeltaNetPlan) -> torch.Tensor:
    """Conv + gated delta rule of one DeltaNet layer over a batch, reading and writing the batch's state slots.

    mixed [T, conv_dim] is q|k|v before the conv; b, a [T, Hv]; conv_weight [conv_dim, K]. Returns the core
    output [T, Hv, Dv] (before the gated norm). `layout` gives the head layout (layer_idx, num_k_heads, ...).
    """
    t = mixed.shape[0]
    beta = b.sigmoid()
    g = gdn_gate(a, A_log, dt_bias)
    conv_pool, ssm_pool = batch.states.layer(layout.layer_idx)
    core = mixed.new_empty(t, layout.num_v_heads, layout.head_v_dim)

    def split(y: torch.Tensor):
        n = y.shape[0]
        q, k, v = y.split([layout.key_dim, layout.key_dim, layout.value_dim], dim=-1)
        return (q.reshape(n, layout.num_k_heads, layout.head_k_dim),
                k.reshape(n, layout.num_k_heads, layout.head_k_dim), v.reshape(n, layout.num_v_heads, layout.head_v_dim))

    if plan.decode_rows is not None:
        rows, slots = plan.decode_rows, plan.decode_slots
        # index_select / index_copy_ rather than pool[slots]: the same copies, without advanced indexing's slow
        # general path (27x slower for a 2 MiB state row on the CPU); both are capturable in a CUDA graph.
        conv_state, ssm_state = conv_pool.index_select(0, slots), ssm_pool.index_select(0, slots)
        qc, kc, vc = split(causal_conv1d_update(mixed[rows], conv_weight, conv_state))
        core[rows] = gated_delta_rule_decode(qc, kc, vc, g[rows], beta[rows], ssm_state)
        conv_pool.index_copy_(0, slots, conv_state.to(conv_pool.dtype))
        ssm_pool.index_copy_(0, slots, ssm_state)
    for j, (s, e, slot, fresh) in enumerate(plan.prefill):
        conv_in, ssm_in = (None, None) if fresh else (conv_pool[slot], ssm_pool[slot])
        # States the prefix cache snapshots inside the chunk: the sequence runs in pieces that end there.
        cuts = plan.emits[j] if plan.emits else ()
        for a_, b_, to in [(s + p0, s + p1, dst) for (p0, _), (p1, dst) in zip(((0, None),) + cuts, cuts)] + \
                [(s + (cuts[-1][0] if cuts else 0), e, slot)]:
            y, conv_in = causal_conv1d(mixed[a_:b_], conv_weight, conv_in)
            qc, kc, vc = split(y)
            core[a_:b_], ssm_in = chunk_gated_delta_rule(qc, kc, vc, g[a_:b_], beta[a_:b_], ssm_in)
            conv_pool[to] = conv_in.to(conv_pool.dtype)
            ssm_pool[to] = ssm_in
    return core


@GDN_OPS.register("KGatedDeltaNetTorch", devices=("cpu", "cuda"))
class KGatedDeltaNetTorch(Op):
    def __init__(self, operator: "KQwen3NextGatedDeltaNet", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.layer_idx = operator.layer_idx
        self.num_k_heads, self.num_v_heads = operator.num_k_heads, operator.num_v_heads
        self.head_k_dim, self.head_v_dim = operator.head_k_dim, operator.head_v_dim
        self.key_dim, self.value_dim = operator.key_dim, operator.value_dim
        self.eps = operator.eps
        self.specs = {s.name.removeprefix(self.key + "."): s for s in operator.param_specs()}
        self.conv_weight = self.A_log = self.dt_bias = self.norm_weight = None
        self.step: DeltaNetPlan | None = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        s = self.specs
        self.conv_weight = load_param(source, s["conv1d.weight"], dtype, self.device)
        self.A_log = load_param(source, s["A_log"], dtype, self.device)
        self.dt_bias = load_param(source, s["dt_bias"], dtype, self.device)
        self.norm_weight = load_param(source, s["norm.weight"], dtype, self.device)

    def plan(self, batch: ForwardBatch) -> None:
        self.step = plan_deltanet(self.mark_planned(batch), self.device)

    def forward(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """mixed [T, conv_dim] (q|k|v before the conv), z [T, Hv, Dv], b and a [T, Hv] -> normed core [T, value_dim]."""
        if not self.planned_for(batch):
            self.plan(batch)
        t = mixed.shape[0]
        conv_pool, ssm_pool = batch.states.layer(self.layer_idx)
        check_pool_device(self.key, "DeltaNet state", conv_pool, self.device)
        return self.normed_core(mixed, z, b, a, conv_pool, ssm_pool, batch).reshape(t, self.value_dim)

    def normed_core(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    conv_pool: torch.Tensor, ssm_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The planned step's delta rule and its output norm: gated_norm(core(...), z), [T * Hv, Dv]."""
        core = self.core(mixed, b, a, conv_pool, ssm_pool, batch)
        return self.gated_norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))

    def gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The output norm, RMSNorm(core) * weight * SiLU(z), over rows of head_v_dim (the torch reference)."""
        return rms_norm_gated(core, z, self.norm_weight, self.eps)

    def core(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
             ssm_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The planned step's conv and delta rule on this layer's state pools: [T, Hv, Dv] before the gated norm (the
        part other kernels replace)."""
        return deltanet_core(self, mixed, b, a, self.A_log, self.dt_bias, self.conv_weight.squeeze(1), batch,
                             self.step)


@register_operator()
class KQwen3NextGatedDeltaNet(BaseOperator):
    REPLACES = (Qwen3NextGatedDeltaNet,)
    OPS = GDN_OPS
    DEFAULT_OP = "KGatedDeltaNetTorch"
    ADOPT = ("in_proj_qkvz", "in_proj_ba", "out_proj")
    ONE_DEVICE = "its DeltaNet state slots live on one device"

    def __init__(self, key, orig: Qwen3NextGatedDeltaNet, config, **kwargs):
        BaseOperator.__init__(self, key, orig, config, **kwargs)
        for name in ("layer_idx", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                     "conv_kernel_size", "conv_dim"):
            setattr(self, name, getattr(orig, name))
        self.eps = orig.norm.eps
        self._pairs: dict[str, tuple | None] = {}  # per phase: in_proj_qkvz's and in_proj_ba's packed matrices

    def param_specs(self) -> list[ParamSpec]:
        k = self.key
        return [ParamSpec(f"{k}.conv1d.weight", (self.conv_dim, 1, self.conv_kernel_size)),
                ParamSpec(f"{k}.A_log", (self.num_v_heads,)), ParamSpec(f"{k}.dt_bias", (self.num_v_heads,)),
                ParamSpec(f"{k}.norm.weight", (self.head_v_dim,))]

    def _stored_qkvz(self, x: torch.Tensor, phase: str, dev: torch.device) -> list[torch.Tensor] | None:
        """(mixed [T, conv_dim], z [T, value_dim]) from in_proj_qkvz's op where it keeps a split GGUF's stored order
        on this device (KLinearMarlin.forward_stored), else None."""
        lin = self.in_proj_qkvz
        if not isinstance(lin, BaseOperator) or phase not in lin.impl or lin.devices[phase] != dev \
                or lin.out_devices[phase] != dev:
            return None
        stored = getattr(lin.impl[phase], "forward_stored", None)
        outs = stored(x) if stored is not None else None
        if outs is None or [o.shape[-1] for o in outs] != [self.conv_dim, self.value_dim]:
            return None
        return outs

    def _pair(self, phase: str, dev: torch.device) -> tuple | None:
        """(matrices, the two of one type and width that share a launch, in_proj_qkvz's stored row counts) where
        in_proj_qkvz (as stored: one matrix, or attn_qkv and attn_gate of two types) and in_proj_ba are KLinearMarlin
        on this device and two of their matrices match (qlinear_pair takes them: in_proj_ba and a part of
        in_proj_qkvz, whose parts are of two types), else None. The matrices: in_proj_qkvz's stored parts, then
        in_proj_ba's."""
        if phase not in self._pairs:
            self._pairs[phase] = None
            ops = []
            for lin in (self.in_proj_qkvz, self.in_proj_ba):
                ok = isinstance(lin, BaseOperator) and phase in lin.impl and lin.devices[phase] == dev \
                    and lin.out_devices[phase] == dev
                ops.append(lin.impl[phase] if ok else None)
            qkvz, ba = ops
            parts = getattr(qkvz, "parts", None) or []
            rows = getattr(qkvz, "stored_rows", None)
            mats = [p.packed for p in parts] + [ba.packed_weight() if hasattr(ba, "packed_weight") else None]
            if parts and qkvz.bias is None and rows is not None and None not in mats \
                    and list(rows) == [self.conv_dim, self.value_dim] and mats[-1].n == 2 * self.num_v_heads:
                pair = linear_ops.pair_of(mats)
                if pair is not None:
                    self._pairs[phase] = (mats, pair, list(rows))
        return self._pairs[phase]

    def _paired_projections(self, x: torch.Tensor, pair: tuple, grouped: bool = False) -> tuple[torch.Tensor, ...]:
        """(mixed, z, b, a) of one row from in_proj_qkvz and in_proj_ba with two of their matrices in one launch."""
        from ktrans.operators.linear_marlin import run_pair_plan

        mats, two, rows = pair
        outs = run_pair_plan(x, (mats, two))
        mixed, z = outs[0].split(rows, dim=1) if len(mats) == 2 else outs[:2]
        return (mixed.contiguous(), z.reshape(1, self.num_v_heads, self.head_v_dim),
                *self.split_ba(outs[-1], grouped))

    def split_ba(self, ba: torch.Tensor, grouped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj_ba's output, grouped per key head [b (r) | a (r)] -> b, a [T, num_v_heads] (copies: the halves
        interleave), or with `grouped` the [T, num_k_heads, r] views themselves (for an op that takes them:
        TAKES_GROUPED_BA)."""
        t, r = ba.shape[0], self.num_v_heads // self.num_k_heads
        b, a = ba.view(t, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        if grouped and GROUPED_BA:
            return b, a
        return b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)

    def split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor, grouped: bool = False):
        """The projections are grouped per key head: [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)]."""
        t, r = qkvz.shape[0], self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        q, k, v, z = qkvz.view(t, self.num_k_heads, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        return (q, k, v.reshape(t, self.num_v_heads, dv), z.reshape(t, self.num_v_heads, dv),
                *self.split_ba(ba, grouped))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        phase, dev = self.phase_device()
        x, batch = move(x, dev), batch.on(dev)
        t = x.shape[0]
        grouped = getattr(self.op_for(phase), "TAKES_GROUPED_BA", False)
        pair = self._pair(phase, dev) if linear_ops.GEMV_PAIR and t == 1 and x.dim() == 2 else None
        if pair is not None:  # in_proj_ba and a stored part of in_proj_qkvz of its type in one GEMV launch
            mixed, z, b, a = self._paired_projections(x, pair, grouped)
            core = self.op_for(phase)(mixed, z, b, a, batch)
            return self.leave(move(self.out_proj(core), dev), phase)
        stored = self._stored_qkvz(x, phase, dev)
        if stored is not None:  # [q | k | v] of all heads and z straight from the stored tensors: nothing to regroup
            mixed, z = stored  # columns of one output where both tensors are one matrix: rows strided when t > 1
            mixed, z = mixed.contiguous(), z.view(t, self.num_v_heads, self.head_v_dim)  # (one row: no copy)
            b, a = self.split_ba(move(self.in_proj_ba(x), dev), grouped)
        else:
            qkvz, ba = project(x, self.in_proj_qkvz, self.in_proj_ba)
            q, k, v, z, b, a = self.split_projections(move(qkvz, dev), move(ba, dev), grouped)
            mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        core = self.op_for(phase)(mixed, z, b, a, batch)
        return self.leave(move(self.out_proj(core), dev), phase)
