"""Reference gated delta rule (the recurrence of a Gated DeltaNet layer) in plain torch.

Per value head, with a state S of shape [Dk, Dv] and per-token decay a_t = exp(g_t):

    S   <- a_t * S
    u_t  = beta_t * (v_t - S^T k_t)          # the delta: what S does not yet predict for k_t
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

q and k are L2-normalised and q is scaled by Dk**-0.5 first; value head h reads key head h // (Hv // Hk).
Everything runs in float32; the state is always float32. This matches transformers' Qwen3-Next torch fallback
and is the oracle for the Triton kernels. Three entry points: a chunked form for prefill (matmul heavy), a
token loop (the plainest statement of the math), and a batched one-token step for decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps goes inside the rsqrt (not a clamp on the norm) to match FLA and transformers bit for bit in fp32.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """Cast to float32, normalise and scale q/k, and expand key heads to value heads. Token dim stays first."""
    hk, hv = k.shape[-2], v.shape[-2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    q, k, v, g, beta = (t.to(torch.float32) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        # Normalise before expanding heads: same numbers, fewer rows.
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=-2)
        k = k.repeat_interleave(hv // hk, dim=-2)
    return q, k, v, g, beta


def _initial_state(initial_state, hv, dk, dv, device):
    if initial_state is None:
        return torch.zeros(hv, dk, dv, dtype=torch.float32, device=device)
    if initial_state.shape != (hv, dk, dv):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(hv, dk, dv)}")
    # Copy so the caller's tensor is never aliased by the returned state.
    return initial_state.to(torch.float32, copy=True)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size=64, use_qk_l2norm=True):
    """One sequence. q, k [L, Hk, Dk]; v [L, Hv, Dv]; g, beta [L, Hv]; initial_state [Hv, Dk, Dv] or None.

    Returns (o [L, Hv, Dv] in v.dtype, final_state [Hv, Dk, Dv] float32).
    """
    length, hv, dv = v.shape
    out_dtype = v.dtype
    state = _initial_state(initial_state, hv, k.shape[-1], dv, v.device)
    if length == 0:
        return v.new_empty(0, hv, dv), state
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)

    # Padded tokens have k = 0, beta = 0 and g = 0: they write nothing and decay nothing, so the state is exact.
    pad = (-length) % chunk_size
    n = (length + pad) // chunk_size
    c = chunk_size

    def chunks(t):  # [L, Hv, ...] -> [Hv, N, C, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(n, c, *t.shape[1:]).movedim(2, 0)

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))

    # Log-decay from the start of the chunk up to and including token t; all entries <= 0, so every exp
    # below is of a non-positive number and cannot overflow however long the chunk.
    cum = g.cumsum(dim=-1)  # [Hv, N, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    # decay[i, j] = prod of a over (j, i] for j <= i; the mask is applied before exp so the upper half
    # (positive exponents) never exists as a number.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    # Within a chunk the deltas u solve a unit lower triangular system. Unrolling S_{t-1} in u_t gives
    #   u_t + beta_t * sum_{j<t} decay[t, j] (k_t . k_j) u_j = beta_t v_t - beta_t exp(cum_t) S0^T k_t
    # so u = T (beta v) - T (beta exp(cum) k) S0 with T = (I + A)^-1. T does not depend on S0, which is what
    # lets all chunks do their solves at once and leaves only a small matmul per chunk in the scan.
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay                     # the strict lower part is A; the diagonal is ignored
    u_free = torch.linalg.solve_triangular(a, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, kb * cum.exp()[..., None], upper=False, unitriangular=True)

    attn = (q @ k.transpose(-1, -2)) * decay                   # intra-chunk q.k with decay, diagonal included
    q_decayed = q * cum.exp()[..., None]                       # how much of S0 survives to token t
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]      # how much of token j's write survives to chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]          # [Hv, N, 1, 1]

    o = torch.empty_like(v)
    for i in range(n):
        u = u_free[:, i] - w[:, i] @ state
        o[:, i] = q_decayed[:, i] @ state + attn[:, i] @ u
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u

    o = o.movedim(0, 2).reshape(n * c, hv, dv)[:length]
    return o.to(out_dtype), state


def _step(state, q, k, v, g, beta):
    """One token for a stack of heads, in place on state [..., Dk, Dv]; q, k [..., Dk]; v [..., Dv]; g, beta [...]."""
    state.mul_(g.exp()[..., None, None])
    kv_mem = (k[..., None, :] @ state).squeeze(-2)  # k^T S: a batched vector-matrix product, no [Dk, Dv] temporary
    delta = beta[..., None] * (v - kv_mem)
    state.add_(k[..., :, None] * delta[..., None, :])
    return (q[..., None, :] @ state).squeeze(-2)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, use_qk_l2norm=True):
    """Same contract as chunk_gated_delta_rule, computed one token at a time."""
    length, hv, dv = v.shape
    out_dtype = v.dtype
    state = _initial_state(initial_state, hv, k.shape[-1], dv, v.device)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    o = torch.empty(length, hv, dv, dtype=torch.float32, device=v.device)
    for t in range(length):
        o[t] = _step(state, q[t], k[t], v[t], g[t], beta[t])
    return o.to(out_dtype), state


def gated_delta_rule_decode(q, k, v, g, beta, state, use_qk_l2norm=True):
    """One token for each of B sequences. q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv].

    state [B, Hv, Dk, Dv] float32 is updated in place (a view into a pool works); returns o [B, Hv, Dv] in v.dtype.
    """
    if state.dtype != torch.float32:
        raise TypeError(f"the recurrent state must be float32, got {state.dtype}")
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    return _step(state, q, k, v, g, beta).to(out_dtype)
