"""The Triton Gated DeltaNet kernels against their torch references (ktrans/kernels/torch/gated_delta.py, conv.py).

Run compiled on CUDA and by Triton's interpreter on the CPU (marked `triton`), at small awkward shapes: head dims
that are not powers of two, value-head groups of 2 and 3, lengths around the 64-token chunk (1, 63, 64, 65, 130),
states carried across calls, slots out of order, mixed prefill and decode rows, pad rows on the pad slot, and the
states emitted at chunk boundaries. The `gpu` test adds the real shapes (HK=16, HV=32, Dk=Dv=128).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ktrans.kernels.torch.conv import causal_conv1d, causal_conv1d_update
from ktrans.kernels.torch.gated_delta import chunk_gated_delta_rule, gated_delta_rule_decode

triton = pytest.importorskip("triton")

from ktrans.kernels.triton.conv import causal_conv1d_varlen  # noqa: E402
from ktrans.kernels.triton.gated_delta import chunk_gated_delta_rule_varlen, plan_chunks  # noqa: E402
from ktrans.kernels.triton.gated_delta_decode import gated_delta_decode  # noqa: E402

pytestmark = pytest.mark.triton

# fp32 kernels against the fp32 references, values O(1) (unit q and k, randn v, states of a few units): the
# kernels solve the chunk's triangular system by 16-row blocks and sum in other orders than torch, which costs
# a few ulps per step; 1e-4 leaves room for that over 130 tokens and would catch any wrong decay, gate or head.
TOL = dict(atol=1e-4, rtol=1e-4)
# (HK, HV, Dk, Dv): a group of 2 with Dv not a power of two; a group of 3 with neither dim one.
SHAPES = [(1, 2, 16, 24), (2, 6, 20, 12)]


def gates(a, b, A_log, dt_bias):
    return -A_log.exp() * F.softplus(a.float() + dt_bias), b.float().sigmoid()


def rule_inputs(t, hk, hv, dk, dv, device, slots=4):
    q, k = torch.randn(t, hk, dk, device=device), torch.randn(t, hk, dk, device=device)
    v = torch.randn(t, hv, dv, device=device)
    a, b = torch.randn(t, hv, device=device), torch.randn(t, hv, device=device)
    A_log, dt_bias = 0.5 * torch.randn(hv, device=device), torch.randn(hv, device=device)
    pool = torch.randn(slots, hv, dk, dv, device=device)
    return q, k, v, a, b, A_log, dt_bias, pool


def check_against_reference(o, pool, before, seqs, q, k, v, a, b, A_log, dt_bias):
    """Each sequence's outputs and final state against the torch oracle run on it alone, within TOL."""
    g, beta = gates(a, b, A_log, dt_bias)
    for s, e, slot, f in seqs:
        ref_o, ref_state = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                                  None if f else before[slot])
        torch.testing.assert_close(o[s:e], ref_o, **TOL, msg=f"output of the {e - s}-token sequence")
        torch.testing.assert_close(pool[slot], ref_state, **TOL, msg=f"state of the {e - s}-token sequence")


def segments(lens, slots, fresh):
    out, s = [], 0
    for n, slot, f in zip(lens, slots, fresh):
        out.append((s, s + n, slot, f))
        s += n
    return out


@pytest.mark.parametrize("lens", [[1], [5, 64, 3], [65, 1]])
def test_plan_tables_start_16_byte_aligned(lens):
    """Every table of a chunk plan starts on a 16-byte boundary whatever the chunk and sequence counts (Triton
    specializes pointer arguments on that alignment: views at size-dependent offsets recompiled the DeltaNet
    kernels in the middle of serving), and holds what the plan says."""
    plan = plan_chunks(segments(lens, range(len(lens)), [True] * len(lens)), torch.device("cpu"))
    tables = [plan.chunk_start, plan.chunk_len, plan.chunk_seq, plan.first_chunk, plan.seq_start, plan.seq_slot,
              plan.seq_fresh, plan.emit_slot]
    assert all(t.data_ptr() % 16 == 0 for t in tables)
    assert [len(t) for t in tables] == [plan.num_chunks] * 3 + [plan.num_seqs + 1] + [plan.num_seqs] * 3 + \
        [plan.num_chunks]
    assert plan.chunk_len.sum().item() == sum(lens) and plan.seq_slot.tolist() == list(range(len(lens)))
    assert plan.first_chunk.tolist()[-1] == plan.num_chunks and plan.emit_slot.eq(-1).all()


