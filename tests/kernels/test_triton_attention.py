"""The Triton paged attention (write_kv, varlen prefill over a cached prefix, split-K decode) against the torch
reference kernels (ktrans/kernels/torch/attention.py), on random caches with pages out of order.

Sizes are awkward on purpose: odd token counts, T=1, KV lengths that are not multiples of the page or of the split,
a prefix that ends mid-page, a head_dim that is not a power of two, pad rows that point at the pool's pad page.
Tolerances: fp32 within atol 2e-5 / rtol 1e-4 (the scores and softmax are fp32 in both; only the order of the
sums differs); bf16 at the real shapes (gpu) within atol 1.5e-2 / rtol 1e-2 (the probabilities are rounded to
bf16 before the PV product, as FlashAttention does). The interpreted runs use small head dims and few heads.
"""
from __future__ import annotations

import pytest
import torch

from ktrans.kernels.torch import attention as ref

tri = pytest.importorskip("ktrans.kernels.triton.attention")
tri_merge = pytest.importorskip("ktrans.kernels.triton.attention_merge")

pytestmark = pytest.mark.triton
FP32 = dict(atol=2e-5, rtol=1e-4)
BF16 = dict(atol=1.5e-2, rtol=1e-2)


class Cache:
    """A random KV pool of `pages` usable pages plus the pad page, and sequences whose pages are shuffled."""

    def __init__(self, kv_lens, page, hkv, d, dtype, device, spare_pages=3):
        need = [-(-n // page) for n in kv_lens]
        self.num_pages = sum(need) + spare_pages
        self.page, self.pad_page = page, self.num_pages
        rows = (self.num_pages + 1) * page
        self.k = torch.randn(rows, hkv, d, dtype=torch.float32).to(dtype).to(device)
        self.v = torch.randn(rows, hkv, d, dtype=torch.float32).to(dtype).to(device)
        perm = torch.randperm(self.num_pages).tolist()
        width = max(need) + 1  # one -1 column past the longest sequence
        self.tables = torch.full((len(kv_lens), width), -1, dtype=torch.int64)
        at = 0
        for i, n in enumerate(need):
            self.tables[i, :n] = torch.tensor(perm[at: at + n])
            at += n
        self.tables = self.tables.to(device)

    def slots(self, seq, positions):
        return [int(self.tables[seq, p // self.page]) * self.page + p % self.page for p in positions]


def _cu(news):
    out = [0]
    for n in news:
        out.append(out[-1] + n)
    return out


def _prefill_case(news, kv_lens, hq, hkv, d, page, dtype, device):
    c = Cache(kv_lens, page, hkv, d, dtype, device)
    q = torch.randn(sum(news), hq, d).to(dtype).to(device)
    cu = _cu(news)
    want = ref.paged_attention(q.float(), c.k.float(), c.v.float(), cu, kv_lens, c.tables, page, d ** -0.5)
    got = tri.paged_prefill(q, c.k, c.v, torch.tensor(cu, device=device), torch.tensor(kv_lens, device=device),
                            c.tables, page, d ** -0.5, max(news))
    return got.float(), want


@pytest.mark.parametrize("hq,hkv,d,page", [(4, 2, 32, 4), (8, 1, 24, 16)])
def test_prefill_over_cached_prefix(triton_device, hq, hkv, d, page):
    # (new, kv_len): a fresh odd prompt, a chunk after a prefix ending mid-page, a 1-token chunk after a prefix,
    # a 1-token prompt, a chunk longer than a query block.
    news, kv_lens = [5, 3, 1, 1, 37], [5, 12, 7, 1, 41]
    got, want = _prefill_case(news, kv_lens, hq, hkv, d, page, torch.float32, triton_device)
    torch.testing.assert_close(got, want.to(got.device), **FP32)


def test_prefill_single_token(triton_device):
    got, want = _prefill_case([1], [1], 2, 2, 16, 4, torch.float32, triton_device)
    torch.testing.assert_close(got, want.to(got.device), **FP32)


def _decode_case(kv_lens, hq, hkv, d, page, dtype, device, plan_len=None, plan=None, pad_rows=0):
    c = Cache(kv_lens, page, hkv, d, dtype, device)
    b = len(kv_lens)
    tables, lens = c.tables, list(kv_lens)
    if pad_rows:
        # As the runner pads a graph bucket: a 2-token sequence whose only page is the pad page.
        pad = torch.full((pad_rows, tables.shape[1]), -1, dtype=torch.int64, device=device)
        pad[:, 0] = c.pad_page
        tables, lens = torch.cat([tables, pad]), lens + [2] * pad_rows
    q = torch.randn(b + pad_rows, hq, d).to(dtype).to(device)
    want = ref.paged_attention_decode(q.float(), c.k.float(), c.v.float(), lens, tables, page, d ** -0.5)
    plan = plan or tri.plan_decode(b + pad_rows, hkv, plan_len or max(lens), torch.device(device))
    got = tri.paged_decode(q, c.k, c.v, torch.tensor(lens, device=device), tables, page, d ** -0.5, plan)
    return got.float(), want, plan


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (2, 1, 128)])  # 128: the merge runs in two chunks of dims
def test_decode_split_k_uneven_lengths(triton_device, hq, hkv, d):
    # Splits of 24 keys (not a multiple of the page or of the kernel's key block): lengths 1, within one split,
    # across several, and one longer than all but the last split covers.
    got, want, plan = _decode_case([1, 7, 50, 95], hq, hkv, d, 4, torch.float32, triton_device,
                                   plan=tri.DecodePlan(num_splits=4, split_tokens=24))
    torch.testing.assert_close(got, want.to(got.device), **FP32)


def test_decode_in_splits_of_one_key_block(triton_device):
    """KTRANS_ATTN_SHORT_SPLITS's plans: splits of exactly one key block (DECODE_BLOCK_N), so each split's one block
    runs unmasked or ends a length; lengths 1, 64, 65, 200 and 576 (a batch-1 step's ~576 keys in a 1k bucket: 9
    live splits of 16)."""
    got, want, _ = _decode_case([1, 64, 65, 200, 576], 4, 2, 32, 16, torch.float32, triton_device,
                                plan=tri.DecodePlan(num_splits=16, split_tokens=tri.DECODE_BLOCK_N))
    torch.testing.assert_close(got, want.to(got.device), **FP32)


@pytest.mark.parametrize("max_step", [16, 256])
def test_decode_merges_more_splits_than_one_read(triton_device, monkeypatch, max_step):
    """37 splits of 8 keys, merged in one read of all of them, or (MERGE_MAX_STEP at 16) 16 at a time with the
    running maximum rescaling across the reads: the lengths end in the first, the second and the third read. Only
    the live splits are read: those past a length store nothing (their scratch is NaN here)."""
    monkeypatch.setattr(tri_merge, "MERGE_MAX_STEP", max_step)
    plan = tri.DecodePlan(num_splits=37, split_tokens=8)
    step, chunk = tri_merge.merge_shape(plan.num_splits, 32)
    assert (step, chunk) == ((64, 32) if max_step == 256 else (16, 32))
    scratch = tri._scratch(3, 4, plan.num_splits, 32, torch.empty(0, device=triton_device).device)
    for t in scratch:
        t.fill_(float("nan"))
    got, want, _ = _decode_case([5, 140, 290], 4, 2, 32, 4, torch.float32, triton_device, plan=plan)
    torch.testing.assert_close(got, want.to(got.device), **FP32)


def test_merge_shape_bounds_a_programs_partials():
    for splits in (1, 3, 16, 37, 132, 256, 300):
        for block_d in (16, 32, 128, 256):
            step, chunk = tri_merge.merge_shape(splits, block_d)
            assert step == min(1 << (splits - 1).bit_length(), tri_merge.MERGE_MAX_STEP) and block_d % chunk == 0
            assert 16 <= chunk <= block_d and (step * chunk <= tri_merge.MERGE_TILE or chunk == 16)


def test_decode_planned_for_a_longer_bucket_with_pad_rows(triton_device):
    # The plan is made for a graph's KV bucket (longer than any live sequence): splits past a length are empty.
    got, want, plan = _decode_case([3, 29, 18], 8, 2, 24, 8, torch.float32, triton_device, plan_len=2048,
                                   pad_rows=2)
    assert plan.num_splits > 1 and plan.num_splits * plan.split_tokens >= 2048
    torch.testing.assert_close(got, want.to(got.device), **FP32)


def test_decode_offset_widths(triton_device, monkeypatch):
    """KTRANS_ATTN_OFF32 (int32 cache offsets) and int64 ones give the oracle's output (fp32) at splits of several key
    steps with a tail step, empty splits past the lengths and pad rows; interpreted (one key step size for both)
    bitwise the same."""
    cases = [dict(kv_lens=[1, 40, 100, 144], plan=tri.DecodePlan(num_splits=4, split_tokens=48)),
             dict(kv_lens=[3, 29, 18], plan_len=2048, pad_rows=2)]
    for case in cases:
        outs = []
        for off32 in (False, True):
            monkeypatch.setattr(tri, "DECODE_OFF32", off32)
            kw = dict(case)
            with torch.random.fork_rng():  # the same cache and queries for both widths
                torch.manual_seed(5)
                got, want, _ = _decode_case(kw.pop("kv_lens"), 4, 2, 32, 4, torch.float32, triton_device, **kw)
            torch.testing.assert_close(got, want.to(got.device), **FP32)
            outs.append(got)
        assert not tri.interpreting() or all(torch.equal(outs[0], o) for o in outs[1:])


def test_plan_decode_depends_on_sizes_only():
    cpu = torch.device("cpu")
    p = tri.plan_decode(1, 2, 32768, cpu)
    assert p.num_splits * p.split_tokens >= 32768 and p.split_tokens % tri.DECODE_BLOCK_N == 0
    assert tri.plan_decode(1, 2, 1, cpu) == tri.DecodePlan(1, tri.DECODE_BLOCK_N)
    assert tri.plan_decode(256, 2, 32768, cpu).num_splits == 1  # enough programs without splitting


def test_short_splits_only_where_programs_are_few(monkeypatch):
    """KTRANS_ATTN_SHORT_SPLITS (attention.SHORT_SPLITS), planned for a 132-SM GPU with 2 KV heads: batch 1 at a 1k
    bucket takes 16 splits of one key block (4 of 256 without: 8 programs), at 576 keys 9, at 4k 64; plans that
    already give half the SMs a program (batch 1 from 16k keys, 16 rows) are unchanged. Every plan's split count
    is within what the warm-up compiles the merge for, its length in the autotuner's classes."""
    import types

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    gpu = torch.device("cuda")
    sizes = [(r, n) for r in (1, 2, 4, 16, 64) for n in (1, 100, 576, 1024, 4096, 8192, 16384, 32768, 131072)]
    off = {k: tri.plan_decode(*k[:1], 2, k[1], gpu) for k in sizes}
    monkeypatch.setattr(tri, "SHORT_SPLITS", True)
    on = {k: tri.plan_decode(*k[:1], 2, k[1], gpu) for k in sizes}
    assert (on[1, 1024].num_splits, on[1, 1024].split_tokens) == (16, tri.DECODE_BLOCK_N)
    assert (off[1, 1024].num_splits, off[1, 1024].split_tokens) == (4, 256)
    assert on[1, 576].num_splits == 9 and on[1, 4096].num_splits == 64
    for k in sizes:
        if 2 * k[0] * 2 * off[k].num_splits >= 132:
            assert on[k] == off[k], k
        p = on[k]
        assert p.num_splits * p.split_tokens >= k[1] and p.split_tokens % tri.DECODE_BLOCK_N == 0
        assert p.num_splits <= -(-tri.PROGRAMS_PER_SM * 132 // 2)
        assert tri.tune_class(p.split_tokens, tri.DECODE_TUNE_CLASSES) in {128, 256, 1024, 2048}
    assert on[16, 1024] == off[16, 1024] and on[1, 32768] == off[1, 32768]


def test_autotune_keys_are_size_classes():
    """The autotuners key on a few size classes, not on each size (a new key times every config, ~1 s, in the
    middle of serving): prefill's new tokens <= 64, <= 512, more; decode's keys per split <= 128, <= 256, <= 1024,
    more. Every split length plan_decode makes at up to 256 rows and 128k keys falls in one of the four."""
    classes = [tri.tune_class(n, tri.PREFILL_TUNE_CLASSES) for n in (1, 16, 64, 65, 257, 512, 513, 4096, 16384)]
    assert classes == [64, 64, 64, 512, 512, 512, 1024, 1024, 1024]
    cpu = torch.device("cpu")
    seen = {tri.tune_class(tri.plan_decode(rows, 2, n, cpu).split_tokens, tri.DECODE_TUNE_CLASSES)
            for rows in (1, 2, 4, 16, 64, 256) for n in (1, 100, 128, 300, 1000, 4096, 32768, 131072)}
    assert seen <= {128, 256, 1024, 2048}


def test_write_kv_then_mixed_batch_by_separate_calls(triton_device):
    """A mixed step: write every new token's K/V (pad row into the pad page), then its prefill sequences through
    the varlen kernel and its decode sequences through the split-K kernel, against the reference doing the same."""
    page, hq, hkv, d = 4, 4, 2, 16
    news, kv_lens = [3, 1, 6, 1], [3, 10, 9, 5]  # sequences 1 and 3 are decode steps
    c = Cache(kv_lens, page, hkv, d, torch.float32, triton_device)
    k_ref, v_ref = c.k.clone(), c.v.clone()
    slots = []
    for i, (n, L) in enumerate(zip(news, kv_lens)):
        slots += c.slots(i, range(L - n, L))
    slots.append(c.pad_page * page + 1)  # a pad row
    slots_t = torch.tensor(slots, device=triton_device)
    t = len(slots)
    k_new, v_new = torch.randn(t, hkv, d).to(triton_device), torch.randn(t, hkv, d).to(triton_device)
    tri.write_kv(c.k, c.v, slots_t, k_new, v_new)
    ref.write_kv(k_ref, v_ref, slots_t, k_new, v_new)
    assert torch.equal(c.k, k_ref) and torch.equal(c.v, v_ref)

    pre, dec = [0, 2], [1, 3]
    q_pre = torch.randn(news[0] + news[2], hq, d).to(triton_device)
    cu = _cu([news[i] for i in pre])
    lens_pre = [kv_lens[i] for i in pre]
    got = tri.paged_prefill(q_pre, c.k, c.v, torch.tensor(cu, device=triton_device),
                            torch.tensor(lens_pre, device=triton_device), c.tables[pre], page, d ** -0.5, 6)
    want = ref.paged_attention(q_pre, k_ref, v_ref, cu, lens_pre, c.tables[pre], page, d ** -0.5)
    torch.testing.assert_close(got, want, **FP32)
    q_dec = torch.randn(2, hq, d).to(triton_device)
    lens_dec = torch.tensor([kv_lens[i] for i in dec], device=triton_device)
    got = tri.paged_decode(q_dec, c.k, c.v, lens_dec, c.tables[dec], page, d ** -0.5,
                           tri.plan_decode(2, hkv, 16, torch.device(triton_device)))
    want = ref.paged_attention_decode(q_dec, k_ref, v_ref, lens_dec, c.tables[dec], page, d ** -0.5)
    torch.testing.assert_close(got, want, **FP32)


# ---- real shapes (head_dim 256, 16 query / 2 KV heads, page 16), compiled on the GPU ----


@pytest.mark.gpu
def test_prefill_real_shapes_bf16():
    news, kv_lens = [1, 301, 77, 640], [1, 1301, 77, 1000]
    got, want = _prefill_case(news, kv_lens, 16, 2, 256, 16, torch.bfloat16, "cuda")
    torch.testing.assert_close(got, want, **BF16)


@pytest.mark.gpu
def test_decode_real_shapes_bf16_with_pad_rows():
    got, want, _ = _decode_case([1, 17, 4099, 777, 2048, 9001], 16, 2, 256, 16, torch.bfloat16, "cuda",
                                plan_len=16384, pad_rows=2)
    torch.testing.assert_close(got, want, **BF16)


@pytest.mark.gpu
def test_decode_graph_capture_reads_lengths_from_the_device():
    """Captured once for a bucket, replayed with other lengths written into the same tensor: same as eager."""
    c = Cache([4000] * 4, 16, 2, 256, torch.bfloat16, "cuda")
    q = torch.randn(4, 16, 256, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([4000, 1, 333, 2500], device="cuda")
    plan = tri.plan_decode(4, 2, 4096, torch.device("cuda"))
    out = torch.empty_like(q)
    tri.paged_decode(q, c.k, c.v, lens, c.tables, 16, 0.0625, plan, out=out)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tri.paged_decode(q, c.k, c.v, lens, c.tables, 16, 0.0625, plan, out=out)
    lens.copy_(torch.tensor([17, 3999, 64, 1024], device="cuda"))
    g.replay()
    want = ref.paged_attention_decode(q.float(), c.k.float(), c.v.float(), lens, c.tables, 16, 0.0625)
    torch.testing.assert_close(out.float(), want, **BF16)


def test_pretune_plans_cover_every_class_the_cache_reaches():
    """The warm-up's decode autotuning (pretune_decode): one plan per split-length class, each of that class, with
    the splits a batch-1 plan would run and within the cache; classes past the cache left out."""
    plans = tri.pretune_plans(capacity=131072, kv_heads=2, sms=132)
    classes = [tri.tune_class(p.split_tokens, tri.DECODE_TUNE_CLASSES) for p in plans]
    assert classes == [*tri.DECODE_TUNE_CLASSES, 2 * tri.DECODE_TUNE_CLASSES[-1]]
    assert all(p.num_splits * p.split_tokens <= 131072 and p.num_splits <= 132 for p in plans)
    small = tri.pretune_plans(capacity=600, kv_heads=2, sms=132)
    assert [p.split_tokens for p in small] == [128, 256] and small[1].num_splits == 2
    assert tri.pretune_decode(torch.zeros(64, 2, 8), torch.zeros(64, 2, 8), 16, 4, 1.0) == []  # no autotuner here


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("t, h, d", [(1, 3, 40), (5, 2, 256)])
def test_output_gate(triton_device, dtype, t, h, d):
    """out * sigmoid(gate) with the gate read in place from q_proj's output (per head [q | gate]), against the
    operator's torch ops: equal up to fp32 rounding in fp32, and in bf16 up to torch's and Triton's sigmoid differing
    in the last fp32 bit before the rounding to bf16 (one bf16 ulp: rtol 2^-7)."""
    g = torch.Generator().manual_seed(t + d)
    qg = (torch.randn(t, h * 2 * d, generator=g) * 3).to(dtype).to(triton_device)
    out = torch.randn(t, h, d, generator=g).to(dtype).to(triton_device)
    gate = qg.view(t, h, 2 * d).chunk(2, dim=-1)[1]
    want = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    got = tri.output_gate(out, qg, d)
    assert got.shape == (t, h * d) and got.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(got, want, **tol)
    with pytest.raises(ValueError, match="do not fit"):
        tri.output_gate(out, qg[:, 1:], d)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_decode_gate_in_the_merge_is_the_output_gate_after_it(triton_device, dtype):
    """paged_decode with q_proj's output as `gate` (the sigmoid gate in the merge's store, KTRANS_ATTN_GATE_MERGE)
    gives bitwise output_gate of the ungated call, at several splits a row, empty splits and pad rows; a gate of
    the wrong width is refused."""
    hq, hkv, d, page = 4, 2, 32, 8
    outs = []
    for gated in (False, True):
        with torch.random.fork_rng():
            torch.manual_seed(11)
            c = Cache([3, 70, 41], page, hkv, d, dtype, triton_device)
            tables = torch.cat([c.tables, torch.full((1, c.tables.shape[1]), -1, device=triton_device)])
            tables[-1, 0] = c.pad_page
            lens = torch.tensor([3, 70, 41, 2], device=triton_device)
            q = torch.randn(4, hq, d).to(dtype).to(triton_device)
            qg = (torch.randn(4, hq * 2 * d) * 3).to(dtype).to(triton_device)
        plan = tri.DecodePlan(num_splits=5, split_tokens=16)
        o = tri.paged_decode(q, c.k, c.v, lens, tables, page, d ** -0.5, plan, gate=qg if gated else None)
        outs.append(o.reshape(4, -1) if gated else tri.output_gate(o, qg, d))
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="gate"):
        tri.paged_decode(q, c.k, c.v, lens, tables, page, d ** -0.5, plan, gate=qg[:, : hq * d])


def test_merge_split_counts_reach_every_merge_shape():
    """The warm-up compiles the merge at one split count per shape: every count a plan can give (up to the count at
    one row) has its shape among them, so no context length meets a merge compile inside a request."""
    for kv_heads, sms, block_d in ((2, 132, 256), (2, 16, 32), (4, 108, 128)):
        counts = tri.merge_split_counts(kv_heads, sms, block_d)
        most = -(-tri.PROGRAMS_PER_SM * sms // kv_heads)
        assert counts[0] == 1 and counts[-1] <= most and counts == sorted(set(counts))
        shapes = {tri_merge.merge_shape(n, block_d) for n in counts}
        assert {tri_merge.merge_shape(n, block_d) for n in range(1, most + 1)} == shapes and len(shapes) == len(counts)
        for rows in (1, 3, 16):
            for max_len in (1, 255, 4096, 32768, 131072):
                plan = tri.plan_decode(rows, kv_heads, max_len, torch.device("cpu")) if sms == 16 else None
                assert plan is None or tri_merge.merge_shape(plan.num_splits, block_d) in shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_compiles_once_whatever_the_split_count_and_lengths_view():
    """Split counts of one merge shape (a multiple of 16 or not: Triton would specialize on it) and the lengths as a
    view at an 8-byte offset (as the runner's may lie) reuse the first call's compiles of both decode kernels: what
    follows a context's length does not specialize them, so the warm-up's compiles serve every context."""
    from ktrans.kernels.triton import CompileLog

    c = Cache([130], 4, 2, 32, torch.bfloat16, "cuda")
    q = torch.randn(1, 4, 32, device="cuda").to(torch.bfloat16)
    buf = torch.tensor([0, 130], dtype=torch.int64, device="cuda")
    tri.paged_decode(q, c.k, c.v, buf[1:], c.tables, 4, 32 ** -0.5, tri.DecodePlan(num_splits=19, split_tokens=8))
    torch.cuda.synchronize()
    with CompileLog() as log:
        for n in (32, 31, 17):
            lens = buf[1:] if n != 31 else buf[1:].clone()  # an aligned copy too
            got = tri.paged_decode(q, c.k, c.v, lens, c.tables, 4, 32 ** -0.5, tri.DecodePlan(n, 8))
        torch.cuda.synchronize()
    assert not [k for k in log.kernels if "decode" in k], log.compiled
    want = ref.paged_attention_decode(q.float(), c.k.float(), c.v.float(), [130], c.tables, 4, 32 ** -0.5)
    torch.testing.assert_close(got.float(), want.to(got.device), atol=2e-2, rtol=2e-2)
