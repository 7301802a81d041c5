"""KGatedDeltaNetFLA: the Gated DeltaNet op with fla-core's recurrent kernel for decode steps (an optional backend:
`pip install fla-core`; rules select it by name, e.g. `generate_op: KGatedDeltaNetFLA`).

A decode-only step (every sequence one token, the CUDA graphs' steps) runs:
- the conv window update and SiLU as a few indexed torch ops on the slot pool (graph-safe: the slots are a device
  tensor of the batch, no host read);
- fla-core's `fused_recurrent_gated_delta_rule` over the rows as a batch of one-token sequences, with the gates
  (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) and the q/k L2 norm inside its kernel, starting from
  the rows' slots of the state pool and writing the final states back there.

On a GPU, a step with prefill sequences runs their conv with our varlen kernel and the delta rule with fla-core's
`chunk_gated_delta_rule` over them packed (cu_seqlens; initial states from the slots, zero for fresh sequences;
final states written back), and its decode rows as above. Steps whose sequences emit mid-prefill states for the
prefix cache take our Triton kernels (fla-core does not emit them), and so does every prefill step under Triton's
interpreter: fla-core's chunked kernel does not run there (its autotuners ask for a GPU driver), so CI tests the
decode path and the GPU tests the chunked one. fla-core's state layout is the pool's ([N, HV, K, V], fp32) and its
value head h reads key head h // (HV / H), as ours does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktrans.kernels.triton import interpreting
from ktrans.kernels.triton.conv import causal_conv1d_varlen
from ktrans.operators.gdn import GDN_OPS, gdn_gate
from ktrans.operators.gdn_triton import KGatedDeltaNetTriton
from ktrans.runtime.batch import ForwardBatch


def _kernels():
    """fla-core's (recurrent, chunked) gated delta rule."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:
        raise RuntimeError(f"KGatedDeltaNetFLA needs fla-core (`pip install fla-core`): {e}") from None
    return fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


@GDN_OPS.register("KGatedDeltaNetFLA", devices=("cpu", "cuda"))
class KGatedDeltaNetFLA(KGatedDeltaNetTriton):
    TAKES_GROUPED_BA = False  # fla-core's kernels read [T, HV] rows

    def __init__(self, operator, device: torch.device, streaming: bool = False):
        self._fla, self._chunk = _kernels()  # before the Triton checks: the missing package is the first thing to say
        super().__init__(operator, device, streaming)

    def core(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
             ssm_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        step = self.step
        if self.chunks is not None and (step.emits or interpreting()):
            return super().core(mixed, b, a, conv_pool, ssm_pool, batch)
        core = mixed.new_empty(mixed.shape[0], self.num_v_heads, self.head_v_dim)
        if step.decode_rows is not None:
            self._decode(core, mixed, b, a, conv_pool, ssm_pool, step.decode_rows, step.decode_slots)
        if self.chunks is not None:
            self._prefill(core, mixed, b, a, conv_pool, ssm_pool, step.prefill)
        return core

    def _split(self, y: torch.Tensor, n: int, t: int):
        kd, hk, dk, hv, dv = self.key_dim, self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        return (y[:, :kd].reshape(n, t, hk, dk), y[:, kd:2 * kd].reshape(n, t, hk, dk),
                y[:, 2 * kd:].reshape(n, t, hv, dv))

    def _decode(self, core, mixed, b, a, conv_pool, ssm_pool, rows, slots) -> None:
        x, a, b = mixed[rows], a[rows], b[rows]
        n, hv = x.shape[0], self.num_v_heads
        # the conv: the slot's K-1 inputs then this one, times the weights, SiLU; the window moves on by one
        window = torch.cat([conv_pool[slots].float(), x.float().unsqueeze(-1)], dim=-1)  # [n, C, K]
        y = F.silu((window * self.conv_weight.squeeze(1).float()).sum(-1))
        conv_pool[slots] = window[..., 1:].to(conv_pool.dtype)
        q, k, v = self._split(y, n, 1)
        o, final = self._fla(q, k, v, g=a.float().reshape(n, 1, hv), beta=b.float().reshape(n, 1, hv),
                             initial_state=ssm_pool[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, A_log=self.A_log.float(), dt_bias=self.dt_bias.float(),
                             use_beta_sigmoid_in_kernel=True)
        ssm_pool[slots] = final
        core[rows] = o.reshape(n, hv, self.head_v_dim).to(core.dtype)

    def _prefill(self, core, mixed, b, a, conv_pool, ssm_pool, seqs) -> None:
        """The prefill sequences (start, end, slot, fresh), packed in step order, through fla-core's chunked rule."""
        dev = mixed.device
        y = causal_conv1d_varlen(mixed, self.conv_weight.squeeze(1), conv_pool, self.chunks)
        rows = torch.cat([torch.arange(s, e) for s, e, _, _ in seqs]).to(dev, non_blocking=True)
        lens = torch.tensor([0] + [e - s for s, e, _, _ in seqs]).cumsum(0)
        slots = torch.tensor([slot for _, _, slot, _ in seqs]).to(dev, non_blocking=True)
        fresh = torch.tensor([f for _, _, _, f in seqs]).to(dev, non_blocking=True)
        t = int(lens[-1])
        q, k, v = self._split(y[rows], 1, t)
        g = gdn_gate(a[rows], self.A_log, self.dt_bias.float())
        h0 = torch.where(fresh[:, None, None, None], 0.0, ssm_pool[slots])
        o, final = self._chunk(q, k, v, g[None], b[rows].float().sigmoid()[None], initial_state=h0,
                                output_final_state=True, use_qk_l2norm_in_kernel=True,
                                cu_seqlens=lens.to(dev, non_blocking=True), cu_seqlens_cpu=lens)
        ssm_pool[slots] = final
        core[rows] = o.reshape(t, self.num_v_heads, self.head_v_dim).to(core.dtype)