@pytest.mark.parametrize("shape,lens,slots,fresh,strong_decay", [
    (SHAPES[0], [1, 63, 64, 65, 130], [3, 0, 5, 1, 4], [False, True, False, True, False], False),
    (SHAPES[1], [7, 1, 40], [2, 0, 1], [False, False, True], False),
    # exp(A_log) = 20: g down to ~-100 per token, the chunk's decays underflow to 0 (and must not overflow).
    (SHAPES[0], [70], [1], [False], True),
])
def test_chunked_rule_matches_reference(triton_device, shape, lens, slots, fresh, strong_decay):
    hk, hv, dk, dv = shape
    q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(sum(lens), hk, hv, dk, dv, triton_device, slots=6)
    if strong_decay:
        A_log.fill_(3.0)
    before = pool.clone()
    seqs = segments(lens, slots, fresh)
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan_chunks(seqs, triton_device))
    check_against_reference(o, pool, before, seqs, q, k, v, a, b, A_log, dt_bias)
    untouched = [i for i in range(pool.shape[0]) if i not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("split", [50, 64])
def test_prefill_in_two_calls_equals_one(triton_device, split):
    hk, hv, dk, dv = SHAPES[0]
    t = 70
    q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(t, hk, hv, dk, dv, triton_device, slots=2)
    once = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool,
                                         plan_chunks([(0, t, 0, True)], triton_device))
    first = chunk_gated_delta_rule_varlen(q[:split], k[:split], v[:split], a[:split], b[:split], A_log, dt_bias,
                                          pool, plan_chunks([(0, split, 1, True)], triton_device))
    # The second call continues slot 1 at position `split`; its chunks are cut at absolute multiples of 64.
    second = chunk_gated_delta_rule_varlen(q[split:], k[split:], v[split:], a[split:], b[split:], A_log, dt_bias,
                                           pool, plan_chunks([(0, t - split, 1, False)], triton_device, [split]))
    torch.testing.assert_close(torch.cat([first, second]), once, **TOL)
    torch.testing.assert_close(pool[1], pool[0], **TOL)


