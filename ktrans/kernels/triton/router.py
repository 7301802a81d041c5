"""The MoE block's routing and its output sum in Triton: top-k over the softmax of the router logits, and
routed + sigmoid(shared gate) * shared expert, with the shared expert's gate logit (a [1, H] projection) either
given or computed in the same launch (`gated_sum_dot`: a dot product per token, where a separate [T, H] x [H, 1]
GEMM launch costs more than it computes).

Oracles: `route` in `ktrans/operators/moe.py` (softmax in fp32, top k, renormalised when norm_topk_prob) and the
block's final sum. The softmax is monotone, so the top k of the probabilities are the top k of the logits: one
program per token picks them from its row (k passes of max-and-mask over the row in registers, the lowest index
winning a tie as torch.topk does in practice), and the weights are exp(l - max) over the full row's sum, or over
the k picked ones' sum when renormalised (the full softmax's denominator cancels). Ids come out int64 and
descending by weight, as torch.topk gives them to the expert ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.pdl import enter, launch


@triton.jit
def topk_softmax_row(row_ptr, n_experts, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                     RENORM: tl.constexpr, CG: tl.constexpr = False):
    """One token's routing from its logits row: (slots [K_PAD], ids [K_PAD] int32, weights [K_PAD] fp32), slots past
    K padding (weight 0). Also run inside the CPU experts' stage-in launch (ktrans.kernels.triton.stage). CG: the
    row read from L2 (other programs of the same launch wrote it: ktrans.kernels.triton.dense_gemv.dense_route)."""
    offs = tl.arange(0, E_PAD)
    if CG:
        x = tl.load(row_ptr + offs, mask=offs < n_experts, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(row_ptr + offs, mask=offs < n_experts, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, 0)
    total = tl.sum(tl.exp(x - mx), 0)
    ks = tl.arange(0, K_PAD)
    vals = tl.full([K_PAD], float("-inf"), tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(K):
        v = tl.max(x, 0)
        i = tl.min(tl.where(x == v, offs, E_PAD), 0)
        vals = tl.where(ks == j, v, vals)
        ids = tl.where(ks == j, i, ids)
        x = tl.where(offs == i, float("-inf"), x)
    e = tl.exp(vals - mx)
    if RENORM:
        w = e / tl.sum(e, 0)
    else:
        w = e / total
    return ks, ids, w


@triton.jit
def _topk_softmax_kernel(LOGITS, IDS, W, stride_l, n_experts, K: tl.constexpr, E_PAD: tl.constexpr,
                         K_PAD: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    enter(PDL)
    route_row(LOGITS, IDS, W, tl.program_id(0), stride_l, n_experts, K, E_PAD, K_PAD, RENORM, SHARED)


@triton.jit
def route_row(LOGITS, IDS, W, row, stride_l, n_experts, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
              RENORM: tl.constexpr, SHARED: tl.constexpr, CG: tl.constexpr = False):
    """Token `row`'s ids and weights from its logits (topk_softmax_row), stored as route() / route_with_shared()
    return them (SHARED: the shared expert's slot K after the top k)."""
    ks, ids, w = topk_softmax_row(LOGITS + row * stride_l, n_experts, K, E_PAD, K_PAD, RENORM, CG)
    if SHARED:  # column n_experts is the shared expert's gate logit: slot K, expert id n_experts, sigmoid weight
        if CG:
            g = tl.load(LOGITS + row * stride_l + n_experts, cache_modifier=".cg").to(tl.float32)
        else:
            g = tl.load(LOGITS + row * stride_l + n_experts).to(tl.float32)
        ids = tl.where(ks == K, n_experts, ids)
        w = tl.where(ks == K, tl.sigmoid(g), w)
        tl.store(IDS + row * (K + 1) + ks, ids.to(tl.int64), mask=ks < K + 1)
        tl.store(W + row * (K + 1) + ks, w.to(W.dtype.element_ty), mask=ks < K + 1)
    else:
        tl.store(IDS + row * K + ks, ids.to(tl.int64), mask=ks < K)
        tl.store(W + row * K + ks, w.to(W.dtype.element_ty), mask=ks < K)


def route_with_shared(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E + 1]: the router's E logits, then the shared expert's gate logit -> ids [T, k + 1] int64 (the
    top k as route() gives them, then E) and weights [T, k + 1] fp32 (theirs, then sigmoid of the gate logit): the
    shared expert as one more pair of a MoE whose extra expert is id E (one launch)."""
    t, e1 = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, top_k + 1, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k + 1, dtype=torch.float32, device=logits.device)
    if t:
        _topk_softmax_kernel[(t,)](logits, ids, weights, logits.stride(0), e1 - 1, K=top_k,
                                   E_PAD=triton.next_power_of_2(e1 - 1), K_PAD=triton.next_power_of_2(top_k + 1),
                                   RENORM=norm_topk_prob, SHARED=True, num_warps=1 if e1 - 1 <= 1024 else 4, **launch())
    return ids, weights


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> ids [T, k] int64, weights [T, k] in the logits' dtype (one launch). One warp per
    row up to 1024 experts: the k reductions then stay inside the warp."""
    t, e = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    weights = torch.empty(t, top_k, dtype=router_logits.dtype, device=router_logits.device)
    if t:
        _topk_softmax_kernel[(t,)](router_logits, ids, weights, router_logits.stride(0), e, K=top_k,
                                   E_PAD=triton.next_power_of_2(e), K_PAD=triton.next_power_of_2(top_k),
                                   RENORM=norm_topk_prob, num_warps=1 if e <= 1024 else 4, **launch())
    return ids, weights


@triton.jit
def _gated_sum_kernel(R, S, G, O, n, H, stride_g, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + (offs // H) * stride_g, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + offs, (r + tl.sigmoid(g) * s).to(O.dtype.element_ty), mask=mask)


def gated_sum(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """routed [T, H] + sigmoid(gate_logit [T, 1]) * shared [T, H], in their promoted dtype (one launch)."""
    routed, shared = routed.contiguous(), shared.contiguous()
    dtype = torch.promote_types(torch.promote_types(routed.dtype, shared.dtype), gate_logit.dtype)
    out = torch.empty(shared.shape, dtype=dtype, device=shared.device)
    n, h = shared.numel(), shared.shape[-1]
    if n:
        block = 1024
        _gated_sum_kernel[(triton.cdiv(n, block),)](routed, shared, gate_logit, out, n, h, gate_logit.stride(0),
                                                     BLOCK=block, **launch())
    return out


@triton.jit
def _gated_sum_dot_kernel(R, S, X, W, O, H, stride_r, stride_s, stride_x, BLOCK: tl.constexpr,
                          STAGED: tl.constexpr = False, R_BF16: tl.constexpr = False, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        mask = h0 + offs < H
        x = tl.load(X + row * stride_x + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        acc += x * tl.load(W + h0 + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.sigmoid(tl.sum(acc, 0))
    for h0 in range(0, H, BLOCK):
        mask = h0 + offs < H
        # STAGED: R is the CPU experts' fp32 output in pinned host memory, written while the stream polled (read
        # past caches), rounded to bf16 by hand (R_BF16: to nearest even, as the stage-out's cast) where the
        # routed output would have been bf16
        r = tl.load(R + row * stride_r + h0 + offs, mask=mask, other=0.0, volatile=STAGED).to(tl.float32)
        if R_BF16:
            bits = r.to(tl.uint32, bitcast=True)
            bits = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16) << 16
            r = bits.to(tl.float32, bitcast=True)
        s = tl.load(S + row * stride_s + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(O + row * H + h0 + offs, (r + g * s).to(O.dtype.element_ty), mask=mask)


def gated_sum_dot(routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor, gate_weight: torch.Tensor,
                  staged_dtype: torch.dtype | None = None) -> torch.Tensor:
    """routed [T, H] + sigmoid(x [T, H] . gate_weight [1, H]) * shared [T, H] (one launch, one program a token; the
    logit in fp32, not rounded to the activations' dtype first), in the promoted dtype of routed, shared and the
    weight. staged_dtype: routed is the CPU experts' fp32 output in the pinned staging (ktrans.kernels.cpu_stream,
    after its poll), read in place as if it had been copied out in staged_dtype first: the stage-out launch folded
    into this one, bitwise the same sum."""
    t, h = shared.shape
    if routed.shape != (t, h) or x.shape != (t, h) or gate_weight.shape != (1, h):
        raise ValueError(f"gated_sum_dot: routed {tuple(routed.shape)}, shared {tuple(shared.shape)}, x "
                         f"{tuple(x.shape)}, gate weight {tuple(gate_weight.shape)} do not fit")
    routed, shared, x = (v if v.stride(-1) == 1 else v.contiguous() for v in (routed, shared, x))
    gate_weight = gate_weight.contiguous()
    r_dtype = routed.dtype if staged_dtype is None else staged_dtype
    if staged_dtype is not None and (routed.dtype != torch.float32 or staged_dtype not in (torch.float32,
                                                                                          torch.bfloat16)):
        raise ValueError(f"gated_sum_dot: a staged routed output is fp32 read as fp32 or bf16, not {routed.dtype} "
                         f"as {staged_dtype}")
    dtype = torch.promote_types(torch.promote_types(r_dtype, shared.dtype), gate_weight.dtype)
    out = torch.empty(t, h, dtype=dtype, device=shared.device)
    if t:
        block = min(1024, triton.next_power_of_2(h))
        _gated_sum_dot_kernel[(t,)](routed, shared, x, gate_weight, out, h, routed.stride(0), shared.stride(0),
                                    x.stride(0), BLOCK=block, STAGED=staged_dtype is not None,
                                    R_BF16=staged_dtype == torch.bfloat16, num_warps=4, **launch())
    return out
