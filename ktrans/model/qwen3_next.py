"""The Qwen3-Next module tree, over flat tokens of many sequences plus a ForwardBatch.

Module, parameter and class names are Hugging Face's (modeling_qwen3_next.py), so hub checkpoints load key for
key and injection rules written for KTransformers match. The tree is built on the meta device and every layer
with math (norms, RoPE, attention, Gated DeltaNet, the MoE block, MLPs, experts) is replaced by its operator
(`ktrans.operators`): the built-in default rules put every module on one device with the reference ops, so the
plain model is the injected model, and each layer's math exists once, in its operator. The classes here only hold
the structure (children and parameter shapes); calling one that was not replaced raises. What stays here is
plumbing: the decoder layer's residual stream (whose adds the norms do), the model's layer loop and the
logits selection.

No padding, no per-module cache objects: attention KV and DeltaNet states live in the pools the batch points at,
addressed by the batch's slot mapping, block tables and state slots.
"""
from __future__ import annotations

import torch
from torch import nn

from ktrans.config import FULL_ATTENTION, ModelConfig
from ktrans.runtime.batch import ForwardBatch


class _Skeleton(nn.Module):
    """A module whose math lives in its operator: it holds children and parameter shapes only."""

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is the module tree's skeleton; its math is its operator's. Load "
                           f"the model with ktrans.inject.load_model (the default rules replace every such module)")


def is_skeleton(module: nn.Module) -> bool:
    """True for the tree's modules whose math is their operator's (they raise when called)."""
    return getattr(type(module), "forward", None) is _Skeleton.forward


class Qwen3NextRMSNorm(_Skeleton):
    """RMSNorm with a zero-centred weight: x / rms(x) * (1 + w), in fp32 (KQwen3NextRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))


class Qwen3NextRMSNormGated(_Skeleton):
    """DeltaNet output norm: RMSNorm (plain weight, not zero-centred) then times SiLU(gate); the DeltaNet op
    applies it."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class Qwen3NextRotaryEmbedding(_Skeleton):
    """cos/sin tables for NeoX-style RoPE on the first head_dim * partial_rotary_factor dims (KQwen3NextRotaryEmbedding);
    no checkpoint tensors."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.rotary_dim = config.rotary_dim


class Qwen3NextAttention(_Skeleton):
    """Gated full attention: q_proj yields query and an output gate per head; q/k RMSNorm before RoPE
    (KQwen3NextAttention)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = Qwen3NextRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3NextRMSNorm(d, eps=config.rms_norm_eps)


class Qwen3NextGatedDeltaNet(_Skeleton):
    """Gated DeltaNet linear attention: causal depthwise conv + gated delta rule, state kept in a slot
    (KQwen3NextGatedDeltaNet)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = config.linear_key_dim
        self.value_dim = config.linear_value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = config.conv_dim
        h = config.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = Qwen3NextRMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)


class Qwen3NextMLP(_Skeleton):
    """SwiGLU MLP: down(silu(gate x) * up x) (KQwen3NextMLP)."""

    def __init__(self, config: ModelConfig, intermediate_size: int):
        super().__init__()
        h = config.hidden_size
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)


class Qwen3NextExperts(nn.ModuleList):
    """The routed experts, one Qwen3NextMLP each, so checkpoints load as mlp.experts.{e}.{gate,up,down}_proj
    (KTransformersExperts)."""

    def __init__(self, config: ModelConfig):
        super().__init__([Qwen3NextMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)])

    forward = _Skeleton.forward


class Qwen3NextSparseMoeBlock(_Skeleton):
    """Softmax top-k routing over the experts plus a sigmoid-gated shared expert (KQwen3NextSparseMoeBlock)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Qwen3NextExperts(config)
        self.shared_expert = Qwen3NextMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = Qwen3NextAttention(config, layer_idx)
        else:
            self.linear_attn = Qwen3NextGatedDeltaNet(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = Qwen3NextSparseMoeBlock(config)
        else:
            self.mlp = Qwen3NextMLP(config, config.intermediate_size)
        self.input_layernorm = Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this layer's MLP output, the residual stream before it). The residual adds happen
        inside the norms (an add+norm kernel where the norm op has one): residual + h is the previous layer's
        output, which the first layer gets as h with no residual."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        if self.layer_type == FULL_ATTENTION:
            h = self.self_attn(h, rope, batch)
        else:
            h = self.linear_attn(h, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3NextRotaryEmbedding(config)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's (MLP output, residual) [T, hidden] each: their sum is the hidden state before the
        final norm, which adds them itself."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary_emb(batch.positions.to(x.device), x.dtype)
        h, residual = x, None
        ropes = {x.device: rope}  # the tables on each device the layers run on, copied once per step
        for layer in self.layers:
            # A model split by layer range (layers 0-23 on cuda:0, 24-47 on cuda:1): the hidden state and the
            # residual cross to the next layer's device here, once per boundary, and stay there for its operators.
            dev = getattr(layer, "_ktrans_device", None)
            if dev is not None and dev != h.device:
                h, residual = hand_off(h, dev), hand_off(residual, dev)
            if h.device not in ropes:
                ropes[h.device] = type(rope)(*(hand_off(t, h.device) for t in rope))
            h, residual = layer(h, residual, ropes[h.device], batch)
        return h, residual


def hand_off(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """`t` on `device`: without blocking the host from one GPU to another (the copy is ordered on both devices'
    streams), blocking where the CPU is on either side. Anything but a tensor passes as it is."""
    if not isinstance(t, torch.Tensor) or t.device == device:
        return t
    return t.to(device, non_blocking=t.device.type == "cuda" and device.type == "cuda")


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3NextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [N, vocab] for the tokens batch.logits_indices names (the last of each sequence by default)."""
        # Active batch: injected operators whose call carries no batch (norms, linears, experts) read the phase here.
        with batch.active():
            h, residual = self.model(batch)
            h, residual = h[batch.on(h.device).logits_indices], residual[batch.on(residual.device).logits_indices]
            return self.lm_head(self.model.norm(h, residual)[0]).float()
