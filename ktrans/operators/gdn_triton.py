"""KGatedDeltaNetTriton: the Gated DeltaNet op on the Triton kernels (`ktrans/kernels/triton/`).

The same call and the same batching policy as KGatedDeltaNetTorch (`plan_deltanet`): the one-token rows of started
sequences take the fused decode kernel (conv window, gates, L2 norm and recurrent update in one launch, in place
in the state pool), every other sequence of the step goes through the varlen conv and the chunked delta rule
together, three launches for all of them. A mixed step runs both. The gated output norm is one Triton launch
(`ktrans.kernels.triton.norm.rms_norm_gated`, rounding where the torch function rounds) where the torch function took
about ten kernels a layer.

Imported lazily by GDN_OPS (declared in gdn.py), so ktrans imports where Triton does not. On a CPU device it runs
only under Triton's interpreter (TRITON_INTERPRET=1: the tests).
"""
from __future__ import annotations

import os

import torch

from ktrans.kernels.triton import gated_delta_decode as decode_kernels
from ktrans.kernels.triton import interpreting, unavailable_reason
from ktrans.kernels.triton.conv import causal_conv1d_varlen
from ktrans.kernels.triton.gated_delta import CHUNK, ChunkPlan, chunk_gated_delta_rule_varlen, plan_chunks
from ktrans.kernels.triton.gated_delta_decode import gated_delta_decode
from ktrans.kernels.triton.norm import rms_norm_gated as tri_rms_norm_gated
from ktrans.operators.gdn import GDN_OPS, KGatedDeltaNetTorch, plan_deltanet
from ktrans.runtime.batch import ForwardBatch

# KTRANS_GDN_DECODE_NORM=1 (off until timed on a GPU): a decode-only step's gated output norm made inside the
# decode step's state launch (gated_delta_decode's `norm`: each value head's last column block to finish norms the
# head's row), one launch a DeltaNet layer fewer (36 a token at the 80B's shapes).
DECODE_NORM = os.environ.get("KTRANS_GDN_DECODE_NORM", "0") == "1"

# The chunk table of the step last planned, shared by every DeltaNet layer of that step (one host-to-device copy
# per step, not per layer). Keyed by the batch object itself: a step's layers all see the same one.
_last_chunks: list[tuple[ForwardBatch, ChunkPlan]] = []
_last_emits: list[tuple[ForwardBatch, ChunkPlan]] = []  # the same for a step whose sequences emit states


def _per_step(cache: list[tuple[ForwardBatch, ChunkPlan]], batch: ForwardBatch, make) -> ChunkPlan:
    """The table `make()` builds, once per step: the step's layers all see the same batch object."""
    if not (cache and cache[0][0] is batch):
        cache[:] = [(batch, make())]
    return cache[0][1]


