"""The C++ decode-step kernels of the DeltaNet and attention layers (ktrans._cpu, csrc/cpu/layers.*) from Python.

`gdn_decode` is one fused Gated DeltaNet step for B sequences of one token each (conv window + causal conv + SiLU,
the gates, q/k L2 norm, the delta rule in place in the state pool, the gated RMSNorm of the output); `attn_decode`
writes B new tokens' K and V into the paged cache and attends each sequence over its pages. Their references are
ktrans/kernels/torch/{conv,gated_delta,attention}.py and ktrans/operators/norm.py `rms_norm_gated`. `rms_norm`,
`moe_route` and `moe_gated_sum` are the small per-row ops of a decode step (csrc/cpu/row_ops.*, on the calling
thread) against norm.py's rms_norm and moe.py's route and gated sum.

Activations are float32 (other dtypes are converted here); the conv window and the KV cache may be float32 or bf16
(the engine's pools take the model dtype), the recurrent state is float32. Both run on `pool` (a ktrans._cpu
ThreadPool) when it has more than one thread, else on the calling thread, with the GIL released either way.
"""
from __future__ import annotations

import torch

from ktrans import _cpu

if not hasattr(_cpu, "gdn_decode"):  # an extension built before these kernels: the ops then report "not built"
    raise ImportError("ktrans._cpu predates the decode-step layer kernels (csrc/cpu/layers.cpp): rebuild it "
                      "(`pip install -e .` or `python setup.py build_ext --inplace`)")
