"""The plain-torch reference kernels against the plainest math (float64 loops) and against transformers.

These references are the oracles for every optimized kernel, so they are checked here on awkward sizes: lengths
around chunk boundaries, grouped heads, odd head dims, carried states, shuffled pages, odd page sizes.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ktrans.kernels.torch.attention import paged_attention, paged_attention_decode, write_kv
from ktrans.kernels.torch.conv import causal_conv1d, causal_conv1d_update
from ktrans.kernels.torch.gated_delta import (
    chunk_gated_delta_rule,
    gated_delta_rule_decode,
    l2norm,
    recurrent_gated_delta_rule,
)

# fp32 kernels against float64 loops; values are O(1) (unit q, k; randn v), so an absolute bound is meaningful.
F32 = dict(atol=1e-5, rtol=1e-5)


def hf():
    return pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


# ---------------------------------------------------------------------------------------------------------------
# gated delta rule


def make_gdr(length, hk=2, hv=6, dk=7, dv=5, batch=(), strong_decay=False, dtype=torch.float32):
    shape = (*batch, length)
    q = torch.randn(*shape, hk, dk, dtype=dtype)
    k = torch.randn(*shape, hk, dk, dtype=dtype)
    v = torch.randn(*shape, hv, dv, dtype=dtype)
    a = torch.randn(*shape, hv)
    # Like the model: g = -exp(A_log) * softplus(a + dt_bias); a strong A drives g to ~-50 (state wiped per token).
    g = -(16.0 if strong_decay else 1.0) * F.softplus(a)
    beta = torch.sigmoid(torch.randn(*shape, hv))
    state = torch.randn(*batch, hv, dk, dv)
    return q, k, v, g, beta, state


def naive_gdr(q, k, v, g, beta, state=None, use_qk_l2norm=True):
    """The recurrence written out per token and per head, in float64."""
    length, hk, dk = q.shape
    hv, dv = v.shape[1:]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    s = torch.zeros(hv, dk, dv, dtype=torch.float64) if state is None else state.double().clone()
    o = torch.zeros(length, hv, dv, dtype=torch.float64)
    for t in range(length):
        for h in range(hv):
            qt, kt = q[t, h // (hv // hk)], k[t, h // (hv // hk)]
            if use_qk_l2norm:
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            qt = qt / math.sqrt(dk)
            s[h] = s[h] * torch.exp(g[t, h])
            kv_mem = kt @ s[h]
            delta = beta[t, h] * (v[t, h] - kv_mem)
            s[h] = s[h] + torch.outer(kt, delta)
            o[t, h] = qt @ s[h]
    return o, s


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("length", [1, 2, 5, 63, 64, 65, 130])
def test_chunk_rule_matches_naive(length, chunk_size):
    q, k, v, g, beta, s0 = make_gdr(length)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
    o_ref, s_ref = naive_gdr(q, k, v, g, beta, s0)
    assert o.shape == v.shape and o.dtype == v.dtype
    assert s.shape == s0.shape and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, **F32)
    torch.testing.assert_close(s.double(), s_ref, **F32)


@pytest.mark.parametrize("length", [1, 5, 65])
@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_rule_matches_naive(length, with_state):
    q, k, v, g, beta, s0 = make_gdr(length)
    s0 = s0 if with_state else None
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_ref, s_ref = naive_gdr(q, k, v, g, beta, s0)
    torch.testing.assert_close(o.double(), o_ref, **F32)
    torch.testing.assert_close(s.double(), s_ref, **F32)


def test_no_qk_l2norm_matches_naive():
    # Unnormalised keys make the state grow, so compare relative to its size.
    q, k, v, g, beta, s0 = make_gdr(40)
    k = k * 0.3  # keep beta * |k|^2 below 2 so the recurrence stays bounded
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=16, use_qk_l2norm=False)
    o_ref, s_ref = naive_gdr(q, k, v, g, beta, s0, use_qk_l2norm=False)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunk_rule_equals_recurrent_rule(strong_decay):
    # Real-ish head sizes and one value head per key head.
    q, k, v, g, beta, s0 = make_gdr(200, hk=4, hv=4, dk=32, dv=16, strong_decay=strong_decay)
    o_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    torch.testing.assert_close(o_c, o_r, **F32)
    torch.testing.assert_close(s_c, s_r, **F32)


@pytest.mark.parametrize("pieces", [[1, 63, 2, 64], [5, 5, 120], [130]])
def test_split_sequence_carries_state(pieces):
    # Chunked prefill: running pieces with the state carried (mixing both forms) equals one pass.
    q, k, v, g, beta, s0 = make_gdr(sum(pieces))
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    outs, s, start = [], s0, 0
    for i, n in enumerate(pieces):
        sl = slice(start, start + n)
        rule = recurrent_gated_delta_rule if i % 2 else chunk_gated_delta_rule
        o, s = rule(q[sl], k[sl], v[sl], g[sl], beta[sl], initial_state=s)
        outs.append(o)
        start += n
    torch.testing.assert_close(torch.cat(outs), o_full, **F32)
    torch.testing.assert_close(s, s_full, **F32)


def test_empty_sequence_returns_initial_state():
    q, k, v, g, beta, s0 = make_gdr(0)
    for rule in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = rule(q, k, v, g, beta, initial_state=s0)
        assert o.shape == (0, 6, 5) and o.dtype == v.dtype
        assert torch.equal(s, s0) and s.data_ptr() != s0.data_ptr()
        o, s = rule(q, k, v, g, beta)
        assert torch.equal(s, torch.zeros_like(s0))


def test_initial_state_not_modified():
    q, k, v, g, beta, s0 = make_gdr(20)
    before = s0.clone()
    chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert torch.equal(s0, before)


def test_bf16_inputs_compute_in_fp32():
    q, k, v, g, beta, s0 = make_gdr(33, dtype=torch.bfloat16)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, s_ref = naive_gdr(q, k, v, g, beta, s0)
    torch.testing.assert_close(s.double(), s_ref, **F32)  # the state never passes through bf16
    torch.testing.assert_close(o.double(), o_ref, atol=2e-2, rtol=1e-2)  # one bf16 rounding of o


def test_decode_step_equals_recurrent_rule_per_sequence():
    b = 5
    q, k, v, g, beta, _ = make_gdr(1, batch=(b,))
    q, k, v, g, beta = (t[:, 0] for t in (q, k, v, g, beta))
    pool = torch.randn(8, 6, 7, 5)  # a state pool; the batch uses slots out of order
    slots = torch.tensor([6, 0, 3, 7, 2])
    expected = pool.clone()
    o_ref = []
    for i, slot in enumerate(slots.tolist()):
        o_i, expected[slot] = recurrent_gated_delta_rule(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], initial_state=pool[slot]
        )
        o_ref.append(o_i[0])

    state = pool[slots]  # gathered copy, scattered back as the model does
    o = gated_delta_rule_decode(q, k, v, g, beta, state)
    pool[slots] = state
    torch.testing.assert_close(o, torch.stack(o_ref), **F32)
    torch.testing.assert_close(pool, expected, **F32)


def test_decode_updates_a_view_in_place():
    q, k, v, g, beta, s0 = make_gdr(1, batch=(3,))
    q, k, v, g, beta = (t[:, 0] for t in (q, k, v, g, beta))
    pool = torch.randn(3, 6, 7, 5)
    view = pool[0:3]
    expected = [recurrent_gated_delta_rule(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1],
                                           beta[i : i + 1], initial_state=pool[i])[1] for i in range(3)]
    gated_delta_rule_decode(q, k, v, g, beta, view)
    torch.testing.assert_close(pool, torch.stack(expected), **F32)


def test_l2norm_matches_hf():
    x = torch.randn(4, 3, 7)
    assert torch.equal(l2norm(x), hf().l2norm(x, dim=-1, eps=1e-6))


@pytest.mark.parametrize("length, chunk_size", [(1, 64), (70, 64), (45, 16)])
def test_chunk_rule_matches_hf(length, chunk_size):
    m = hf()
    q, k, v, g, beta, s0 = make_gdr(length)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)
    # Older transformers releases take q/k already expanded to the value heads; expanding here (the mapping
    # value head h -> key head h // ratio) suits both, since newer ones skip their own expansion when equal.
    ratio = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    o_hf, s_hf = m.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=chunk_size, initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, o_hf[0], **F32)
    torch.testing.assert_close(s, s_hf[0], **F32)
    o_hf, s_hf = m.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, o_hf[0], **F32)
    torch.testing.assert_close(s, s_hf[0], **F32)


# ---------------------------------------------------------------------------------------------------------------
# causal conv1d


def naive_conv(x, weight, state=None, activation="silu"):
    """y[t, c] = act(sum_j w[c, j] * h[t + j, c]) over h = [state; x], in float64."""
    length, c = x.shape
    width = weight.shape[1]
    state = torch.zeros(width - 1, c, dtype=torch.float64) if state is None else state.double().t()
    h = torch.cat([state, x.double()])
    w = weight.double()
    y = torch.zeros(length, c, dtype=torch.float64)
    for t in range(length):
        for j in range(width):
            y[t] += w[:, j] * h[t + j]
    if activation == "silu":
        y = F.silu(y)
    return y, h[len(h) - (width - 1):].t()


@pytest.mark.parametrize("length", [1, 2, 3, 9])
@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_matches_naive(length, width, activation):
    x, w = torch.randn(length, 10), torch.randn(10, width)
    state = torch.randn(10, width - 1)
    for s in (None, state):
        y, new_state = causal_conv1d(x, w, s, activation=activation)
        y_ref, state_ref = naive_conv(x, w, s, activation=activation)
        assert y.shape == x.shape and new_state.shape == (10, width - 1)
        torch.testing.assert_close(y.double(), y_ref, **F32)
        torch.testing.assert_close(new_state.double(), state_ref, **F32)


@pytest.mark.parametrize("pieces", [[1, 1, 1, 1, 1], [2, 7, 1, 3], [14]])
def test_conv_split_sequence_carries_state(pieces):
    x, w = torch.randn(sum(pieces), 12), torch.randn(12, 4)
    s0 = torch.randn(12, 3)
    y_full, s_full = causal_conv1d(x, w, s0)
    ys, s, start = [], s0, 0
    for n in pieces:
        y, s = causal_conv1d(x[start : start + n], w, s)
        ys.append(y)
        start += n
    torch.testing.assert_close(torch.cat(ys), y_full, **F32)
    torch.testing.assert_close(s, s_full, **F32)


def test_conv_update_equals_prefill_per_sequence():
    b, c = 4, 9
    x, w = torch.randn(b, c), torch.randn(c, 4)
    state = torch.randn(b, c, 3)
    expected = [causal_conv1d(x[i : i + 1], w, state[i]) for i in range(b)]
    y = causal_conv1d_update(x, w, state)
    torch.testing.assert_close(y, torch.cat([e[0] for e in expected]), **F32)
    torch.testing.assert_close(state, torch.stack([e[1] for e in expected]), **F32)


def test_conv_matches_hf():
    m = hf()
    x, w = torch.randn(11, 16), torch.randn(16, 4)
    y, _ = causal_conv1d(x, w)
    y_hf = m.causal_conv1d_fn(x.t()[None], w, None, activation="silu")
    torch.testing.assert_close(y, y_hf[0].t(), **F32)

    # transformers caches K inputs, of which the oldest is never read: our K-1 state is its state[..., 1:].
    hf_state = torch.randn(3, 16, 4)
    state = hf_state[..., 1:].clone()
    xb = torch.randn(3, 16)
    y = causal_conv1d_update(xb, w, state)
    y_hf = m.causal_conv1d_update(xb[..., None], hf_state, w, None, activation="silu")
    torch.testing.assert_close(y, y_hf[..., 0], **F32)
    torch.testing.assert_close(state, hf_state[..., 1:], **F32)


def test_conv_bf16_keeps_dtypes():
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)
    y, s = causal_conv1d(x, w, torch.zeros(8, 3, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
    y_ref, s_ref = naive_conv(x, w, None)
    torch.testing.assert_close(y.double(), y_ref, atol=2e-2, rtol=1e-2)
    assert torch.equal(s.t(), x[-3:])


# ---------------------------------------------------------------------------------------------------------------
# paged attention


def dense_attention(q, k, v, scale):
    """Causal attention of n queries that are the last n of L keys, repeating kv heads, in float64."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    allowed = torch.ones(n, length, dtype=torch.bool).tril(diagonal=length - n)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def build_cache(seqs, page_size, hkv, d, dtype=torch.float32):
    """seqs: [(cached, new)]. Returns caches holding every sequence's KV in shuffled pages, plus batch metadata."""
    lens = [c + n for c, n in seqs]
    need = [-(-length // page_size) for length in lens]
    num_pages = sum(need) + 3  # spare pages stay garbage: reading one would show
    order = torch.randperm(num_pages).tolist()
    tables = torch.full((len(seqs), max(need) + 2), -1, dtype=torch.int64)
    k_cache = torch.randn(num_pages * page_size, hkv, d).to(dtype) * 100
    v_cache = torch.randn(num_pages * page_size, hkv, d).to(dtype) * 100
    keys, values, slots_new = [], [], []
    for i, length in enumerate(lens):
        pages = [order.pop() for _ in range(need[i])]
        tables[i, : need[i]] = torch.tensor(pages)
        rows = torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(length)])
        keys.append(torch.randn(length, hkv, d).to(dtype))
        values.append(torch.randn(length, hkv, d).to(dtype))
        cached = seqs[i][0]
        # Old tokens as an earlier step left them; the new ones go in through write_kv below.
        write_kv(k_cache, v_cache, rows[:cached], keys[i][:cached], values[i][:cached])
        slots_new.append(rows[cached:])
    new_k = torch.cat([kk[c:] for kk, (c, _) in zip(keys, seqs)])
    new_v = torch.cat([vv[c:] for vv, (c, _) in zip(values, seqs)])
    write_kv(k_cache, v_cache, torch.cat(slots_new), new_k, new_v)
    return k_cache, v_cache, tables, lens, keys, values


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_attention_matches_dense(page_size):
    hq, hkv, d = 6, 2, 8
    seqs = [(0, 5), (7, 1), (13, 6), (30, 1), (2, 17)]  # prefill, decode, chunked prefill in one call
    k_cache, v_cache, tables, lens, keys, values = build_cache(seqs, page_size, hkv, d)
    news = [n for _, n in seqs]
    cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    q = torch.randn(sum(news), hq, d)
    scale = d**-0.5
    o = paged_attention(q, k_cache, v_cache, cu, lens, tables, page_size, scale)
    assert o.shape == q.shape and o.dtype == q.dtype
    for i in range(len(seqs)):
        ref = dense_attention(q[cu[i] : cu[i + 1]], keys[i], values[i], scale)
        torch.testing.assert_close(o[cu[i] : cu[i + 1]].double(), ref, **F32)