def _emit_plan(batch: ForwardBatch, step, device: torch.device) -> ChunkPlan:
    """The chunked rule's table for a step whose sequences also emit states (SeqChunk.emit): chunks aligned to
    absolute multiples of 64, each boundary that an emit names storing the state into its slot, the others none."""
    starts, emit = [], []
    for (s, e, _slot, _fresh), cuts in zip(step.prefill, step.emits):
        pos = _cached_len(batch, s)
        starts.append(pos)
        want = {pos + n: slot for n, slot in cuts}
        if any(p % CHUNK for p in want):
            raise ValueError(f"emitted states must sit at multiples of {CHUNK} tokens, got {sorted(want)}")
        first = pos // CHUNK + 1
        emit.append([want.get(p * CHUNK, -1) for p in range(first, (pos + e - s) // CHUNK + 1)])
    return plan_chunks(step.prefill, device, starts, emit)


def _cached_len(batch: ForwardBatch, row: int) -> int:
    """The cached length of the sequence whose tokens start at flat row `row`."""
    return batch.cached_lens[batch.cu_seqlens_host.index(row)]


def _emitted_windows(mixed: torch.Tensor, conv_pool: torch.Tensor, step) -> list[tuple[int, torch.Tensor]]:
    """The conv windows of the emitted states: the K-1 inputs before each emit position, [C, K-1] oldest first,
    read before the conv kernel overwrites a sequence's carried window (which a window near the start includes)."""
    width = conv_pool.shape[-1]
    out = []
    for (s, _e, slot, fresh), cuts in zip(step.prefill, step.emits):
        if not cuts:
            continue
        carried = conv_pool.new_zeros(conv_pool.shape[1:]) if fresh else conv_pool[slot].clone()
        for n, dst in cuts:
            rows = mixed[max(s, s + n - width): s + n].t()
            if rows.shape[1] < width:
                rows = torch.cat([carried[:, rows.shape[1]:].to(rows.dtype), rows], dim=1)
            out.append((dst, rows))
    return out


@GDN_OPS.register("KGatedDeltaNetTriton", devices=("cpu", "cuda"))
class KGatedDeltaNetTriton(KGatedDeltaNetTorch):
    # b and a may come as [T, HK, R] views of in_proj_ba's output (KQwen3NextGatedDeltaNet.split_ba): no copy a layer
    TAKES_GROUPED_BA = True

    def __init__(self, operator, device: torch.device, streaming: bool = False):
        why = unavailable_reason()
        if why is None and device.type == "cpu" and not interpreting():
            why = "on the CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, for tests)"
        if why:
            raise RuntimeError(f"{operator.key}: KGatedDeltaNetTriton cannot run on {device}: {why}")
        super().__init__(operator, device, streaming)
        self.chunks: ChunkPlan | None = None
        self.emit_chunks: ChunkPlan | None = None

    def plan(self, batch: ForwardBatch) -> None:
        batch = self.mark_planned(batch)
        self.step = plan_deltanet(batch, self.device)
        step = self.step
        self.chunks = _per_step(_last_chunks, batch, lambda: plan_chunks(step.prefill, self.device)) \
            if step.prefill else None
        self.emit_chunks = _per_step(_last_emits, batch, lambda: _emit_plan(batch, step, self.device)) \
            if step.emits else None

    def gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return tri_rms_norm_gated(core, z, self.norm_weight, self.eps)

    def normed_core(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    conv_pool: torch.Tensor, ssm_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # a step of decode rows only, with DECODE_NORM: the output norm made by the decode step's state launch
        step = self.step
        own = type(self).core is KGatedDeltaNetTriton.core and type(self).gated_norm is KGatedDeltaNetTriton.gated_norm
        if not (DECODE_NORM and own and self.chunks is None and step.decode_rows is not None and z.dim() == 3
                and z.stride(-1) == 1 and decode_kernels.TWO_LAUNCHES):
            return super().normed_core(mixed, z, b, a, conv_pool, ssm_pool, batch)
        return self.core(mixed, b, a, conv_pool, ssm_pool, batch, norm=(z, self.norm_weight, self.eps)).reshape(
            -1, self.head_v_dim)

    def core(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
             ssm_pool: torch.Tensor, batch: ForwardBatch, norm=None) -> torch.Tensor:
        """norm: gated_delta_decode's (a step of decode rows only): the output normed."""
        t = mixed.shape[0]
        conv_w = self.conv_weight.squeeze(1)
        mixed = mixed.contiguous()
        # a, b as [T, HK, R] views of in_proj_ba's output (TAKES_GROUPED_BA): the decode kernels read them in place;
        # the chunked rule of a step with prefill reads [T, HV] rows (one copy each)
        if a.dim() == 3 and self.chunks is not None:
            a, b = a.reshape(t, self.num_v_heads), b.reshape(t, self.num_v_heads)
        if a.dim() == 2:
            a, b = a.contiguous(), b.contiguous()
        core = mixed.new_empty(t, self.num_v_heads, self.head_v_dim)
        step = self.step
        if step.decode_rows is not None:
            rows = None if isinstance(step.decode_rows, slice) else step.decode_rows
            gated_delta_decode(mixed, a, b, self.A_log, self.dt_bias, conv_w, conv_pool, ssm_pool, step.decode_slots,
                               self.num_k_heads, self.head_k_dim, rows=rows, out=core, norm=norm)
        if self.chunks is not None:
            windows = _emitted_windows(mixed, conv_pool, step) if step.emits else None
            y = causal_conv1d_varlen(mixed, conv_w, conv_pool, self.chunks)
            kd, hk, dk = self.key_dim, self.num_k_heads, self.head_k_dim
            q = y[:, :kd].view(t, hk, dk)
            k = y[:, kd:2 * kd].view(t, hk, dk)
            v = y[:, 2 * kd:].view(t, self.num_v_heads, self.head_v_dim)
            chunk_gated_delta_rule_varlen(q, k, v, a, b, self.A_log, self.dt_bias, ssm_pool,
                                          self.emit_chunks or self.chunks, out=core)
            if windows is not None:
                for slot, window in windows:
                    conv_pool[slot] = window.to(conv_pool.dtype)
        return core
