"""KGatedDeltaNetFLA: the Gated DeltaNet op with fla-core's recurrent kernel for decode steps (an optional backend:
`pip install fla-core`; rules select it by name, e.g. `generate_op: KGatedDeltaNetFLA`).

A decode-only step (every sequence one token, the CUDA graphs' steps) runs:
- the conv window update and SiLU as a few indexed torch ops on the slot pool (graph-safe: the slots are a device
  tensor of the batch, no host read);
- fla-core's `fused_recurrent_gated_delta_rule` over the rows as a batch of one-token sequences, with the gates
  (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) and the q/k L2 norm inside its kernel, starting from
  the rows' slots of the state pool and writing the final states back there.

Every other step (prefill, mixed) takes this project's own Triton kernels, as KGatedDeltaNetTriton runs them:
fla-core's chunked kernel cannot be tested where there is no GPU (its autotuners ask for a driver under Triton's
interpreter), and the prefix cache's mid-prefill state snapshots are ours alone. fla-core's state layout is the
pool's ([N, HV, K, V], fp32) and its value head h reads key head h // (HV / H), as ours does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktrans.operators.gdn import GDN_OPS
from ktrans.operators.gdn_triton import KGatedDeltaNetTriton
from ktrans.runtime.batch import ForwardBatch


def _recurrent():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as e:
        raise RuntimeError(f"KGatedDeltaNetFLA needs fla-core (`pip install fla-core`): {e}") from None
    return fused_recurrent_gated_delta_rule


@GDN_OPS.register("KGatedDeltaNetFLA", devices=("cpu", "cuda"))
class KGatedDeltaNetFLA(KGatedDeltaNetTriton):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        self._fla = _recurrent()  # before the Triton checks: the missing package is the first thing to say
        super().__init__(operator, device, streaming)

    def core(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
             ssm_pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        step = self.step
        if self.chunks is not None or step.decode_rows is None:
            return super().core(mixed, b, a, conv_pool, ssm_pool, batch)
        rows, slots = step.decode_rows, step.decode_slots
        x, a, b = mixed[rows], a[rows], b[rows]
        n = x.shape[0]
        # the conv: the slot's K-1 inputs then this one, times the weights, SiLU; the window moves on by one
        window = torch.cat([conv_pool[slots].float(), x.float().unsqueeze(-1)], dim=-1)  # [n, C, K]
        y = F.silu((window * self.conv_weight.squeeze(1).float()).sum(-1))
        conv_pool[slots] = window[..., 1:].to(conv_pool.dtype)
        kd, hk, dk, hv, dv = self.key_dim, self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        q = y[:, :kd].reshape(n, 1, hk, dk)
        k = y[:, kd:2 * kd].reshape(n, 1, hk, dk)
        v = y[:, 2 * kd:].reshape(n, 1, hv, dv)
        o, final = self._fla(q, k, v, g=a.float().reshape(n, 1, hv), beta=b.float().reshape(n, 1, hv),
                             initial_state=ssm_pool[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, A_log=self.A_log.float(), dt_bias=self.dt_bias.float(),
                             use_beta_sigmoid_in_kernel=True)
        ssm_pool[slots] = final
        core = mixed.new_empty(mixed.shape[0], hv, dv)
        core[rows] = o.reshape(n, hv, dv).to(core.dtype)
        return core