def test_emitted_states_are_the_states_at_the_boundaries(triton_device):
    hk, hv, dk, dv = SHAPES[0]
    # Sequence 0 continues at position 30 for 150 tokens: it reaches 64 and 128. Sequence 1 starts fresh and ends
    # on a boundary (64 and 128, the last being its final state).
    lens, starts = [150, 128], [30, 0]
    q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(sum(lens), hk, hv, dk, dv, triton_device, slots=8)
    before = pool.clone()
    seqs = segments(lens, [0, 1], [False, True])
    plan = plan_chunks(seqs, triton_device, starts, emit=[[5, 2], [3, 7]])
    chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan)
    g, beta = gates(a, b, A_log, dt_bias)
    for (s, _e, slot, f), start, emits in zip(seqs, starts, [[5, 2], [3, 7]]):
        for boundary, emit_slot in zip((64, 128), emits):
            n = boundary - start
            _, want = chunk_gated_delta_rule(q[s:s + n], k[s:s + n], v[s:s + n], g[s:s + n], beta[s:s + n],
                                             None if f else before[slot])
            torch.testing.assert_close(pool[emit_slot], want, **TOL, msg=f"state at position {boundary}")
    torch.testing.assert_close(pool[7], pool[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="reaches 2 chunk boundaries but has 1 emit slots"):
        plan_chunks(seqs, triton_device, starts, emit=[[5], [3, 7]])


@pytest.mark.parametrize("width", [4, 3])
def test_conv_varlen_matches_reference(triton_device, width):
    channels = 70  # past one block of 64 channels
    lens, slots, fresh = [1, 2, 70, 5], [3, 0, 1, 4], [False, False, True, False]
    x = torch.randn(sum(lens), channels, device=triton_device)
    weight = torch.randn(channels, width, device=triton_device)
    pool = torch.randn(6, channels, width - 1, device=triton_device)
    before = pool.clone()
    seqs = segments(lens, slots, fresh)
    y = causal_conv1d_varlen(x, weight, pool, plan_chunks(seqs, triton_device))
    for s, e, slot, f in seqs:
        ref_y, ref_state = causal_conv1d(x[s:e], weight, None if f else before[slot])
        torch.testing.assert_close(y[s:e], ref_y, **TOL)
        torch.testing.assert_close(pool[slot], ref_state, **TOL)
    assert torch.equal(pool[[2, 5]], before[[2, 5]])
    # A first chunk shorter than the window (chunks aligned at position 62) is refused, not raced.
    with pytest.raises(ValueError, match="shorter than the conv's window"):
        causal_conv1d_varlen(x[:5], weight, pool, plan_chunks([(0, 5, 0, False)], triton_device, [62 if width == 4
                                                                                                 else 63]))


def decode_inputs(t, hk, hv, dk, dv, width, device, slots):
    conv_dim = 2 * hk * dk + hv * dv
    mixed = torch.randn(t, conv_dim, device=device)
    a, b = torch.randn(t, hv, device=device), torch.randn(t, hv, device=device)
    A_log, dt_bias = 0.5 * torch.randn(hv, device=device), torch.randn(hv, device=device)
    weight = torch.randn(conv_dim, width, device=device)
    conv_pool = torch.randn(slots, conv_dim, width - 1, device=device)
    ssm_pool = torch.randn(slots, hv, dk, dv, device=device)
    return mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool


def reference_decode(mixed, a, b, A_log, dt_bias, weight, conv_state, ssm_state, hk, dk):
    n = mixed.shape[0]
    hv, dv = ssm_state.shape[1], ssm_state.shape[3]
    y = causal_conv1d_update(mixed, weight, conv_state)
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g, beta = gates(a, b, A_log, dt_bias)
    return gated_delta_rule_decode(q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g, beta,
                                   ssm_state)


# One launch holding all of a key head's value heads at once or one by one, or two launches (conv, gates and norms
# per key head; the state per value head and block of columns), or those two folded into one on the second's grid.
@pytest.mark.parametrize("heads_per_tile,split_v,fold", [(None, False, False), (1, False, False),
                                                         (None, True, False), (None, True, True)])
@pytest.mark.parametrize("shape,width", [(SHAPES[0], 4), (SHAPES[1], 3)])
def test_decode_step_matches_reference(triton_device, shape, width, heads_per_tile, split_v, fold):
    hk, hv, dk, dv = shape
    # A mixed step's flat batch of 7 tokens: decode rows 5, 0 and 3 (the rest belong to prefill chunks), their
    # slots out of order.
    mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool = decode_inputs(7, hk, hv, dk, dv, width,
                                                                             triton_device, slots=6)
    conv0, ssm0 = conv_pool.clone(), ssm_pool.clone()
    rows = torch.tensor([5, 0, 3], device=triton_device)
    slots = torch.tensor([4, 1, 2], device=triton_device)
    out = torch.full((7, hv, dv), 7.0, device=triton_device)
    gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool, slots, hk, dk, rows=rows, out=out,
                       heads_per_tile=heads_per_tile, split_v=split_v, fold=fold)
    conv_ref, ssm_ref = conv0[slots], ssm0[slots]
    want = reference_decode(mixed[rows], a[rows], b[rows], A_log, dt_bias, weight, conv_ref, ssm_ref, hk, dk)
    torch.testing.assert_close(out[rows], want, **TOL)
    torch.testing.assert_close(conv_pool[slots], conv_ref, **TOL)
    torch.testing.assert_close(ssm_pool[slots], ssm_ref, **TOL)
    assert torch.all(out[[1, 2, 4, 6]] == 7.0), "rows that are not decode rows are left alone"
    assert torch.equal(ssm_pool[[0, 3, 5]], ssm0[[0, 3, 5]]) and torch.equal(conv_pool[[0, 3, 5]], conv0[[0, 3, 5]])


