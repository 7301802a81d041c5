"""The chunked gated delta rule's prep (ktrans.kernels.triton.gated_delta_prep): one program per (chunk, value head),
w and u made by column blocks of PREP_COLS. Compiled on CUDA and under Triton's interpreter (marked `triton`), with
column blocks narrower than the head dims and ending past them (the default 64 is covered by test_triton_gdn)."""
from __future__ import annotations

import pytest

import torch

from tests.kernels.test_triton_gdn import (SHAPES, _varlen_emit_case, check_against_reference,
                                           check_form_against_reference, rule_inputs, segments)

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from ktrans.kernels.triton import gated_delta_inv as inverse  # noqa: E402
from ktrans.kernels.triton import gated_delta_prep as prep  # noqa: E402
from ktrans.kernels.triton.gated_delta import _dot_types, chunk_gated_delta_rule_varlen, plan_chunks  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("cols", [16, 32])
def test_column_blocks_rule_matches_reference(triton_device, monkeypatch, cols):
    """The whole rule with w and u made 16 or 32 columns at a time against the torch oracle (varlen, carried and
    fresh slots), at SHAPES and at Dk 48 / Dv 40 (padded to 64: two or three column blocks, the last partly past the
    data)."""
    monkeypatch.setattr(prep, "PREP_COLS", cols)
    for hk, hv, dk, dv in [*SHAPES, (1, 2, 48, 40)]:
        lens, slots, fresh = [65, 1, 130], [2, 0, 1], [False, True, False]
        q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(sum(lens), hk, hv, dk, dv, triton_device)
        before = pool.clone()
        seqs = segments(lens, slots, fresh)
        o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan_chunks(seqs, triton_device))
        check_against_reference(o, pool, before, seqs, q, k, v, a, b, A_log, dt_bias)


@pytest.mark.parametrize("full", [1, 2])
@pytest.mark.parametrize("dtype,normed", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_full_product_form_matches_reference(triton_device, dtype, normed, full):
    """KTRANS_GDN_PREP_FULL: A as one [64, 64] product of k as stored, through the program's scratch, the diagonal
    inverses from rows read back from there (full=2: and the whole inverse assembled there, w and u as whole-chunk
    products). Varlen with a continued slot, partial chunks and emits at two boundaries, against the reference and
    the block form's pool (check_form_against_reference). The split forms (3, 4) are held to FULL=2's bits below."""
    q, k, v, a, b, A_log, dt_bias, pool, seqs, plan = _varlen_emit_case(dtype, triton_device)
    block, after = pool.clone(), pool.clone()
    chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, block, plan, normed=normed, full=0)
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, after, plan, normed=normed, full=full)
    check_form_against_reference(o, after, block, pool, seqs, q, k, v, a, b, A_log, dt_bias)


@triton.jit
def _diag_inverses_kernel(scr, out, INV: tl.constexpr):
    if INV:
        t0, t1, t2, t3 = inverse._inv_diag_doubling(scr)
    else:
        t0, t1, t2, t3 = inverse._inv_diag_from(scr)
    r = tl.arange(0, 16)
    offs = r[:, None] * 16 + r[None, :]
    tl.store(out + offs, t0)
    tl.store(out + 256 + offs, t1)
    tl.store(out + 512 + offs, t2)
    tl.store(out + 768 + offs, t3)


@pytest.mark.parametrize("inv", [0, 1])
def test_diagonal_inverses_match_float64(triton_device, inv):
    """The FULL forms' inverses of (I + A_bb) for A's four diagonal 16x16 blocks, row by row (0) and by doubling
    (KTRANS_GDN_PREP_INV=1), against float64 inverses: random strictly lower blocks, and nearly all-ones ones (keys
    that repeat, the case where powers of A grow and a sum of them would cancel); within 2e-6 of the largest entry."""
    gen = torch.Generator().manual_seed(7)
    cases = [torch.randn(64, 64, generator=gen) * 0.3, 0.99 + 0.01 * torch.rand(64, 64, generator=gen)]
    for a in cases:
        a = torch.tril(a, -1).contiguous()
        want = torch.stack([torch.linalg.inv(torch.eye(16, dtype=torch.float64) + a[i:i + 16, i:i + 16].double())
                            for i in range(0, 64, 16)])
        out = torch.empty(4, 16, 16, device=triton_device)
        _diag_inverses_kernel[(1,)](a.to(triton_device), out, INV=inv)
        err = (out.cpu().double() - want).abs().max().item()
        assert err <= 2e-6 * want.abs().max().item(), err


