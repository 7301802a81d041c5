"""KQwen3NextGatedDeltaNet: the Gated DeltaNet layer with its state in the engine's slot pool.

The input/output projections are children placed by their own rules. The op owns what runs on the state: the
causal conv (conv1d.weight), the gates (A_log, dt_bias), the gated delta rule and the gated output norm.
KGatedDeltaNetTorch uses the reference kernels; a Triton op (FLA-style chunked kernels) registers into
GDN_OPS with the same call. The state pool pins the operator to one device for both phases.
"""
from __future__ import annotations

import torch

from ktrans.model.qwen3_next import Qwen3NextGatedDeltaNet, Qwen3NextRMSNormGated, deltanet_core
from ktrans.operators.attention import check_pool_device
from ktrans.operators.base import BaseOperator, Op, OpRegistry, ParamSpec, load_param, move, register_operator
from ktrans.runtime.batch import ForwardBatch
from ktrans.weights.source import WeightSource

GDN_OPS = OpRegistry("gated deltanet")


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
        self.conv_weight = self.A_log = self.dt_bias = self.norm = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        s = self.specs
        self.conv_weight = load_param(source, s["conv1d.weight"], dtype, self.device)
        self.A_log = load_param(source, s["A_log"], dtype, self.device)
        self.dt_bias = load_param(source, s["dt_bias"], dtype, self.device)
        self.norm = Qwen3NextRMSNormGated(self.head_v_dim, self.eps)
        self.norm.weight = load_param(source, s["norm.weight"], dtype, self.device)

    def forward(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """mixed [T, conv_dim] (q|k|v before the conv), z [T, Hv, Dv], b and a [T, Hv] -> normed core [T, value_dim].

        The same steps as Qwen3NextGatedDeltaNet.forward, so the injected model matches the plain one exactly.
        """
        t = mixed.shape[0]
        conv_pool, _ = batch.states.layer(self.layer_idx)
        check_pool_device(self.key, "DeltaNet state", conv_pool, self.device)
        core = deltanet_core(self, mixed, b, a, self.A_log, self.dt_bias, self.conv_weight.squeeze(1), batch)
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return core.reshape(t, self.value_dim)


@register_operator()
class KQwen3NextGatedDeltaNet(BaseOperator, Qwen3NextGatedDeltaNet):
    """Derives from the HF class only to reuse split_projections (the per-key-head grouping of the projections)."""

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

    def param_specs(self) -> list[ParamSpec]:
        k = self.key
        return [ParamSpec(f"{k}.conv1d.weight", (self.conv_dim, 1, self.conv_kernel_size)),
                ParamSpec(f"{k}.A_log", (self.num_v_heads,)), ParamSpec(f"{k}.dt_bias", (self.num_v_heads,)),
                ParamSpec(f"{k}.norm.weight", (self.head_v_dim,))]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        phase, dev = self.phase_device()
        x, batch = move(x, dev), batch.on(dev)
        t = x.shape[0]
        q, k, v, z, b, a = self.split_projections(move(self.in_proj_qkvz(x), dev), move(self.in_proj_ba(x), dev))
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        core = self.op_for(phase)(mixed, z, b, a, batch)
        return self.leave(move(self.out_proj(core), dev), phase)