@pytest.mark.parametrize("split_v,fold", [(False, False), (True, False), (True, True)])
def test_decode_reads_a_and_b_in_place_from_in_proj_bas_groups(triton_device, split_v, fold):
    """a and b given as the [T, HK, R] views of in_proj_ba's output ([b (R) | a (R)] per key head, what
    KQwen3NextGatedDeltaNet.split_ba hands a TAKES_GROUPED_BA op) give bitwise what their [T, HV] copies give: outputs,
    conv windows and states, at decode rows out of order; a layout other than groups of R is refused."""
    hk, hv, dk, dv = SHAPES[1]
    r = hv // hk
    mixed, _, _, A_log, dt_bias, weight, conv_pool, ssm_pool = decode_inputs(5, hk, hv, dk, dv, 4, triton_device,
                                                                             slots=4)
    ba = torch.randn(5, hk * 2 * r, device=triton_device)
    b3, a3 = ba.view(5, hk, 2 * r).split([r, r], dim=-1)
    rows, slots = torch.tensor([3, 0, 4], device=triton_device), torch.tensor([2, 0, 1], device=triton_device)
    results = []
    for a, b in ((a3.reshape(5, hv), b3.reshape(5, hv)), (a3, b3)):
        pools = conv_pool.clone(), ssm_pool.clone()
        out = gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, *pools, slots, hk, dk, rows=rows,
                                 split_v=split_v, fold=fold)
        results.append((out[rows], *pools))
    for want, got in zip(*results):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="key-head groups"):
        gated_delta_decode(mixed, a3[:, :, :1], b3[:, :, :1], A_log, dt_bias, weight, conv_pool, ssm_pool, slots, hk,
                           dk, rows=rows)


