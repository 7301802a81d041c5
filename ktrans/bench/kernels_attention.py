"""`ktrans bench kernels` cases of the attention family: paged attention, the norms, partial RoPE and the router,
at Qwen3-Next-80B's shapes (head_dim 256, 16 query / 2 KV heads, hidden 2048, 512 experts top-10, page 16).

- decode at 32k context, B=1 and B=16: bytes are the KV rows read (the figure the 70%-of-HBM target is about);
- prefill T=4096 from an empty cache, with torch SDPA (causal, 16 heads, d=256, KV repeated to 16 heads) as the
  peer, and a 2048-token chunk over a 30k cached prefix;
- the norms, RoPE and router at decode (T=1, 16) and prefill (T=4096) sizes, each with its torch op as the peer.

The Triton modules are imported in the setups, so this module imports where triton does not (its cases then
report the ImportError as their error). Without CUDA the sizes shrink to a smoke run (bench/kernels.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktrans.bench.kernels import Timed, case
from ktrans.config import ModelConfig
from ktrans.model.tiny import preset_config

PAGE = 16
_CONFIG: ModelConfig | None = None


def real_config() -> ModelConfig:
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = ModelConfig.from_hf_dict(preset_config("qwen3-next-80b-a3b"))
    return _CONFIG


def _dtype(dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _scaled(n: int, dev: torch.device, cpu_n: int) -> int:
    """The real size on CUDA, a smoke-run size on the CPU (the interpreter would take minutes)."""
    return n if dev.type == "cuda" else cpu_n


def _paged_cache(batch: int, kv_len: int, dev: torch.device):
    """K/V caches holding `batch` sequences of kv_len tokens in shuffled pages, their block tables and lengths."""
    c = real_config()
    pages = -(-kv_len // PAGE)
    total = batch * pages
    shape = ((total + 1) * PAGE, c.num_key_value_heads, c.head_dim)
    k = torch.randn(shape, dtype=_dtype(dev), device=dev)
    v = torch.randn(shape, dtype=_dtype(dev), device=dev)
    tables = torch.randperm(total, device=dev).view(batch, pages)
    lens = torch.full((batch,), kv_len, dtype=torch.int64, device=dev)
    return k, v, tables, lens


def _decode(batch: int, kv_len: int, dev: torch.device, split_tokens: int | None = None) -> Timed:
    """split_tokens: keys per split instead of plan_decode's choice (to measure the planner's guesses)."""
    from ktrans.kernels.triton import attention as tri

    c = real_config()
    kv_len = _scaled(kv_len, dev, 200)
    k, v, tables, lens = _paged_cache(batch, kv_len, dev)
    q = torch.randn(batch, c.num_attention_heads, c.head_dim, dtype=k.dtype, device=dev)
    out = torch.empty_like(q)
    plan = tri.plan_decode(batch, c.num_key_value_heads, kv_len, dev)
    if split_tokens is not None and dev.type == "cuda":
        plan = tri.DecodePlan(-(-kv_len // split_tokens), split_tokens)
    kv_bytes = 2 * batch * kv_len * c.num_key_value_heads * c.head_dim * k.element_size()
    flops = 4 * batch * kv_len * c.num_attention_heads * c.head_dim

    def copy(i: int):  # another layer's cache of the same size (a decode step's attention layers, back to back)
        k_i, v_i, tables_i, lens_i = _paged_cache(batch, kv_len, dev)
        q_i, out_i = torch.randn_like(q), torch.empty_like(q)
        return lambda: tri.paged_decode(q_i, k_i, v_i, lens_i, tables_i, PAGE, c.head_dim ** -0.5, plan, out=out_i)

    return Timed(lambda: tri.paged_decode(q, k, v, lens, tables, PAGE, c.head_dim ** -0.5, plan, out=out),
                 kv_bytes, flops, copies=copy if dev.type == "cuda" else None)


@case("attention", "decode 32k B=1", ("decode",))
def decode_32k_b1(dev: torch.device) -> Timed:
    return _decode(1, 32768, dev)


@case("attention", "decode 32k B=1, splits of 512", ("decode",))
def decode_32k_b1_512(dev: torch.device) -> Timed:
    return _decode(1, 32768, dev, split_tokens=512)


@case("attention", "decode 32k B=1, splits of 128", ("decode",))
def decode_32k_b1_128(dev: torch.device) -> Timed:
    return _decode(1, 32768, dev, split_tokens=128)


@case("attention", "decode 1k B=1", ("decode",))
def decode_1k_b1(dev: torch.device) -> Timed:
    return _decode(1, 1024, dev)


@case("attention", "decode 1k B=1, splits of 64", ("decode",))
def decode_1k_b1_64(dev: torch.device) -> Timed:
    """KTRANS_ATTN_SHORT_SPLITS's plan at a batch-1 step's 1k bucket: 16 splits of one key block."""
    return _decode(1, 1024, dev, split_tokens=64)


@case("attention", "decode 32k B=16", ("decode",))
def decode_32k_b16(dev: torch.device) -> Timed:
    return _decode(16, 32768, dev)


def _prefill(new: int, prefix: int, dev: torch.device, peer: bool) -> Timed:
    from ktrans.kernels.triton import attention as tri

    c = real_config()
    new, prefix = _scaled(new, dev, 40), _scaled(prefix, dev, 24)
    kv_len = prefix + new
    k, v, tables, _ = _paged_cache(1, kv_len, dev)
    hq, d = c.num_attention_heads, c.head_dim
    q = torch.randn(new, hq, d, dtype=k.dtype, device=dev)
    out = torch.empty_like(q)
    cu = torch.tensor([0, new], device=dev)
    lens = torch.tensor([kv_len], device=dev)
    scale = d ** -0.5
    return prefill_timed(lambda: tri.paged_prefill(q, k, v, cu, lens, tables, PAGE, scale, new, out=out), q, prefix,
                         k.element_size(), peer)


def prefill_timed(fn, q: torch.Tensor, prefix: int, elem: int, peer: bool) -> Timed:
    """A prefill case's Timed: q [new, Hq, D] over `prefix` cached keys; with `peer`, causal SDPA alike."""
    c = real_config()
    new, hq, d = q.shape
    hkv = c.num_key_value_heads
    moved = (2 * new * hq * d + 2 * (prefix + new) * hkv * d) * elem  # q read, o written, the K and V read once
    flops = 4 * hq * d * (new * prefix + new * (new + 1) // 2)  # QK^T and PV over the causal triangle
    if not peer:
        return Timed(fn, moved, flops)
    # The peer: plain causal SDPA on contiguous [1, H, T, D] tensors, KV repeated to the 16 query heads.
    qs = q.transpose(0, 1)[None].contiguous()
    ks = torch.randn(1, hq, new, d, dtype=q.dtype, device=q.device)
    vs = torch.randn_like(ks)
    return Timed(fn, moved, flops, peer=lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                 peer_name="sdpa")


@case("attention", "prefill T=4096", ("prefill",))
def prefill_4096(dev: torch.device) -> Timed:
    return _prefill(4096, 0, dev, peer=True)


@case("attention", "prefill T=2048 over a 30k prefix", ("prefill",))
def prefill_2048_prefix(dev: torch.device) -> Timed:
    return _prefill(2048, 30720, dev, peer=False)


def _norm_residual(t: int, dev: torch.device) -> Timed:
    from ktrans.kernels.triton import norm as tri
    from ktrans.operators.norm import rms_norm

    c = real_config()
    x, r = (torch.randn(t, c.hidden_size, dtype=_dtype(dev), device=dev) for _ in range(2))
    w = torch.randn(c.hidden_size, dtype=x.dtype, device=dev)
    eps = c.rms_norm_eps
    return Timed(lambda: tri.rms_norm(x, w, eps, residual=r), 4 * x.numel() * x.element_size(),
                 peer=lambda: rms_norm(r + x, w, eps), peer_name="torch")


def _norm_gated(t: int, dev: torch.device) -> Timed:
    from ktrans.kernels.triton import norm as tri
    from ktrans.operators.norm import rms_norm_gated

    c = real_config()
    shape = (t * c.linear_num_value_heads, c.linear_value_head_dim)
    x, g = (torch.randn(shape, dtype=_dtype(dev), device=dev) for _ in range(2))
    w = torch.randn(shape[1], dtype=x.dtype, device=dev)
    eps = c.rms_norm_eps
    return Timed(lambda: tri.rms_norm_gated(x, g, w, eps), 3 * x.numel() * x.element_size(),
                 peer=lambda: rms_norm_gated(x, g, w, eps), peer_name="torch")


def _rope(t: int, dev: torch.device) -> Timed:
    from ktrans.kernels.triton import rope as tri
    from ktrans.operators.rope import apply_rope, rope_cos_sin, rope_inv_freq

    c = real_config()
    q = torch.randn(t, c.num_attention_heads, c.head_dim, dtype=_dtype(dev), device=dev)
    k = torch.randn(t, c.num_key_value_heads, c.head_dim, dtype=q.dtype, device=dev)
    cos, sin = rope_cos_sin(torch.arange(t, device=dev), rope_inv_freq(c), q.dtype)
    # In place, the rotary quarter of each head is read and written; the tables are read once.
    moved = (2 * (q.shape[1] + k.shape[1]) * t * c.rotary_dim + 2 * cos.numel()) * q.element_size()
    return Timed(lambda: tri.rope_qk_(q, k, cos, sin), moved,
                 peer=lambda: (apply_rope(q, cos, sin), apply_rope(k, cos, sin)), peer_name="torch")


def _router(t: int, dev: torch.device) -> Timed:
    from ktrans.kernels.triton import router as tri
    from ktrans.operators.moe import route

    c = real_config()
    logits = torch.randn(t, c.num_experts, dtype=_dtype(dev), device=dev)
    k = c.num_experts_per_tok
    moved = logits.numel() * logits.element_size() + t * k * (8 + logits.element_size())
    return Timed(lambda: tri.route(logits, k, c.norm_topk_prob), moved,
                 peer=lambda: route(logits, k, c.norm_topk_prob), peer_name="torch")


def _gated_sum(t: int, dev: torch.device) -> Timed:
    from ktrans.kernels.triton import router as tri

    c = real_config()
    routed, shared = (torch.randn(t, c.hidden_size, dtype=_dtype(dev), device=dev) for _ in range(2))
    gate = torch.randn(t, 1, dtype=routed.dtype, device=dev)
    return Timed(lambda: tri.gated_sum(routed, shared, gate), 3 * routed.numel() * routed.element_size(),
                 peer=lambda: routed + torch.sigmoid(gate) * shared, peer_name="torch")


def _register_sized(name: str, setup, sizes: tuple[int, ...]) -> None:
    for t in sizes:
        tag = "decode" if t <= 64 else "prefill"
        case("attention", f"{name} T={t}", (tag,))(lambda dev, t=t: setup(_scaled(t, dev, min(t, 33)), dev))


_register_sized("rmsnorm+residual", _norm_residual, (1, 16, 4096))
_register_sized("rmsnorm_gated", _norm_gated, (1, 16, 4096))
_register_sized("rope q+k", _rope, (1, 16, 4096))
_register_sized("router top-10/512", _router, (1, 16, 4096))
_register_sized("moe gated sum", _gated_sum, (1, 16, 4096))
