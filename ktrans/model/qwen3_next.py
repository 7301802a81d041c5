"""The Qwen3-Next network in plain torch, over flat tokens of many sequences plus a ForwardBatch.

Module, parameter and class names are Hugging Face's (modeling_qwen3_next.py), so hub checkpoints load key for
key and injection rules written for KTransformers match. The math follows that file exactly (zero-centred RMSNorm,
gated attention with partial NeoX RoPE, Gated DeltaNet, softmax top-k routing with a sigmoid-gated shared expert);
what differs is the plumbing: no padding, no per-module cache objects. Attention KV and DeltaNet states live in
the pools the batch points at, addressed by the batch's slot mapping, block tables and state slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktrans.config import FULL_ATTENTION, ModelConfig
from ktrans.kernels.torch.attention import paged_attention, write_kv
from ktrans.kernels.torch.conv import causal_conv1d, causal_conv1d_update
from ktrans.kernels.torch.gated_delta import chunk_gated_delta_rule, gated_delta_rule_decode
from ktrans.runtime.batch import ForwardBatch


class Qwen3NextRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: x / rms(x) * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Qwen3NextRMSNormGated(nn.Module):
    """DeltaNet output norm: RMSNorm (plain weight, not zero-centred) then times SiLU(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)  # HF rounds to the input dtype before the weight; keep that for parity
        return (out * F.silu(gate.float())).to(dtype)


class Qwen3NextRotaryEmbedding(nn.Module):
    """cos/sin tables for NeoX-style RoPE on the first head_dim * partial_rotary_factor dims."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        dim = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, rotary_dim]. Rotates the first rotary_dim dims, passes the rest through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((rot, rest), dim=-1)


class Qwen3NextAttention(nn.Module):
    """Gated full attention: q_proj yields query and an output gate per head; q/k RMSNorm before RoPE."""

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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(t, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d))
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        k_cache, v_cache = batch.kv.layer(self.layer_idx)
        write_kv(k_cache, v_cache, batch.slot_mapping, k.to(k_cache.dtype), v.to(v_cache.dtype))
        out = paged_attention(q, k_cache, v_cache, batch.cu_seqlens, batch.kv_lens, batch.block_tables,
                              batch.kv.page_size, self.scaling)
        out = out.reshape(t, -1) * torch.sigmoid(gate)
        return self.o_proj(out)


class Qwen3NextGatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention: causal depthwise conv + gated delta rule, state kept in a slot."""

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

    def split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """The projections are grouped per key head: [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)]."""
        t, r = qkvz.shape[0], self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        q, k, v, z = qkvz.view(t, self.num_k_heads, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(t, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        return (q, k, v.reshape(t, self.num_v_heads, dv), z.reshape(t, self.num_v_heads, dv),
                b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v, z, b, a = self.split_projections(self.in_proj_qkvz(x), self.in_proj_ba(x))
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        core = deltanet_core(self, mixed, b, a, self.A_log, self.dt_bias, self.conv1d.weight.squeeze(1), batch)
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(t, self.value_dim))


def deltanet_core(shape, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor, conv_weight: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Conv + gated delta rule of one DeltaNet layer over a batch, reading and writing the batch's state slots.

    mixed [T, conv_dim] is q|k|v before the conv; b, a [T, Hv]; conv_weight [conv_dim, K]. Returns the core
    output [T, Hv, Dv] (before the gated norm). `shape` gives the head layout (layer_idx, num_k_heads, ...).
    One-token steps of already-started sequences run together through the batched decode kernels, also when
    prefill chunks share the batch; every other sequence runs the chunked rule alone. A sequence whose cached
    length is 0 starts from zero state, so a reused slot never leaks its previous owner's state.
    """
    t = mixed.shape[0]
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    conv_pool, ssm_pool = batch.states.layer(shape.layer_idx)
    core = mixed.new_empty(t, shape.num_v_heads, shape.head_v_dim)

    def split(y: torch.Tensor):
        n = y.shape[0]
        q, k, v = y.split([shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
        return (q.reshape(n, shape.num_k_heads, shape.head_k_dim), k.reshape(n, shape.num_k_heads, shape.head_k_dim),
                v.reshape(n, shape.num_v_heads, shape.head_v_dim))

    cu = batch.cu_seqlens.tolist()
    steps = [i for i, (n, c) in enumerate(zip(batch.seq_lens, batch.cached_lens)) if n == 1 and c > 0]
    if steps:
        if len(steps) == batch.num_seqs:
            rows, slots = slice(None), batch.state_slots
        else:
            rows = torch.tensor([cu[i] for i in steps], device=mixed.device)
            slots = batch.state_slots[torch.tensor(steps, device=batch.state_slots.device)]
        conv_state, ssm_state = conv_pool[slots], ssm_pool[slots]
        qc, kc, vc = split(causal_conv1d_update(mixed[rows], conv_weight, conv_state))
        core[rows] = gated_delta_rule_decode(qc, kc, vc, g[rows], beta[rows], ssm_state)
        conv_pool[slots] = conv_state.to(conv_pool.dtype)
        ssm_pool[slots] = ssm_state
    if len(steps) < batch.num_seqs:
        step_set = set(steps)
        for i, slot in enumerate(batch.state_slots.tolist()):
            if i in step_set:
                continue
            s, e = cu[i], cu[i + 1]
            fresh = batch.cached_lens[i] == 0
            y, conv_out = causal_conv1d(mixed[s:e], conv_weight, None if fresh else conv_pool[slot])
            qc, kc, vc = split(y)
            core[s:e], ssm_out = chunk_gated_delta_rule(qc, kc, vc, g[s:e], beta[s:e],
                                                        None if fresh else ssm_pool[slot])
            conv_pool[slot] = conv_out.to(conv_pool.dtype)
            ssm_pool[slot] = ssm_out
    return core


class Qwen3NextMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int):
        super().__init__()
        h = config.hidden_size
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3NextExperts(nn.ModuleList):
    """The routed experts, one Qwen3NextMLP each, so checkpoints load as mlp.experts.{e}.{gate,up,down}_proj."""

    def __init__(self, config: ModelConfig):
        super().__init__([Qwen3NextMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)])

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(topk_ids).tolist():
            tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            y = self[e](x[tok]) * topk_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top k, renormalise them when norm_topk_prob."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


class Qwen3NextSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Qwen3NextExperts(config)
        self.shared_expert = Qwen3NextMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        ids, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)
        routed = self.experts(x, ids, weights)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared


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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == FULL_ATTENTION:
            h = self.self_attn(h, rope, batch)
        else:
            h = self.linear_attn(h, batch)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3NextRotaryEmbedding(config)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the last layer, before the final norm: [T, hidden]."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary_emb(batch.positions.to(x.device), x.dtype)
        for layer in self.layers:
            x = layer(x, rope, batch)
        return x


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
            h = self.model(batch)
            h = h[batch.logits_indices.to(h.device)]
            return self.lm_head(self.model.norm(h)).float()