@pytest.mark.parametrize("split_v,fold", [(False, False), (True, False), (True, True)])
def test_decode_bucket_pad_rows_touch_only_the_pad_slot(triton_device, split_v, fold):
    hk, hv, dk, dv = SHAPES[0]
    pad = 3  # StatePool.pad_slot: one past the usable slots
    mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool = decode_inputs(4, hk, hv, dk, dv, 4, triton_device,
                                                                             slots=pad + 1)
    conv0, ssm0 = conv_pool.clone(), ssm_pool.clone()
    slots = torch.tensor([2, 0, pad, pad], device=triton_device)  # a bucket of 4 with 2 live rows
    out = gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool, slots, hk, dk, split_v=split_v,
                             fold=fold)
    live = slots[:2]
    conv_ref, ssm_ref = conv0[live], ssm0[live]
    want = reference_decode(mixed[:2], a[:2], b[:2], A_log, dt_bias, weight, conv_ref, ssm_ref, hk, dk)
    torch.testing.assert_close(out[:2], want, **TOL)
    torch.testing.assert_close(ssm_pool[live], ssm_ref, **TOL)
    assert torch.equal(ssm_pool[1], ssm0[1]) and torch.equal(conv_pool[1], conv0[1])
    assert torch.isfinite(out[2:]).all() and torch.isfinite(ssm_pool[pad]).all()


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,with_rows", [(SHAPES[0], True), (SHAPES[1], False), ((1, 2, 16, 128), False)])
def test_decode_with_the_output_norm_fused(triton_device, shape, with_rows, dtype, fold):
    """gated_delta_decode(norm=(z, w, eps)) against the decode step followed by the norm's own launch
    (norm.rms_norm_gated, the same arithmetic: within one rounding of the output's dtype, from the order of the fp32
    sum) and the torch oracle of both (TOL, or bf16's rounding), at decode rows out of order or a bucket with a pad
    row on the pad slot; Dv = 128 splits a head's columns over several programs (8 here), so the count's last
    program norms what the others stored. With the folded launch too, whose compiled conv sums may differ from the
    two launches' in the last bit: on a GPU it is held to the oracle's tolerance and the states to fp32 rounding.
    Twice in a row, so the counts are zero after each call; rows that are not decode rows are left alone; a bad z
    and the one-launch path are refused."""
    from ktrans.kernels.triton.norm import rms_norm_gated as tri_rms_norm_gated
    from ktrans.kernels.triton.quant import counters
    from ktrans.operators.norm import rms_norm_gated

    hk, hv, dk, dv = shape
    t, eps = 6, 1e-6
    mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool = decode_inputs(t, hk, hv, dk, dv, 4, triton_device,
                                                                             slots=5)
    mixed = mixed.to(dtype)
    rows = torch.tensor([4, 0, 3], device=triton_device) if with_rows else None
    slots = torch.tensor([3, 1, 2], device=triton_device) if with_rows else torch.tensor([3, 1, 0, 2, 4, 4],
                                                                                         device=triton_device)
    live = rows if with_rows else torch.arange(5, device=triton_device)[:4]  # slot 4: the pad slot, rows 4 and 5
    zq = torch.randn(t, hv * dv + 5, device=triton_device, dtype=dtype)  # z a strided view, as in_proj_qkvz gives it
    z = zq[:, 5:].view(t, hv, dv)
    nw = (1 + 0.1 * torch.randn(dv, device=triton_device)).to(dtype)
    pools = conv_pool.clone(), ssm_pool.clone()
    plain = gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, *pools, slots, hk, dk, rows=rows, split_v=True,
                               out=torch.zeros(t, hv, dv, device=triton_device, dtype=dtype))
    want = tri_rms_norm_gated(plain, z, nw, eps)
    oracle = rms_norm_gated(plain.float(), z.float(), nw.float(), eps)
    for _ in range(2):
        fused_pools = conv_pool.clone(), ssm_pool.clone()
        out = torch.full((t, hv, dv), 7.0, device=triton_device, dtype=dtype)
        gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, *fused_pools, slots, hk, dk, rows=rows, out=out,
                           norm=(z, nw, eps), fold=fold)
        assert int(counters(triton_device)[:t * (hv + hk)].abs().sum()) == 0, "every count back to zero"
        bits = not fold or triton_device.type == "cpu"  # the same conv sums as the plain step's
        one_ulp = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
        oracle_tol = TOL if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(out[live], want[live], **(one_ulp if bits else oracle_tol))
        torch.testing.assert_close(out[live].float(), oracle[live], **oracle_tol)
        for got, ref in zip(fused_pools, pools):  # the states and windows as the plain step leaves them
            got, ref = (got, ref) if with_rows else (got[:4], ref[:4])  # (the pad slot, raced by two rows, aside)
            if bits:
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        if with_rows:
            assert torch.all(out[[1, 2, 5]] == 7.0), "rows that are not decode rows are left alone"
        else:
            assert torch.isfinite(out[4:]).all()
    with pytest.raises(ValueError, match="norm's z"):
        gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, *pools, slots, hk, dk, rows=rows,
                           norm=(z[:, :, :-1], nw, eps))
    with pytest.raises(ValueError, match="two-launch"):
        gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, *pools, slots, hk, dk, rows=rows, split_v=False,
                           norm=(z, nw, eps))


