"""`ktrans bench kernels` cases of the flashinfer family: the optional attention backend KAttentionFlashInfer's
kernels (FlashInfer's paged batch decode and prefill) at the attention family's shapes and on the same pages
(`kernels_attention._paged_cache`), so the two backends compare row by row:

- decode at 32k context, B=1 and B=16 (tensor cores, the wrapper built for CUDA graphs, as the op runs it): bytes are
  the KV rows read;
- prefill T=4096 from an empty cache, causal, with torch SDPA as the peer (issue 15's 1.5x target), and a 2048-token
  chunk over a 30k cached prefix.

Each case plans once in its setup, as the op plans once a step; the timed call is the run alone. The module imports
flashinfer at the top: where it is not installed the family is reported as skipped.
"""
from __future__ import annotations

import flashinfer
import torch

from ktrans.bench.kernels import Timed, case
from ktrans.bench.kernels_attention import PAGE, _paged_cache, prefill_timed, real_config
from ktrans.operators.attention import page_lists
from ktrans.operators.attention_flashinfer import MIN_WORKSPACE_BYTES, workspace_bytes


def _lists(tables: torch.Tensor, lens: list[int]):
    return (torch.from_numpy(a) for a in page_lists(tables.cpu().numpy(), lens, PAGE))


def _decode(batch: int, kv_len: int, dev: torch.device) -> Timed:
    c = real_config()
    k, v, tables, _ = _paged_cache(batch, kv_len, dev)
    q = torch.randn(batch, c.num_attention_heads, c.head_dim, dtype=k.dtype, device=dev)
    out = torch.empty_like(q)
    i32 = dict(dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ws = workspace_bytes(batch, c.num_attention_heads, c.num_key_value_heads, c.head_dim, sms)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(ws, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.zeros(batch + 1, **i32),
        paged_kv_indices_buffer=torch.zeros(tables.numel(), **i32),
        paged_kv_last_page_len_buffer=torch.zeros(batch, **i32))
    indptr, ids, last = _lists(tables, [kv_len] * batch)
    wrapper.plan(indptr, ids, last, c.num_attention_heads, c.num_key_value_heads, c.head_dim, PAGE,
                 q_data_type=k.dtype, kv_data_type=k.dtype, sm_scale=c.head_dim ** -0.5)
    paged = (k.view(-1, PAGE, *k.shape[1:]), v.view(-1, PAGE, *v.shape[1:]))
    kv_bytes = 2 * batch * kv_len * c.num_key_value_heads * c.head_dim * k.element_size()
    flops = 4 * batch * kv_len * c.num_attention_heads * c.head_dim
    return Timed(lambda: wrapper.run(q, paged, out=out), kv_bytes, flops)


@case("flashinfer", "decode 32k B=1", ("decode",))
def decode_32k_b1(dev: torch.device) -> Timed:
    return _decode(1, 32768, dev)


@case("flashinfer", "decode 32k B=16", ("decode",))
def decode_32k_b16(dev: torch.device) -> Timed:
    return _decode(16, 32768, dev)


def _prefill(new: int, prefix: int, dev: torch.device, peer: bool) -> Timed:
    c = real_config()
    kv_len = prefix + new
    k, v, tables, _ = _paged_cache(1, kv_len, dev)
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = torch.randn(new, hq, d, dtype=k.dtype, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(MIN_WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD")  # no graph-mode decode sizing
    indptr, ids, last = _lists(tables, [kv_len])
    wrapper.plan(torch.tensor([0, new], dtype=torch.int32), indptr, ids, last, hq, hkv, d, PAGE, causal=True,
                 sm_scale=d ** -0.5, q_data_type=k.dtype, kv_data_type=k.dtype)
    paged = (k.view(-1, PAGE, *k.shape[1:]), v.view(-1, PAGE, *v.shape[1:]))
    out = torch.empty_like(q)
    return prefill_timed(lambda: wrapper.run(q, paged, out=out), q, prefix, k.element_size(), peer)


case("flashinfer", "prefill T=4096", ("prefill",))(lambda dev: _prefill(4096, 0, dev, peer=True))
case("flashinfer", "prefill T=2048 over a 30k prefix", ("prefill",))(lambda dev: _prefill(2048, 30720, dev, peer=False))