@pytest.mark.parametrize("page_size", [1, 5])
def test_paged_attention_decode_matches_general(page_size):
    hq, hkv, d = 8, 2, 16
    seqs = [(0, 1), (9, 1), (22, 1), (4, 1)]
    k_cache, v_cache, tables, lens, _, _ = build_cache(seqs, page_size, hkv, d)
    q = torch.randn(len(seqs), hq, d)
    cu = torch.arange(len(seqs) + 1)
    o = paged_attention_decode(q, k_cache, v_cache, lens, tables, page_size, 0.3)
    o_ref = paged_attention(q, k_cache, v_cache, cu, lens, tables, page_size, 0.3)
    torch.testing.assert_close(o, o_ref, **F32)


def test_paged_attention_matches_hf_eager():
    m = hf()
    hq, hkv, d, n = 4, 2, 8, 9
    k_cache, v_cache, tables, lens, keys, values = build_cache([(0, n)], 4, hkv, d)
    q = torch.randn(n, hq, d)
    o = paged_attention(q, k_cache, v_cache, torch.tensor([0, n]), lens, tables, 4, d**-0.5)

    class Module(torch.nn.Module):
        num_key_value_groups = hq // hkv

    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    o_hf, _ = m.eager_attention_forward(
        Module(), q.transpose(0, 1)[None], keys[0].transpose(0, 1)[None], values[0].transpose(0, 1)[None],
        mask, scaling=d**-0.5,
    )
    torch.testing.assert_close(o, o_hf[0], **F32)


def test_paged_attention_bf16_output_dtype():
    hq, hkv, d = 4, 4, 8
    k_cache, v_cache, tables, lens, keys, values = build_cache([(3, 4)], 2, hkv, d, dtype=torch.bfloat16)
    q = torch.randn(4, hq, d, dtype=torch.bfloat16)
    o = paged_attention(q, k_cache, v_cache, torch.tensor([0, 4]), lens, tables, 2, d**-0.5)
    assert o.dtype == torch.bfloat16
    ref = dense_attention(q, keys[0], values[0], d**-0.5)
    torch.testing.assert_close(o.double(), ref, atol=2e-2, rtol=1e-2)


def test_write_kv_touches_only_its_rows():
    k_cache, v_cache = torch.zeros(10, 2, 3), torch.zeros(10, 2, 3)
    slots = torch.tensor([7, 2, 5])
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    others = torch.tensor([i for i in range(10) if i not in (7, 2, 5)])
    assert not k_cache[others].any() and not v_cache[others].any()