@pytest.mark.parametrize("shape,t", [(SHAPES[1], 5), ((2, 4, 32, 128), 3)])
def test_folded_launch_gives_the_two_launches_bits(triton_device, shape, t):
    """KTRANS_GDN_DECODE_FOLD's one launch makes each program's q, k, v and gates with the prep launch's arithmetic:
    the two launches' outputs, states and conv windows, at a group of 3 with odd dims and at Dv = 128 (8 column
    blocks a head, so a key head's q/k windows are shifted by the last of 16 programs); twice in a row (the counts
    reset), and the counts zero after. Interpreted, bitwise; compiled, the conv's four products may be summed in
    another order in another tile shape, so within fp32 rounding."""
    from ktrans.kernels.triton.quant import counters

    hk, hv, dk, dv = shape
    mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool = decode_inputs(t, hk, hv, dk, dv, 4, triton_device,
                                                                             slots=t + 1)
    slots = torch.randperm(t, generator=torch.Generator().manual_seed(3)).to(triton_device)
    runs = []
    for fold in (False, True):
        pools = conv_pool.clone(), ssm_pool.clone()
        outs = [gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, *pools, slots, hk, dk, split_v=True,
                                   fold=fold) for _ in range(2)]
        runs.append((*outs, *pools))
    assert int(counters(triton_device)[:t * (hv + hk)].abs().sum()) == 0
    for want, got in zip(*runs):
        if triton_device.type == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="folded launch"):
        gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool, slots, hk, dk, split_v=False,
                           fold=True)


def test_prefill_then_decode_equals_one_prefill(triton_device):
    """The three kernels hand their states to each other: prefill 61 tokens, decode 4 = prefill 65."""
    hk, hv, dk, dv = SHAPES[0]
    width, t, p = 4, 65, 61
    mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool = decode_inputs(t, hk, hv, dk, dv, width, triton_device,
                                                                             slots=2)
    kd = hk * dk

    def prefill(lo, hi, slot, fresh, start):
        plan = plan_chunks([(0, hi - lo, slot, fresh)], triton_device)
        y = causal_conv1d_varlen(mixed[lo:hi], weight, conv_pool, plan)
        n = hi - lo
        return chunk_gated_delta_rule_varlen(
            y[:, :kd].view(n, hk, dk), y[:, kd:2 * kd].view(n, hk, dk), y[:, 2 * kd:].view(n, hv, dv), a[lo:hi],
            b[lo:hi], A_log, dt_bias, ssm_pool, plan_chunks([(0, n, slot, fresh)], triton_device, [start]))

    whole = prefill(0, t, 0, True, 0)
    steps = [prefill(0, p, 1, True, 0)]
    one = torch.tensor([1], device=triton_device)
    for i in range(p, t):
        steps.append(gated_delta_decode(mixed[i:i + 1], a[i:i + 1], b[i:i + 1], A_log, dt_bias, weight, conv_pool,
                                        ssm_pool, one, hk, dk))
    torch.testing.assert_close(torch.cat(steps), whole, **TOL)
    torch.testing.assert_close(ssm_pool[1], ssm_pool[0], **TOL)
    torch.testing.assert_close(conv_pool[1], conv_pool[0], **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,normed,full", [(torch.float32, False, 0), (torch.bfloat16, False, 0),
                                               (torch.bfloat16, True, 0), (torch.float32, False, 1),
                                               (torch.bfloat16, True, 1), (torch.float32, False, 2),
                                               (torch.bfloat16, True, 2), (torch.bfloat16, True, 3),
                                               (torch.bfloat16, True, 4), (torch.float32, False, 5),
                                               (torch.bfloat16, True, 5), (torch.float32, False, 6),
                                               (torch.bfloat16, True, 6)])