@pytest.mark.parametrize("inv", [1, 2])
@pytest.mark.parametrize("dtype,normed", [(torch.float32, False), (torch.bfloat16, True)])
def test_doubling_inverse_rule_matches_reference(triton_device, monkeypatch, dtype, normed, inv):
    """The whole rule with the FULL=2 prep's diagonal inverses by doubling (KTRANS_GDN_PREP_INV=1; 2: and the whole
    inverse assembled by 32-row halves) against the reference and the block form's pool, as
    test_full_product_form_matches_reference holds the row form."""
    monkeypatch.setattr(prep, "INV", inv)
    q, k, v, a, b, A_log, dt_bias, pool, seqs, plan = _varlen_emit_case(dtype, triton_device)
    block, after = pool.clone(), pool.clone()
    chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, block, plan, normed=normed, full=0)
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, after, plan, normed=normed, full=2)
    check_form_against_reference(o, after, block, pool, seqs, q, k, v, a, b, A_log, dt_bias)


@pytest.mark.parametrize("full", [3, 4, 5])
@pytest.mark.parametrize("dtype,normed", [(torch.bfloat16, True), (torch.float32, False)])
def test_later_launches_give_the_same_bits(triton_device, dtype, normed, full):
    """KTRANS_GDN_PREP_FULL=3 and 4: q's products, w and u made by later launches (gated_delta_wu; 4: q.k once a key
    head) from the inverse, the k rows' norms and cum the first launch left, beta made again from b: the same fp32
    values into the same products as FULL=2's one launch, so the rule's outputs, final and emitted states are
    bitwise FULL=2's (varlen, a continued slot, partial chunks). FULL=5, one launch with q, k and v loaded early and
    w and u made at their whole width, gives the same bits too."""
    q, k, v, a, b, A_log, dt_bias, pool, seqs, plan = _varlen_emit_case(dtype, triton_device)
    one, later = pool.clone(), pool.clone()
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, one, plan, normed=normed, full=2)
    o_later = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, later, plan, normed=normed, full=full)
    assert torch.equal(o_later, o)
    assert torch.equal(later, one)


def test_bad_column_blocks_are_refused(triton_device):
    hk, hv, dk, dv = SHAPES[0]
    q, k, v, a, b, A_log, dt_bias, _ = rule_inputs(3, hk, hv, dk, dv, triton_device)
    plan = plan_chunks([(0, 3, 0, True)], triton_device)
    t = k.shape[0]
    w, u = k.new_empty(t, hv, dk), v.new_empty(t, hv, dv)
    cum, attn = a.new_empty(t, hv).float(), v.new_empty(plan.num_chunks, hv, 64, 64)
    dt, prec = _dot_types(v.dtype)
    for cols in (8, 48):
        with pytest.raises(ValueError, match="PREP_COLS"):
            prep.launch_prep(q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, plan, 64, 64, dt, prec, 4, cols=cols)
    for full in (-1, 6):
        with pytest.raises(ValueError, match="KTRANS_GDN_PREP_FULL"):
            prep.launch_prep(q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, plan, 64, 64, dt, prec, 4, full=full)
    for inv in (-1, 3):
        with pytest.raises(ValueError, match="KTRANS_GDN_PREP_INV"):
            prep.launch_prep(q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, plan, 64, 64, dt, prec, 4, inv=inv)
    for regs in (16, 300):
        with pytest.raises(ValueError, match="KTRANS_GDN_PREP_MAXNREG"):
            prep.launch_prep(q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, plan, 64, 64, dt, prec, 4, maxnreg=regs)


@pytest.mark.parametrize("full", [0, 2, 4])
def test_register_cap_changes_no_bits(triton_device, full):
    """KTRANS_GDN_PREP_MAXNREG: a register cap only spills (on a GPU; the interpreter ignores it), so the rule's
    outputs and state are bitwise those without it."""
    q, k, v, a, b, A_log, dt_bias, pool, seqs, plan = _varlen_emit_case(torch.bfloat16, triton_device)
    free, capped = pool.clone(), pool.clone()
    o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, free, plan, normed=True, full=full,
                                      prep_maxnreg=0)
    o_cap = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, capped, plan, normed=True, full=full,
                                          prep_maxnreg=128)
    assert torch.equal(o_cap, o)
    assert torch.equal(capped, free)
