"""Paged causal attention in Triton: the KV write, varlen prefill over a cached prefix, and split-K decode.

The cache layout is the KV pool's (`ktrans/runtime/pools.py`): rows [R, Hkv, D], page p holding rows
p * page .. p * page + page - 1, a sequence's pages listed in its block-table row. The oracle is
`ktrans/kernels/torch/attention.py` (write_kv, paged_attention, paged_attention_decode); scores and the softmax are
float32 here as there.

- **Prefill** (`paged_prefill`): one program per (block of a sequence's new tokens, query head). New token j of a
  sequence with n new tokens and L = kv_len sits at absolute position L - n + j and sees keys 0..that position, so
  the prefix is read unmasked and only the last blocks near the diagonal are masked (the FlashAttention-2 loop
  split). Programs past a sequence's tokens exit at once, so the grid is (max new tokens / BLOCK_M, B, Hq) from
  host-known sizes.
- **Decode** (`paged_decode`): flash-decoding. One program per (sequence, KV head, split of the KV length) takes
  that KV head's whole query group (GQA: 8 query heads share one KV head at Qwen3-Next's 16/2), so each KV row is
  read from HBM once; a second kernel merges the splits by their log-sum-exp (`attention_merge.py`). Lengths are
  read on the device and the grid follows from the planned maximum length (a CUDA graph's KV bucket), so a graph
  captures it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton import interpreting, unaligned
from ktrans.kernels.triton.attention_merge import merge, sigmoid_gate, split_counts_by_shape
from ktrans.kernels.triton.pdl import enter, launch

LOG2E = 1.4426950408889634


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


# ---- write_kv ------------------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(K, V, KC, VC, SLOTS, stride_kt, stride_vt, stride_cr, W: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0)
    row = tl.load(SLOTS + t)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < W
    k = tl.load(K + t * stride_kt + offs, mask=mask)
    v = tl.load(V + t * stride_vt + offs, mask=mask)
    tl.store(KC + row * stride_cr + offs, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + row * stride_cr + offs, v.to(VC.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store keys and values [T, Hkv, D] at cache rows slot_mapping [T] (one launch for both)."""
    t = k.shape[0]
    if t == 0:
        return
    w = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(t, w), v.reshape(t, w)
    if k2.stride(1) != 1:
        k2 = k2.contiguous()
    if v2.stride(1) != 1:
        v2 = v2.contiguous()
    block = min(1024, triton.next_power_of_2(w))
    _write_kv_kernel[(t, triton.cdiv(w, block))](k2, v2, k_cache, v_cache, slot_mapping, k2.stride(0), v2.stride(0),
                                                  k_cache.stride(0), W=w, BLOCK=block, **launch())


# ---- prefill -------------------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptrs, mask_n, mask_d, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask_d[None, :], other=0.0)