_POOL_DTYPES = (torch.float32, torch.bfloat16)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t as float32 with unit stride in its last dim (the kernels take row strides, not arbitrary views)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _pool_tensor(t: torch.Tensor, what: str, dtypes=_POOL_DTYPES) -> torch.Tensor:
    if not t.is_cpu or not t.is_contiguous() or t.dtype not in dtypes:
        raise ValueError(f"{what}: needs a contiguous CPU tensor of {[str(d) for d in dtypes]}, got {t.dtype} "
                         f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")
    return t


def gdn_decode(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, conv_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               conv_pool: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor, num_k_heads: int,
               head_k_dim: int, rows: torch.Tensor | None = None, pool: _cpu.ThreadPool | None = None,
               isa: str = "auto") -> torch.Tensor:
    """One decode step of B = len(slots) sequences; sequence i is token row rows[i] (or i) of the inputs.

    mixed [T, 2*Hk*Dk + Hv*Dv] q|k|v before the conv; z [T, Hv, Dv] (or [T, Hv*Dv]); b, a [T, Hv]; conv_weight
    [conv_dim, K]; conv_pool [S, conv_dim, K-1] and ssm_pool [S, Hv, Dk, Dv] float32, both updated in place at
    `slots`. Returns the normed, gated core output [B, Hv*Dv] float32.
    """
    conv_pool = _pool_tensor(conv_pool, "conv_pool")
    ssm_pool = _pool_tensor(ssm_pool, "ssm_pool", (torch.float32,))
    n_slots, hv, dk, dv = ssm_pool.shape
    if dk != head_k_dim or hv % num_k_heads:
        raise ValueError(f"ssm_pool {tuple(ssm_pool.shape)} does not fit {num_k_heads} key heads of {head_k_dim}")
    mixed = _f32(mixed)
    t, conv_dim = mixed.shape
    if conv_dim != 2 * num_k_heads * dk + hv * dv or conv_pool.shape[:2] != (n_slots, conv_dim):
        raise ValueError(f"mixed {tuple(mixed.shape)} and conv_pool {tuple(conv_pool.shape)} do not fit the heads")
    kernel = conv_pool.shape[2] + 1
    conv_weight = _f32(conv_weight.reshape(conv_dim, -1))
    if conv_weight.shape[1] != kernel:
        raise ValueError(f"conv_weight {tuple(conv_weight.shape)} does not fit conv_pool {tuple(conv_pool.shape)}")
    z, b, a = _f32(z.reshape(t, hv * dv)), _f32(b.reshape(t, hv)), _f32(a.reshape(t, hv))
    A_log, dt_bias, norm_weight = _f32(A_log), _f32(dt_bias), _f32(norm_weight)
    if A_log.numel() != hv or dt_bias.numel() != hv or norm_weight.numel() != dv:
        raise ValueError(f"A_log, dt_bias need {hv} values and norm_weight {dv}")
    slots = _i64(slots)
    rows = None if rows is None else _i64(rows)
    n = slots.numel()
    if rows is None and n > t or rows is not None and rows.numel() != n:
        raise ValueError(f"{n} slots for {t} token rows" + ("" if rows is None else f" and {rows.numel()} rows"))
    return gdn_decode_checked(mixed, z, b, a, A_log, dt_bias, conv_weight, norm_weight, eps, conv_pool, ssm_pool,
                              slots, num_k_heads, rows, pool, isa)


def gdn_decode_checked(mixed, z, b, a, A_log, dt_bias, conv_weight, norm_weight, eps: float, conv_pool, ssm_pool,
                       slots, num_k_heads: int, rows=None, pool: _cpu.ThreadPool | None = None,
                       isa: str = "auto") -> torch.Tensor:
    """gdn_decode's kernel call on inputs already as it checks them (float32 rows with unit column stride, the
    pools contiguous and of fitting shapes, slots and rows int64): the caller vouches for them (the flat CPU decode
    step, which checks its pools when they change)."""
    t, conv_dim = mixed.shape
    n_slots, hv, dk, dv = ssm_pool.shape
    n = slots.numel()
    out = torch.empty(n, hv * dv, dtype=torch.float32)
    _cpu.gdn_decode(pool, n, num_k_heads, hv, dk, dv, conv_pool.shape[2] + 1, mixed.data_ptr(), conv_dim,
                    z.data_ptr(), hv * dv, a.data_ptr(), b.data_ptr(), hv, 0 if rows is None else rows.data_ptr(), t,
                    slots.data_ptr(), n_slots, A_log.data_ptr(), dt_bias.data_ptr(), conv_weight.data_ptr(),
                    norm_weight.data_ptr(), float(eps), conv_pool.data_ptr(), conv_pool.dtype == torch.bfloat16,
                    ssm_pool.data_ptr(), out.data_ptr(), hv * dv, isa)
    return out


def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor, page_size: int,
                scale: float, pool: _cpu.ThreadPool | None = None, isa: str = "auto") -> torch.Tensor:
    """Write k, v [B, Hkv, D] at rows slot_mapping [B] of the caches [R, Hkv, D], then attend q [B, Hq, D] over
    kv_lens[i] tokens of sequence i through block_tables [B, P]. Returns o [B, Hq, D] float32."""
    k_cache, v_cache = _pool_tensor(k_cache, "k_cache"), _pool_tensor(v_cache, "v_cache")
    if k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache differ in dtype or shape")
    n_rows, hkv, d = k_cache.shape
    q, k, v = _f32(q), _f32(k), _f32(v)
    bsz, hq, dq = q.shape
    if dq != d or k.shape != (bsz, hkv, d) or v.shape != (bsz, hkv, d) or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the cache "
                         f"{tuple(k_cache.shape)}")
    slot_mapping, kv_lens, block_tables = _i64(slot_mapping), _i64(kv_lens), _i64(block_tables)
    if slot_mapping.numel() != bsz or kv_lens.numel() != bsz or block_tables.dim() != 2 or block_tables.shape[0] != bsz:
        raise ValueError(f"slot_mapping, kv_lens and block_tables need {bsz} rows")
    out = torch.empty(bsz, hq, d, dtype=torch.float32)
    _cpu.attn_decode(pool, bsz, hq, hkv, d, page_size, float(scale), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype == torch.bfloat16,
                     n_rows, kv_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], out.data_ptr(), isa)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             w_offset: float = 1.0):
    """ktrans/operators/norm.py's rms_norm (zero-centred: weight + 1) of float32 rows [T, n] on the calling thread;
    with `residual`, also the add before it: returns (norm(residual + x), residual + x)."""
    n = x.shape[-1]
    x2 = _f32(x.reshape(-1, n))
    t = x2.shape[0]
    weight = _f32(weight)
    if weight.numel() != n:
        raise ValueError(f"rms_norm: weight has {weight.numel()} values for rows of {n}")
    out = torch.empty(t, n, dtype=torch.float32)
    if residual is None:
        _cpu.rms_norm_rows(t, n, x2.data_ptr(), n, 0, 0, 0, 0, weight.data_ptr(), w_offset, float(eps),
                           out.data_ptr(), n)
        return out.reshape(x.shape)
    r2 = _f32(residual.reshape(-1, n))
    if r2.shape[0] != t:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} does not fit x {tuple(x.shape)}")
    total = torch.empty(t, n, dtype=torch.float32)
    _cpu.rms_norm_rows(t, n, x2.data_ptr(), n, r2.data_ptr(), n, total.data_ptr(), n, weight.data_ptr(), w_offset,
                       float(eps), out.data_ptr(), n)
    return out.reshape(x.shape), total.reshape(x.shape)


def moe_route(logits: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ktrans/operators/moe.py's route on float32 logits [T, E]: (ids [T, k] int64, weights [T, k] float32)."""
    logits = _f32(logits)
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"moe_route: top_k {top_k} outside [1, {e}]")
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.float32)
    _cpu.moe_route(t, e, logits.data_ptr(), e, top_k, bool(renorm), ids.data_ptr(), weights.data_ptr())
    return ids, weights


def moe_gated_sum(routed: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """routed + sigmoid(gate) * shared for rows [T, n] and gate [T, 1] (float32)."""
    routed, shared, gate = _f32(routed), _f32(shared), _f32(gate)
    n = routed.shape[-1]
    t = routed.numel() // n
    if shared.shape != routed.shape or gate.numel() != t:
        raise ValueError(f"moe_gated_sum: routed {tuple(routed.shape)}, shared {tuple(shared.shape)} and gate "
                         f"{tuple(gate.shape)} do not fit")
    out = torch.empty_like(routed)
    _cpu.moe_gated_sum(t, n, routed.data_ptr(), shared.data_ptr(), gate.data_ptr(), out.data_ptr())
    return out
