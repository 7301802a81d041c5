"""The chunked gated delta rule's prep in its three forms (ktrans.kernels.triton.gated_delta_prep, KTRANS_GDN_PREP):
a program per (chunk, key head) for the group; per (chunk, value head) with w and u made a column block at a time
(head); or per (chunk, value head) storing (I + A)^-1, then w and u as one product a column block (ai). Compiled on CUDA and under Triton's interpreter (marked `triton`), at head dims that are not powers of two
and column blocks that end past them."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_gdn import SHAPES, check_against_reference, rule_inputs, segments

pytest.importorskip("triton")

from ktrans.kernels.triton import gated_delta_prep as prep  # noqa: E402
from ktrans.kernels.triton.gated_delta import _dot_types, chunk_gated_delta_rule_varlen, plan_chunks  # noqa: E402

pytestmark = pytest.mark.triton


def _prep(form, q, k, v, a, b, A_log, dt_bias, plan, cols):
    t, hv, dk, dv = k.shape[0], v.shape[1], k.shape[2], v.shape[2]
    nan = float("nan")
    w = torch.full((t, hv, dk), nan, dtype=v.dtype, device=v.device)
    u = torch.full((t, hv, dv), nan, dtype=v.dtype, device=v.device)
    cum = torch.full((t, hv), nan, device=v.device)
    attn = torch.full((plan.num_chunks, hv, 64, 64), nan, dtype=v.dtype, device=v.device)
    dt, prec = _dot_types(v.dtype)
    bk, bvf = max(16, 1 << (dk - 1).bit_length()), max(16, 1 << (dv - 1).bit_length())
    prep.launch_prep(q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, plan, bk, bvf, dt, prec, 4, form=form,
                     cols=cols)
    return w, u, cum, attn


@pytest.mark.parametrize("form", ["head", "ai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,cols", [((2, 4, 48, 40), 16), ((2, 4, 48, 40), 32), ((1, 3, 20, 36), 16)])
def test_forms_store_what_the_group_form_does(triton_device, shape, cols, dtype, form):
    """Dk 48 / Dv 40 (padded to 64) in column blocks of 16, the last one partly past the data, and of 32 (the
    second block partly past it); a group of 3 with Dk 20 and Dv 36 (a column block past Dk but not Dv). cum and the q.k decay matrix are the same arithmetic
    (bitwise); w and u the same solve in other orders (ai: the inverse first): within 1e-5 in fp32, or 2^-7 of the
    largest value in bf16 (two bf16 roundings: the ai form's inverse is rounded before its product)."""
    hk, hv, dk, dv = shape
    lens = [70, 33, 1]
    q, k, v, a, b, A_log, dt_bias, _ = rule_inputs(sum(lens), hk, hv, dk, dv, triton_device)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    plan = plan_chunks(segments(lens, [0, 1, 2], [True] * 3), triton_device)
    want = _prep("group", q, k, v, a, b, A_log, dt_bias, plan, None)
    got = _prep(form, q, k, v, a, b, A_log, dt_bias, plan, cols)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    for g, w_ in zip(got[:2], want[:2]):
        assert not g.isnan().any()
        bound = (2 ** -7 if dtype == torch.bfloat16 else 1e-5) * w_.float().abs().max()
        assert (g.float() - w_.float()).abs().max() <= bound


@pytest.mark.parametrize("form,cols", [("head", 16), ("head", 32), ("ai", 16), ("ai", 32)])
def test_forms_rule_matches_reference(triton_device, monkeypatch, form, cols):
    """The whole rule with the head and ai forms' prep against the torch oracle (varlen, carried and fresh slots),
    at SHAPES and at Dk 48 / Dv 40 (two or three column blocks, the last partly past the data)."""
    monkeypatch.setattr(prep, "PREP", form)
    monkeypatch.setattr(prep, "PREP_COLS", cols)
    for hk, hv, dk, dv in [*SHAPES, (1, 2, 48, 40)]:
        lens, slots, fresh = [65, 1, 130], [2, 0, 1], [False, True, False]
        q, k, v, a, b, A_log, dt_bias, pool = rule_inputs(sum(lens), hk, hv, dk, dv, triton_device)
        before = pool.clone()
        seqs = segments(lens, slots, fresh)
        o = chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan_chunks(seqs, triton_device))
        check_against_reference(o, pool, before, seqs, q, k, v, a, b, A_log, dt_bias)


def test_unknown_form_and_bad_columns_are_refused(triton_device):
    hk, hv, dk, dv = SHAPES[0]
    q, k, v, a, b, A_log, dt_bias, _ = rule_inputs(3, hk, hv, dk, dv, triton_device)
    plan = plan_chunks([(0, 3, 0, True)], triton_device)
    with pytest.raises(ValueError, match="KTRANS_GDN_PREP"):
        _prep("rows", q, k, v, a, b, A_log, dt_bias, plan, None)
    for cols in (8, 48):
        with pytest.raises(ValueError, match="PREP_COLS"):
            _prep("head", q, k, v, a, b, A_log, dt_bias, plan, cols)
