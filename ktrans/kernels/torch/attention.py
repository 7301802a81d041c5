"""Reference paged causal attention (the full-attention layers of Qwen3-Next) in plain torch.

The KV cache of one layer is two tensors [R, Hkv, D] of rows; a sequence owns whole pages of page_size rows, listed
in its block_tables row, so its token t sits at row block_tables[i, t // page_size] * page_size + t % page_size.
A step's new tokens are written first (write_kv), then attention reads the cache only: the same code serves
prefill, chunked prefill (new tokens attend to an old prefix) and decode. Scores and softmax are float32.
"""
from __future__ import annotations

import torch


def write_kv(k_cache, v_cache, slot_mapping, k, v):
    """Store this step's keys and values. caches [R, Hkv, D]; slot_mapping [T] int64 rows; k, v [T, Hkv, D]."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _rows(block_table, length, page_size):
    """Cache rows of tokens 0..length-1 of one sequence. The table's -1 padding is not checked here (that would read
    the device): ForwardBatch.build refuses a sequence with too few pages."""
    pages = block_table[: -(-length // page_size)]
    if pages.numel() * page_size < length:
        raise ValueError(f"block table has too few pages for {length} tokens of page size {page_size}")
    offsets = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offsets).reshape(-1)[:length]


def _attend(q, k, v, mask, scale):
    """q [n, Hq, D]; k, v [L, Hkv, D]; mask [n, L], True where the query may attend. float32 out."""
    n, hq, d = q.shape
    hkv = k.shape[-2]
    group = hq // hkv
    # Group query heads under their kv head instead of repeating k and v: query head h is (h // group, h % group).
    qg = q.float().reshape(n, hkv, group, d)
    scores = torch.einsum("nhgd,lhd->hgnl", qg, k.float()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hgnl,lhd->nhgd", probs, v.float())
    return out.reshape(n, hq, d)


def paged_attention(q, k_cache, v_cache, cu_seqlens, kv_lens, block_tables, page_size, scale):
    """Causal attention of B sequences' new tokens over their cached KV (this step's tokens already written).

    q [T, Hq, D] flat; cu_seqlens [B+1] offsets into q (a list of ints, or a host tensor); kv_lens[i] = cached +
    new tokens of sequence i (ints); block_tables [B, max_pages] int64 (-1 padding). Returns o [T, Hq, D] in
    q.dtype. One Python iteration per sequence: the prefill path (a decode batch takes paged_attention_decode).
    """
    hq, hkv = q.shape[-2], k_cache.shape[-2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    cu = cu_seqlens if isinstance(cu_seqlens, list) else [int(x) for x in cu_seqlens]
    o = torch.empty_like(q)
    for i, length in enumerate(kv_lens):
        start, end = cu[i], cu[i + 1]
        n = end - start
        if n == 0:
            continue
        if n > length:
            raise ValueError(f"sequence {i} has {n} new tokens but only {length} tokens of KV")
        rows = _rows(block_tables[i], length, page_size)
        # New token j sits at absolute position length - n + j and sees keys 0..that position.
        pos_q = torch.arange(length - n, length, device=q.device)
        mask = pos_q[:, None] >= torch.arange(length, device=q.device)[None, :]
        o[start:end] = _attend(q[start:end], k_cache[rows], v_cache[rows], mask, scale).to(q.dtype)
    return o


def paged_attention_decode(q, k_cache, v_cache, kv_lens, block_tables, page_size, scale, max_len=None):
    """One new token per sequence, all sequences at once. q [B, Hq, D]; kv_lens list[int] or [B] tensor.

    Same result as paged_attention with cu_seqlens = 0..B. Keys are gathered up to the longest sequence and the
    rest masked, so there is no Python loop over B. With kv_lens a tensor on q's device and max_len (an int at
    least the longest length, from the host) given, nothing is read back from the device.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[-2]
    group = hq // hkv
    lens = torch.as_tensor(kv_lens, dtype=torch.int64, device=q.device)
    if max_len is None:
        max_len = int(lens.max())
    pages = block_tables[:, : -(-max_len // page_size)]
    offsets = torch.arange(page_size, device=q.device)
    rows = (pages[:, :, None] * page_size + offsets).reshape(b, -1)[:, :max_len]
    valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
    rows = rows.masked_fill(~valid, 0)  # -1 padding pages would index out of range; masked out below anyway
    flat = rows.reshape(-1)  # index_select: advanced indexing's general path is many times slower on the CPU
    k = k_cache.index_select(0, flat).view(b, -1, *k_cache.shape[1:]).float()  # [B, L, Hkv, D]
    v = v_cache.index_select(0, flat).view(b, -1, *v_cache.shape[1:]).float()
    qg = q.float().reshape(b, hkv, group, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(dim=-1), v)
    return out.reshape(b, hq, d).to(q.dtype)