@triton.jit
def _pages(BT, start, L, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The pages of keys start.. start + BLOCK_N - 1 from the block-table row BT; MASKED: keys at or past L read row
    0's page (valid memory)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        return tl.load(BT + offs_n // PAGE, mask=offs_n < L, other=0)
    return tl.load(BT + offs_n // PAGE)


@triton.jit
def _attend_block(acc, m_i, l_i, q, K, V, page, start, L, pos_q, qk_scale, offs_d, mask_d, stride_kr, kvh_off,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
                  PREC: tl.constexpr, OFF32: tl.constexpr = False):
    """One BLOCK_N-key step of the online softmax (scores in log2 units: qk_scale is scale * log2 e) over the keys
    of `page` (_pages). MASKED: keys at or past L, or after a query's position, are left out. Unmasked steps (the
    prefix below the diagonal) load without predicates. OFF32: the cache's offsets fit int32 (fewer registers than int64 ones: 30-50 fewer for the decode's [keys, dims] offsets on sm_90)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < L
    if OFF32:
        kv_off = ((page * PAGE + offs_n % PAGE).to(tl.int32) * stride_kr + kvh_off)[:, None] + offs_d[None, :]
    else:
        kv_off = (page * PAGE + offs_n % PAGE)[:, None] * stride_kr + kvh_off + offs_d[None, :]
    k = _load_rows(K + kv_off, mask_n, mask_d, MASKED, EVEN_D)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    if MASKED:
        s = tl.where((pos_q[:, None] >= offs_n[None, :]) & mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(V + kv_off, mask_n, mask_d, MASKED, EVEN_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(Q, K, V, O, BT, CU, LENS, qk_scale, stride_qt, stride_qh, stride_kr, stride_kh, stride_ot,
                    stride_oh, stride_bt, N_BUCKET, PAGE: tl.constexpr, GROUP: tl.constexpr,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the blocks with the most keys start first
    b = tl.program_id(1)
    h = tl.program_id(2)
    # Token counts and lengths as int32: one type for the loop bounds (the cache rows go int64 via the pages).
    q0 = tl.load(CU + b).to(tl.int32)
    n = tl.load(CU + b + 1).to(tl.int32) - q0
    if mb * BLOCK_M < n:
        L = tl.load(LENS + b).to(tl.int32)
        prefix = L - n
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < n
        mask_d = offs_d < D
        q = tl.load(Q + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        pos_q = prefix + offs_m
        bt = BT + b * stride_bt
        kvh_off = kvh * stride_kh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys below the block's first position are visible to every row: no mask.
        full_end = (prefix + mb * BLOCK_M) // BLOCK_N * BLOCK_N
        for start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, _pages(bt, start, L, PAGE, BLOCK_N, False), start,
                                          L, pos_q, qk_scale, offs_d, mask_d, stride_kr, kvh_off, PAGE, BLOCK_N,
                                          False, D == BLOCK_D, PREC)
        hi = tl.minimum(prefix + (mb + 1) * BLOCK_M, L)
        for start in range(full_end, hi, BLOCK_N):
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, _pages(bt, start, L, PAGE, BLOCK_N, True), start,
                                          L, pos_q, qk_scale, offs_d, mask_d, stride_kr, kvh_off, PAGE, BLOCK_N,
                                          True, D == BLOCK_D, PREC)
        out = acc / l_i[:, None]
        tl.store(O + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _prefill_configs() -> list[triton.Config]:
    # head_dim 256 leaves room for one 64..128-row query block and a 32..64-key step per program.
    # Configs that do not fit (shared memory, registers) are skipped by the autotuner.
    shapes = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3),
              (64, 32, 4, 4), (64, 128, 8, 2))
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


_prefill_tuned = triton.autotune(configs=_prefill_configs(), key=["N_BUCKET", "D", "GROUP", "PAGE"])(_prefill_kernel)

# The autotuners time every config the first time they see a key: ~0.1 s a config with Triton's default timing, about
# a second in all. A key per power of two of the new tokens (prefill) or per split length (decode) makes serving pay
# that whenever a step first has a new size: at full size the 20-token last step of a 16k prompt took 940 ms, most
# likely so (its 16 new tokens were a power of two no earlier step had; doc/benchmarks.md, session 12). The keys are
# classes instead, few enough for Engine.warm_up to meet each (`tune_class`); an unused kernel argument carries the
# class, so the kernel itself is unchanged.
PREFILL_TUNE_CLASSES = (64, 512)         # new tokens of the longest sequence: <= 64, <= 512, more
DECODE_TUNE_CLASSES = (128, 256, 1024)   # keys per split: <= 128, <= 256, <= 1024, more


def tune_class(n: int, bounds: tuple[int, ...]) -> int:
    """The first bound >= n, else twice the last: the autotune key for a size n."""
    return next((b for b in bounds if n <= b), 2 * bounds[-1])


def _prec(dtype: torch.dtype) -> str:
    # fp32 caches (the CPU-sized tests, a fp32 model) keep full precision; bf16/fp16 ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                  kv_lens: torch.Tensor, block_tables: torch.Tensor, page_size: int, scale: float, max_new: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cache (this step's tokens already written).

    q [T, Hq, D]; cu_seqlens [B+1] and kv_lens [B] int tensors on q's device; block_tables [B, W]; max_new: the
    most new tokens of one sequence (host-known). Same result as the torch paged_attention.
    """
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    o = torch.empty_like(q) if out is None else out
    b = kv_lens.shape[0]
    if t == 0 or b == 0:
        return o
    args = (q, k_cache, v_cache, o, block_tables, cu_seqlens, kv_lens, scale * LOG2E, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), o.stride(0), o.stride(1), block_tables.stride(0))
    meta = dict(PAGE=page_size, GROUP=hq // hkv, D=d, BLOCK_D=_block_d(d), PREC=_prec(q.dtype))
    bucket = tune_class(max_new, PREFILL_TUNE_CLASSES)
    if interpreting():
        bm = 16 if max_new <= 16 else 32
        _prefill_kernel[(triton.cdiv(max_new, bm), b, hq)](*args, bucket, **meta, BLOCK_M=bm, BLOCK_N=16)
    else:
        # Autotuned per (new-token class, shape): prefill runs eagerly, never inside a CUDA graph.
        grid = lambda m: (triton.cdiv(max_new, m["BLOCK_M"]), b, hq)  # noqa: E731
        _prefill_tuned[grid](*args, bucket, **meta)
    return o


# ---- decode --------------------------------------------------------------------------------------------------------

DECODE_BLOCK_N = 64      # keys per step of a decode program
# A split's fixed costs (its q load, its partials written and merged, the pipeline's fill) want long splits; the GPU
# wants about two programs per SM. On the H200 at 32k keys, B=1 (`ktrans bench kernels --family attention`,
# 2026-12-02): splits of 512 keys 38.6 us, of 256 36.4 us, of 128 41.9 us.
MIN_SPLIT_TOKENS = 256
PROGRAMS_PER_SM = 2
# KTRANS_ATTN_SHORT_SPLITS=1 (off until timed on a GPU): where MIN_SPLIT_TOKENS leaves fewer programs than half the
# SMs (a short context at few rows: batch 1 at a 1k bucket is 4 splits of 256 keys, 8 programs for the 2 KV heads),
# splits down to one key block (DECODE_BLOCK_N) instead. Each program streams its keys at one SM's share of the
# bandwidth, so few long splits wait on a handful of SMs: session 35's batch-1 profile on the H100 had the split
# launch at 10.9 us a layer at ~576 keys, where 32k keys read at 0.73 of HBM take 30.7.
SHORT_SPLITS = os.environ.get("KTRANS_ATTN_SHORT_SPLITS", "0") == "1"
# int32 cache offsets in the decode where the cache holds < 2^31 elements: the same addresses, 30-50 registers fewer a
# thread at most launch shapes (sm_90, scripts/attention_decode_resources.py), no time gained or lost at B=1 (H200,
# 32k: 33.2 against 33.8 us, session 23); KTRANS_ATTN_OFF32=0 keeps int64. (Reading a step's pages a step ahead and
# its values with its keys was tried in session 23 and removed: 37.5 against 33.2 us at 32k, even at 128k.)
DECODE_OFF32 = os.environ.get("KTRANS_ATTN_OFF32", "1") == "1"
# The output gate (sigmoid of q_proj's gate half) in the decode merge's store, bitwise output_gate's result, one launch
# a layer fewer (KAttentionTriton.attend_gated); on since session 25 (timed with attention_prep.FUSED, whose comment
# gives the figures); KTRANS_ATTN_GATE_MERGE=0 opts out.
DECODE_GATE = os.environ.get("KTRANS_ATTN_GATE_MERGE", "1") == "1"


@dataclass(frozen=True)
class DecodePlan:
    """The grid of one decode shape, fixed at plan time from host-known sizes only (rows, planned max length)."""

    num_splits: int
    split_tokens: int


def plan_decode(rows: int, kv_heads: int, max_len: int, device: torch.device) -> DecodePlan:
    """Split the planned maximum length so that rows * kv_heads * splits gives each SM about PROGRAMS_PER_SM
    programs, each split at least MIN_SPLIT_TOKENS long (with SHORT_SPLITS, one key block long where that would
    leave fewer programs than half the SMs). (The CPU figure only makes the interpreted tests split.)"""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    want = triton.cdiv(PROGRAMS_PER_SM * sms, max(1, rows * kv_heads))
    splits = max(1, min(want, triton.cdiv(max_len, MIN_SPLIT_TOKENS)))
    if SHORT_SPLITS and 2 * rows * kv_heads * splits < sms:
        splits = max(1, min(want, triton.cdiv(max_len, DECODE_BLOCK_N)))
    split_tokens = triton.cdiv(triton.cdiv(max(max_len, 1), splits), DECODE_BLOCK_N) * DECODE_BLOCK_N
    return DecodePlan(triton.cdiv(max(max_len, 1), split_tokens), split_tokens)


@triton.jit(**unaligned("LENS"))  # the runner's lengths, a view at an offset its buffer sizes set
def _decode_split_kernel(Q, K, V, BT, LENS, OP, LSE, qk_scale, stride_qb, stride_qh, stride_kr, stride_kh,
                         stride_bt, split_tokens, TUNE, PAGE: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                         BLOCK_N: tl.constexpr, OFF32: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n_splits = tl.num_programs(2)
    L = tl.load(LENS + b).to(tl.int32)
    start = sp * split_tokens
    end = tl.minimum(start + split_tokens, L)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < D
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt = BT + b * stride_bt
    kvh_off = kvh * stride_kh
    pos_q = tl.zeros([GROUP_PAD], tl.int32) + (L - 1)
    # The one decode token is the last position, so it sees every key below L: only the split's end masks.
    full = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for s0 in range(start, full, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, _pages(bt, s0, end, PAGE, BLOCK_N, False), s0, end,
                                      pos_q, qk_scale, offs_d, mask_d, stride_kr, kvh_off, PAGE, BLOCK_N, False,
                                      D == BLOCK_D, PREC, OFF32)
    for s0 in range(full, end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, K, V, _pages(bt, s0, end, PAGE, BLOCK_N, True), s0, end,
                                      pos_q, qk_scale, offs_d, mask_d, stride_kr, kvh_off, PAGE, BLOCK_N, True,
                                      D == BLOCK_D, PREC, OFF32)
    # A split past this sequence's length holds no keys (l = 0): it stores nothing, and the merge skips it.
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * tl.num_programs(1) * GROUP + heads) * n_splits + sp  # [B, Hq, S] layout
    # a split past this sequence's length stores nothing (split 0 always stores): the merge reads the live ones only
    live = mask_g & ((offs_g * 0 + start) < tl.maximum(L, 1))
    tl.store(LSE + part, lse, mask=live)
    tl.store(OP + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=live[:, None])


def _decode_configs() -> list[triton.Config]:
    # Memory-bound: enough key blocks in flight per SM matters more than the MMA shape (the group is 8..16 rows).
    shapes = ((32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 8, 3), (16, 4, 4))
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes]


# Tuned per class of split length (TUNE) and shape on the first call of each, which runs eagerly: the runner's first
# step of a graph bucket, or the warm-up, precedes any capture.
_decode_tuned = triton.autotune(configs=_decode_configs(), key=["TUNE", "D", "GROUP", "PAGE", "OFF32"])(
    _decode_split_kernel)


def pretune_decode(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, num_q_heads: int,
                   scale: float) -> list[int]:
    """Time the decode autotuner's configs for every class of split length now (the engine's warm-up calls it),
    each on one sequence whose splits have the class's length, over the cache's own pages (their contents do not
    matter to the timing; nothing is written). Short steps meet the classes of <= 128 and <= 256 keys, but <= 1024
    and more only come with long contexts (128k at batch 1, 32k at batch 16), whose first decode step would otherwise
    pay ~1 s of autotuning inside a user's request. Classes longer than the cache can hold are left out (no context
    reaches them). The merge's shapes, which follow the split count, are compiled too (merge_split_counts).
    Returns the TUNE keys run; nothing where the kernels are interpreted (no autotuner there)."""
    if interpreting() or k_cache.device.type != "cuda":
        return []
    capacity = (k_cache.shape[0] // page_size - 1) * page_size  # the pad page left out
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    sms = torch.cuda.get_device_properties(k_cache.device).multi_processor_count
    q = torch.randn(1, num_q_heads, d, dtype=k_cache.dtype, device=k_cache.device)
    plans = pretune_plans(capacity, hkv, sms)
    for plan in plans:
        n = plan.num_splits * plan.split_tokens
        table = torch.arange(-(-n // page_size), dtype=torch.int64, device=q.device)[None, :]
        lens = torch.tensor([n], dtype=torch.int64, device=q.device)
        paged_decode(q, k_cache, v_cache, lens, table, page_size, scale, plan)
    block_d, one = _block_d(d), torch.ones(1, dtype=torch.int64, device=q.device)
    gate = torch.zeros(1, 2 * num_q_heads * d, dtype=q.dtype, device=q.device) if DECODE_GATE else None
    for n in merge_split_counts(hkv, sms, block_d):  # every merge shape, over one key (what the splits hold is moot)
        part, lse = _scratch(1, num_q_heads, n, block_d, q.device)
        _merge(part, lse, torch.empty_like(q), one, DecodePlan(n, DECODE_BLOCK_N), block_d, gate)
    return [tune_class(p.split_tokens, DECODE_TUNE_CLASSES) for p in plans]


def pretune_plans(capacity: int, kv_heads: int, sms: int) -> list[DecodePlan]:
    """One decode plan a split-length class (its upper bound as the split length; twice the last bound for "more"),
    with as many splits as a real plan would run at batch 1 and the cache holds; none for a class the cache cannot
    reach."""
    out = []
    for tune in (*DECODE_TUNE_CLASSES, 2 * DECODE_TUNE_CLASSES[-1]):
        splits = min(capacity // tune, triton.cdiv(PROGRAMS_PER_SM * sms, kv_heads))
        if splits >= 1:
            out.append(DecodePlan(splits, tune))
    return out


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(rows: int, heads: int, splits: int, block_d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial outputs and log-sum-exps, one buffer per shape shared by every layer (they run one after
    another on one stream) and kept for good: a CUDA graph that captured it replays into the same addresses."""
    key = (rows, heads, splits, block_d, device)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(rows * heads * splits * block_d, dtype=torch.float32, device=device),
                         torch.empty(rows * heads * splits, dtype=torch.float32, device=device))
    return _SCRATCH[key]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor,
                 block_tables: torch.Tensor, page_size: int, scale: float, plan: DecodePlan,
                 out: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, D]; kv_lens [B] int tensor on q's device (each at most the length
    `plan` was made for). No host read, no allocation after the first call of a shape: CUDA graphs capture it.
    gate: q_proj's output [B, Hq * 2D]; the result is then multiplied by its gate halves' sigmoids (output_gate's
    arithmetic) in the merge's store."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    block_d = _block_d(d)
    o = torch.empty_like(q) if out is None else out
    if bsz == 0:
        return o
    part, lse = _scratch(bsz, hq, plan.num_splits, block_d, q.device)
    args = (q, k_cache, v_cache, block_tables, kv_lens, part, lse, scale * LOG2E, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), plan.split_tokens,
            tune_class(plan.split_tokens, DECODE_TUNE_CLASSES))
    meta = dict(PAGE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_D=block_d,
                PREC=_prec(q.dtype), OFF32=DECODE_OFF32 and k_cache.numel() < 2**31)
    grid = (bsz, hkv, plan.num_splits)
    if interpreting():
        _decode_split_kernel[grid](*args, **meta, BLOCK_N=16, **launch())
    else:
        _decode_tuned[grid](*args, **meta, **launch())
    _merge(part, lse, o, kv_lens, plan, block_d, gate)
    return o


def _merge(part: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, kv_lens: torch.Tensor, plan: DecodePlan,
           block_d: int, gate: torch.Tensor | None = None) -> None:
    merge(part, lse, o, kv_lens, plan.num_splits, plan.split_tokens, block_d, gate)


def merge_split_counts(kv_heads: int, sms: int, block_d: int) -> list[int]:
    """One split count for each merge shape a plan on a device of `sms` SMs can give (up to plan_decode's count
    at one row), for the warm-up to compile (pretune_decode) rather than a long context's first step."""
    return split_counts_by_shape(triton.cdiv(PROGRAMS_PER_SM * sms, max(1, kv_heads)), block_d)


# ---- the output gate --------------------------------------------------------------------------------------------


@triton.jit
def _output_gate_kernel(O, QG, Y, n_cols, stride_o, stride_qg, stride_y, D: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(QG + row * stride_qg + (cols // D) * (2 * D) + D + cols % D, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + row * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, sigmoid_gate(o, g, Y.dtype.element_ty), mask=mask)


def output_gate(out: torch.Tensor, qg: torch.Tensor, head_dim: int) -> torch.Tensor:
    """out [T, H, D] (or [T, H * D]) times sigmoid of each head's gate half of qg [T, H * 2D] (q_proj's output,
    per head [q | gate]) -> [T, H * D] in out's dtype, in one launch where torch took three (the gate's strided
    copy, the sigmoid, the product). The sigmoid is rounded to the dtype before the product, as torch rounds it."""
    t = out.shape[0]
    out2 = out.reshape(t, -1)
    out2 = out2 if out2.stride(-1) == 1 else out2.contiguous()
    n = out2.shape[1]
    if qg.shape != (t, 2 * n) or qg.stride(-1) != 1 or n % head_dim:
        raise ValueError(f"output_gate: out {tuple(out.shape)}, qg {tuple(qg.shape)} (unit stride needed) and head "
                         f"dim {head_dim} do not fit")
    y = torch.empty(t, n, dtype=out.dtype, device=out.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _output_gate_kernel[(t, triton.cdiv(n, block))](out2, qg, y, n, out2.stride(0), qg.stride(0), y.stride(0),
                                                        D=head_dim, BLOCK=block, **launch())
    return y