def test_real_shapes_on_the_gpu(dtype, normed, full):
    """HK=16, HV=32, Dk=Dv=128: two sequences of prefill (one carried) and a decode batch of 5, against the
    references run in fp32 on the same (rounded) inputs. bf16: the kernels keep w, u and the chunk's q.k matrix in
    bf16 and multiply bf16 operands (the state too) on the tensor cores: half a dozen roundings of 2^-8 each, so
    4e-2 of the outputs' largest value; fp32 multiplies exactly (input_precision ieee), so TOL. normed: the scan over
    the prep's normalised q and k (KTRANS_GDN_NORMED), the same bounds; full: the prep's A (2: and its inverse; 3, 4:
    the rest by later launches; 5: q, k and v loaded early; 6: a program a key head) through scratch
    (KTRANS_GDN_PREP_FULL), the same bounds."""
    dev = torch.device("cuda")
    hk, hv, dk, dv = 16, 32, 128, 128
    lens, slots, fresh = [200, 77], [2, 0], [False, True]
    q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(sum(lens), hk, hv, dk, dv, dev, slots=3)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    before = pool.clone()
    seqs = segments(lens, slots, fresh)
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan_chunks(seqs, dev), normed=normed,
                                      full=full)
    g, beta = gates(a, b, A_log, dt_bias)
    scale_tol = 4e-2 if dtype == torch.bfloat16 else None
    for s, e, slot, f in seqs:
        ref_o, ref_state = chunk_gated_delta_rule(q[s:e].float(), k[s:e].float(), v[s:e].float(), g[s:e], beta[s:e],
                                                  None if f else before[slot])
        if scale_tol:
            assert (o[s:e].float() - ref_o).abs().max() <= scale_tol * ref_o.abs().max()
            assert (pool[slot] - ref_state).abs().max() <= scale_tol * ref_state.abs().max()
        else:
            torch.testing.assert_close(o[s:e], ref_o, **TOL)
            torch.testing.assert_close(pool[slot], ref_state, **TOL)
    mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool = decode_inputs(5, hk, hv, dk, dv, 4, dev, slots=6)
    mixed = mixed.to(dtype)
    slots_t = torch.tensor([5, 1, 3, 0, 2], device=dev)
    conv_ref, ssm_ref = conv_pool[slots_t].float(), ssm_pool[slots_t].clone()
    out = gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool, slots_t, hk, dk)
    want = reference_decode(mixed.float(), a, b, A_log, dt_bias, weight, conv_ref, ssm_ref, hk, dk)
    decode_tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else TOL  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), want, **decode_tol)
    torch.testing.assert_close(ssm_pool[slots_t], ssm_ref, **TOL)


def test_bf16_inputs(triton_device):
    """bf16 activations (the real model's): the kernels keep w, u and the chunk's q.k matrix in bf16 and the output
    is rounded to bf16, so the bound is 2e-2 of the largest value (bf16 keeps 8 bits), against the fp32 reference
    on the same rounded inputs."""
    hk, hv, dk, dv = SHAPES[0]
    q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(70, hk, hv, dk, dv, triton_device, slots=2)
    q, k, v, a, b = (x.to(torch.bfloat16) for x in (q, k, v, a, b))
    before = pool.clone()
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan_chunks([(0, 70, 1, False)],
                                                                                       triton_device))
    g, beta = gates(a, b, A_log, dt_bias)
    ref_o, ref_state = chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, before[1])
    assert o.dtype == torch.bfloat16
    assert (o.float() - ref_o).abs().max() <= 2e-2 * ref_o.abs().max()
    assert (pool[1] - ref_state).abs().max() <= 2e-2 * ref_state.abs().max()


