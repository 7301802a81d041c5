"""The C++ decode-step kernels (ktrans.kernels.cpu_layers: fused Gated DeltaNet step, paged attention decode)
against the torch references they replace, on random inputs of awkward sizes, on every kernel path this CPU runs,
on the calling thread and on a 2-thread pool.

Tolerance: float32 throughout, so the kernels differ from torch only in summation order (and the fused q scale):
atol 2e-5 and rtol 1e-4 on outputs of size O(1) and on the updated states. A wrong head, gate, slot or page is off
by O(1).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ktrans import _cpu
from ktrans.kernels.cpu_layers import attn_decode, gdn_decode
from ktrans.kernels.torch.attention import paged_attention_decode, write_kv
from ktrans.kernels.torch.conv import causal_conv1d_update
from ktrans.kernels.torch.gated_delta import gated_delta_rule_decode
from ktrans.operators.norm import rms_norm_gated

TOL = dict(atol=2e-5, rtol=1e-4)
PATHS = [p for p in ("scalar", "avx512") if _cpu.path_status()[p] is None]


@pytest.fixture(params=["inline", "pool"])
def threads(request, pool):
    return None if request.param == "inline" else pool


def gdn_reference(mixed, z, b, a, A_log, dt_bias, conv_w, norm_w, eps, conv_pool, ssm_pool, slots, rows, hk, dk):
    """What KGatedDeltaNetTorch does for a decode batch: conv update, gates, delta rule, gated norm; pools in place."""
    n, hv, dv = slots.numel(), ssm_pool.shape[1], ssm_pool.shape[3]
    beta = b.sigmoid()
    g = -A_log.exp() * F.softplus(a + dt_bias)
    conv_state, ssm_state = conv_pool.index_select(0, slots), ssm_pool.index_select(0, slots)
    y = causal_conv1d_update(mixed[rows], conv_w, conv_state)
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    o = gated_delta_rule_decode(q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g[rows],
                                beta[rows], ssm_state)
    conv_pool.index_copy_(0, slots, conv_state.to(conv_pool.dtype))
    ssm_pool.index_copy_(0, slots, ssm_state)
    return rms_norm_gated(o.reshape(-1, dv), z[rows].reshape(-1, dv), norm_w, eps).reshape(n, hv * dv)


def gdn_inputs(gen, t, hk, hv, dk, dv, width, n_slots, conv_dtype):
    c = 2 * hk * dk + hv * dv
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(mixed=r(t, c), z=r(t, hv, dv), b=r(t, hv), a=r(t, hv), A_log=r(hv) * 0.5, dt_bias=r(hv),
                conv_w=r(c, width) * 0.5, norm_w=1 + 0.1 * r(dv), eps=1e-6,
                conv_pool=r(n_slots, c, width - 1).to(conv_dtype), ssm_pool=r(n_slots, hv, dk, dv) * 0.1)


# (hk, hv, dk, dv, conv width, token rows T, rows or None, slots)
GDN_CASES = [
    (2, 4, 20, 12, 4, 1, None, [3]),                 # B = 1, value-head groups of 2 (as the 80B: Hv = 2 Hk)
    (3, 6, 37, 19, 4, 3, None, [4, 0, 2]),           # B = 3, slots out of order, odd head dims
    (1, 2, 33, 17, 3, 7, [5, 1, 3], [1, 5, 0]),      # the decode rows of a mixed batch, conv width 3
    (2, 6, 16, 48, 2, 2, None, [2, 4]),              # groups of 3, head dims multiples of 16
]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("case", GDN_CASES, ids=lambda c: f"hk{c[0]}hv{c[1]}dk{c[2]}dv{c[3]}K{c[4]}B{len(c[7])}")
@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_matches_reference(case, conv_dtype, isa, threads):
    hk, hv, dk, dv, width, t, rows, slots = case
    gen = torch.Generator().manual_seed(dk * 100 + dv)
    x = gdn_inputs(gen, t, hk, hv, dk, dv, width, 6, conv_dtype)
    slots_t = torch.tensor(slots)
    rows_t = torch.arange(len(slots)) if rows is None else torch.tensor(rows)
    want_conv, want_ssm = x["conv_pool"].clone(), x["ssm_pool"].clone()
    want = gdn_reference(x["mixed"], x["z"], x["b"], x["a"], x["A_log"], x["dt_bias"], x["conv_w"], x["norm_w"],
                         x["eps"], want_conv, want_ssm, slots_t, rows_t, hk, dk)
    got = gdn_decode(x["mixed"], x["z"], x["b"], x["a"], x["A_log"], x["dt_bias"], x["conv_w"], x["norm_w"], x["eps"],
                     x["conv_pool"], x["ssm_pool"], slots_t, hk, dk, None if rows is None else torch.tensor(rows),
                     pool=threads, isa=isa)
    torch.testing.assert_close(got, want, **TOL)
    # The window is rounded to the pool dtype as the reference's copy_ does: equal bit for bit.
    assert torch.equal(x["conv_pool"], want_conv)
    torch.testing.assert_close(x["ssm_pool"], want_ssm, **TOL)


@pytest.mark.parametrize("isa", PATHS)
def test_gdn_decode_pad_rows_share_the_pad_slot(isa, threads):
    """A padded decode batch: two pad rows on the pad slot (5) beside three real sequences. The real outputs and
    slots equal the reference; the other slots are untouched."""
    hk, hv, dk, dv, width = 2, 4, 24, 20, 4
    gen = torch.Generator().manual_seed(11)
    x = gdn_inputs(gen, 5, hk, hv, dk, dv, width, 6, torch.float32)
    slots = torch.tensor([2, 5, 0, 5, 3])
    real = torch.tensor([0, 2, 4])
    want_conv, want_ssm = x["conv_pool"].clone(), x["ssm_pool"].clone()
    want = gdn_reference(x["mixed"], x["z"], x["b"], x["a"], x["A_log"], x["dt_bias"], x["conv_w"], x["norm_w"],
                         x["eps"], want_conv, want_ssm, slots[real], real, hk, dk)
    got = gdn_decode(x["mixed"], x["z"], x["b"], x["a"], x["A_log"], x["dt_bias"], x["conv_w"], x["norm_w"], x["eps"],
                     x["conv_pool"], x["ssm_pool"], slots, hk, dk, pool=threads, isa=isa)
    torch.testing.assert_close(got[real], want, **TOL)
    keep = torch.tensor([0, 1, 2, 3, 4])  # every slot but the pad slot
    torch.testing.assert_close(x["ssm_pool"][keep], want_ssm[keep], **TOL)
    assert torch.equal(x["conv_pool"][keep], want_conv[keep])


def test_gdn_decode_refuses_a_slot_out_of_range():
    gen = torch.Generator().manual_seed(1)
    x = gdn_inputs(gen, 2, 1, 2, 8, 8, 4, 3, torch.float32)
    before = x["ssm_pool"].clone()
    with pytest.raises(ValueError, match="slot 3"):
        gdn_decode(x["mixed"], x["z"], x["b"], x["a"], x["A_log"], x["dt_bias"], x["conv_w"], x["norm_w"], x["eps"],
                   x["conv_pool"], x["ssm_pool"], torch.tensor([0, 3]), 1, 8)
    assert torch.equal(x["ssm_pool"], before)


def paged_setup(gen, lens, hkv, d, page_size, dtype):
    """Caches with random old contents and block tables whose pages are shuffled and padded with -1."""
    pages_per = [-(-n // page_size) for n in lens]
    n_pages = sum(pages_per) + 2
    perm = torch.randperm(n_pages, generator=gen).tolist()
    width = max(pages_per) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int64)
    at = 0
    for i, p in enumerate(pages_per):
        tables[i, :p] = torch.tensor(perm[at:at + p])
        at += p
    shape = (n_pages * page_size, hkv, d)
    k_cache = torch.randn(*shape, generator=gen).to(dtype)
    v_cache = torch.randn(*shape, generator=gen).to(dtype)
    # The new token of sequence i is its last one: row page(len-1) * page_size + (len-1) % page_size.
    slot_mapping = torch.tensor([int(tables[i, (n - 1) // page_size]) * page_size + (n - 1) % page_size
                                 for i, n in enumerate(lens)])
    return k_cache, v_cache, tables, slot_mapping


# (hq, hkv, d, page_size, kv lens)
ATTN_CASES = [
    (6, 2, 40, 8, [1]),                   # B = 1, a single token of KV
    (6, 3, 24, 16, [150, 9, 64]),         # B = 3: several online-softmax blocks, a page boundary, groups of 2
    (16, 2, 256, 16, [70]),               # the 80B heads: 16 query heads on 2 kv heads of 256
    (5, 5, 33, 4, [13, 1, 66]),           # no grouping, head dim 33, page size 4
]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"hq{c[0]}hkv{c[1]}d{c[2]}p{c[3]}B{len(c[4])}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_decode_matches_reference(case, dtype, isa, threads):
    hq, hkv, d, page_size, lens = case
    gen = torch.Generator().manual_seed(len(lens) * 100 + d)
    k_cache, v_cache, tables, slot_mapping = paged_setup(gen, lens, hkv, d, page_size, dtype)
    b = len(lens)
    q = torch.randn(b, hq, d, generator=gen)
    k, v = torch.randn(b, hkv, d, generator=gen), torch.randn(b, hkv, d, generator=gen)
    scale = d ** -0.5
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(want_k, want_v, slot_mapping, k, v)
    lens_t = torch.tensor(lens)
    want = paged_attention_decode(q, want_k, want_v, lens_t, tables, page_size, scale)
    got = attn_decode(q, k, v, k_cache, v_cache, slot_mapping, lens_t, tables, page_size, scale, pool=threads, isa=isa)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    torch.testing.assert_close(got, want, **TOL)


def test_attn_decode_refuses_a_page_outside_the_cache():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables, slot_mapping = paged_setup(gen, [10], 1, 8, 4, torch.float32)
    tables[0, 1] = k_cache.shape[0] // 4  # one page past the end
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        attn_decode(q, k, k, k_cache, v_cache, slot_mapping, torch.tensor([10]), tables, 4, 1.0)
    assert torch.equal(k_cache, before)


# ---- the per-row ops (csrc/cpu/row_ops.*) against norm.py's rms_norm and moe.py's route / gated sum --------------
@pytest.mark.parametrize("rows,n", [(1, 2048), (3, 37), (5, 16), (2, 1)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rows_matches_reference(rows, n, with_residual):
    from ktrans.kernels.cpu_layers import rms_norm
    from ktrans.operators.norm import rms_norm as reference

    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, res, w = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g), 0.3 * torch.randn(n, generator=g)
    if not with_residual:
        torch.testing.assert_close(rms_norm(x, w, 1e-6), reference(x, w, 1e-6), **TOL)
        return
    out, total = rms_norm(x[:, None], w, 1e-6, residual=res[:, None])  # [rows, 1, n]: the shape comes back
    torch.testing.assert_close(total, (res + x)[:, None], atol=0, rtol=0)
    torch.testing.assert_close(out, reference(res + x, w, 1e-6)[:, None], **TOL)


@pytest.mark.parametrize("rows,experts,k", [(1, 512, 10), (4, 37, 5), (2, 8, 8), (3, 64, 1)])
@pytest.mark.parametrize("renorm", [True, False])
def test_moe_route_matches_reference(rows, experts, k, renorm):
    from ktrans.kernels.cpu_layers import moe_route
    from ktrans.operators.moe import route

    logits = 3 * torch.randn(rows, experts, generator=torch.Generator().manual_seed(experts + k))
    ids, weights = moe_route(logits, k, renorm)
    ref_ids, ref_weights = route(logits, k, renorm)
    assert torch.equal(ids, ref_ids)  # random logits: no ties
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_moe_route_ties_keep_the_lower_expert_first_and_refuses_bad_k():
    from ktrans.kernels.cpu_layers import moe_route

    ids, weights = moe_route(torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]]), 2, False)
    assert ids.tolist() == [[1, 2]] and weights[0, 0] == weights[0, 1]
    with pytest.raises(ValueError, match="top_k"):
        moe_route(torch.zeros(1, 4), 5, True)


def test_moe_gated_sum_matches_reference():
    from ktrans.kernels.cpu_layers import moe_gated_sum

    g = torch.Generator().manual_seed(3)
    routed, shared, gate = torch.randn(3, 41, generator=g), torch.randn(3, 41, generator=g), torch.randn(3, 1, generator=g)
    torch.testing.assert_close(moe_gated_sum(routed, shared, gate), routed + torch.sigmoid(gate) * shared, **TOL)
    with pytest.raises(ValueError, match="do not fit"):
        moe_gated_sum(routed, shared[:2], gate)