def _varlen_emit_case(dtype, device):
    """Three sequences (one continued from its slot at cached length 30, partial chunks) with emits at two
    boundaries: the rule's inputs (q, k, v in dtype), the pool, the segments and the plan."""
    hk, hv, dk, dv = SHAPES[0]
    lens, starts = [150, 40, 128], [30, 0, 0]
    q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(sum(lens), hk, hv, dk, dv, device, slots=9)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    seqs = segments(lens, [0, 1, 2], [False, True, True])
    return q, k, v, a, b, A_log, dt_bias, pool, seqs, plan_chunks(seqs, device, starts, emit=[[5, 3], [], [6, 7]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_output_launch_equals_the_scan(triton_device, dtype):
    """KTRANS_GDN_SPLIT: the outputs by a launch parallel over chunks from the states and v_new the sequential
    launch stores give bitwise the one scan's outputs, final states and emitted states (varlen, a continued slot,
    partial chunks, emits at two boundaries)."""
    q, k, v, a, b, A_log, dt_bias, pool, seqs, plan = _varlen_emit_case(dtype, triton_device)
    got = {}
    for split in (False, True):
        p = pool.clone()
        o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, p, plan, split=split)
        got[split] = (o, p)
    assert torch.equal(got[False][0], got[True][0]) and torch.equal(got[False][1], got[True][1])
    assert not torch.equal(got[True][1][5], pool[5])  # the emits were written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_output_launch_any_width(triton_device, dtype):
    """The split form's output launch with all value columns in one program (out_block_v 64, capped at Dv 24's
    padded 32) where the scan takes 16 (OUT_BLOCK_V): each output is the same sums of the same products, only tiled
    differently, so within TOL of the one scan (fp32) or a bf16 rounding of it (bf16 outputs, 2^-8 of the largest);
    the states are bitwise (the same sequential launch)."""
    q, k, v, a, b, A_log, dt_bias, pool, seqs, plan = _varlen_emit_case(dtype, triton_device)
    one, split = pool.clone(), pool.clone()
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, one, plan, block_v=16)
    o_split = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, split, plan, block_v=16, split=True,
                                            out_block_v=64)
    assert torch.equal(split, one)
    if dtype == torch.float32:
        torch.testing.assert_close(o_split, o, **TOL)
    else:
        assert (o_split.float() - o.float()).abs().max() <= 2 ** -8 * o.float().abs().max()


@pytest.mark.parametrize("dtype,split", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_normed_scan_matches_reference(triton_device, dtype, split):
    """KTRANS_GDN_NORMED: the prep stores the normalised q and k once and the scan reads them as the dots' operands,
    the decays moved onto the products' and v_new's rows. Varlen with a continued slot, partial chunks and emits at
    two boundaries, against the reference (fp32: TOL; bf16 inputs: 2e-2 of the largest value, as test_bf16_inputs)
    and the plain scan's final and emitted states."""
    q, k, v, a, b, A_log, dt_bias, pool, seqs, plan = _varlen_emit_case(dtype, triton_device)
    plain, normed = pool.clone(), pool.clone()
    chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, plain, plan, split=split, normed=False)
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, normed, plan, split=split, normed=True)
    check_form_against_reference(o, normed, plain, pool, seqs, q, k, v, a, b, A_log, dt_bias)


def check_form_against_reference(o, after, plain, before, seqs, q, k, v, a, b, A_log, dt_bias):
    """A form of the rule (o, the pool `after` it) against the reference from `before`, and against the plain form's
    pool: fp32 inputs within TOL of both; bf16 inputs within 2e-2 of the largest value (as test_bf16_inputs)."""
    if q.dtype == torch.float32:
        check_against_reference(o, after, before, seqs, q, k, v, a, b, A_log, dt_bias)
        torch.testing.assert_close(after, plain, **TOL)
        return
    g, beta = gates(a, b, A_log, dt_bias)
    for s, e, slot, fresh in seqs:
        ref_o, ref_state = chunk_gated_delta_rule(q[s:e].float(), k[s:e].float(), v[s:e].float(), g[s:e], beta[s:e],
                                                  None if fresh else before[slot])
        assert (o[s:e].float() - ref_o).abs().max() <= 2e-2 * ref_o.abs().max()
        assert (after[slot] - ref_state).abs().max() <= 2e-2 * ref_state.abs().max()
    assert (after - plain).abs().max() <= 2e-2 * plain.abs().max()
