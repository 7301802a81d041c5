"""The register tensor-core GEMV (GEMV["reg"], ktrans.kernels.triton.quant_gemv_reg, Gluon; Q4_K and Q6_K, bf16 x).

Gluon does not run under Triton's interpreter, so the dev box and CI check it two ways, and the GPU a third:
- the index algebra, on the CPU: the A operand rebuilt from the code words by the PTX's own bit operations in the
  dot's column order, and the B operand by the kernel's own offset and mask formulas, multiply to every row's
  sub-block sums of (1 + q / 128) x; with the scales applied as the kernel applies them, the reference's output;
- the compile, without a GPU: for sm_80 and sm_90 every layout conversion is asserted trivial and the kernel uses
  no shared memory (the point of the body);
- on a GPU (marked `gpu`): against the float64 reference at awkward shapes (N = 200: a partial row tile; K = 768:
  three super-blocks; every split), as a pair in one launch bitwise the single GEMVs, and in the row tilings a
  sweep tries.

Tolerance: y is bf16, each output the float64 product rounded once to bf16 up to fp32 summation error (the dot's
products are exact): |y - ref| <= 2^-7 |ref| + 1e-5 max|ref|, as the other GEMV bodies' tests state it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf.quants")
from ktrans.kernels.torch.quant import quant_linear  # noqa: E402
from ktrans.kernels.triton import quant_gemv_reg  # noqa: E402
from tests.kernels.test_gemv_mma import _bf16, _run_ptx  # noqa: E402
from tests.kernels.test_gemv_rows import _close  # noqa: E402
from tests.kernels.test_quant_triton import _weight  # noqa: E402

gluon_only = pytest.mark.skipif(not quant_gemv_reg._GLUON, reason="this Triton has no Gluon")


def _a_operand(qtype: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The A operand [n, 256] (float64) of one super-block, from its code words lo [n, 32] and high-bit words hi
    [n, 16] (Q6_K) by the kernel's own PTX (emulated), in the dot's column order k = 64 j + 8 m + 2 a + e: register
    $j's half e of word 8 a + m (Q6_K: its high-bit word (8 a + m) % 16 shifted right by 16 (a // 2), as the kernel
    shifts it)."""
    from ktrans.kernels.triton.quant_gemv_mma import _q6_asm

    text = quant_gemv_reg._q4_asm() if qtype == "Q4_K" else _q6_asm()
    n = lo.shape[0]
    out = np.zeros((n, 32, 4, 2))
    for r in range(n):
        for w in range(32):
            regs = {"$4": int(lo[r, w])}
            if qtype == "Q6_K":
                regs["$12"] = int(hi[r, w % 16]) >> (16 * (w // 16))
            env = _run_ptx(text, regs)
            for j in range(4):
                for e in range(2):
                    out[r, w, j, e] = _bf16((env[f"${j}"] >> (16 * e)) & 0xFFFF)
    return out.reshape(n, 4, 8, 4, 2).transpose(0, 3, 2, 1, 4).reshape(n, 256)


def _columns(qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(sub-block, x offset) of each dot column, by the kernel's formulas."""
    kk = np.arange(256)
    aa = (kk // 2) % 4
    sub = kk // 64 + 4 * (kk % 2)
    word = aa * 8 + (kk // 8) % 8
    if qtype == "Q6_K":
        return sub + 8 * (aa // 2), (sub + 8 * (aa // 2)) * 16 + word % 16
    return sub, sub * 32 + word


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K"))
def test_operands_make_the_reference(qtype):
    """A (from the PTX's bits, in the kernel's column order) times B (x by the kernel's offsets and masks) gives each
    row's sub-block sums of the codes (1 + q / 128, Q6_K 1 + q6 / 64) times x, and the kernel's scale step then
    gives quant_linear's output (computed in fp32: within 1e-6 of the largest)."""
    n, k = 24, 512
    w = _weight(qtype, n, k, "cpu", seed=11)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(2)) * 0.5).to(torch.bfloat16)
    xd = x.double().numpy()[0]
    nc, span = (16, 16) if qtype == "Q6_K" else (8, 32)
    lo = w.lo.view(torch.int32).numpy().reshape(w.nsb, n, 32).view(np.uint32)
    hi = w.hi.view(torch.int32).numpy().reshape(w.nsb, n, 16).view(np.uint32) if qtype == "Q6_K" else None
    sc = w.sc.numpy().reshape(w.nsb, n, 16).astype(np.float64)
    dd = w.d.float().numpy().reshape(w.nsb, n, -1).astype(np.float64)
    sub, xoff = _columns(qtype)
    assert sorted(xoff) == list(range(256))  # the dot's columns are a permutation of the super-block's weights
    assert all((xoff[sub == c] // span == c).all() for c in range(nc))
    y = np.zeros(n)
    for sb in range(w.nsb):
        a = _a_operand(qtype, lo[sb], hi[sb] if hi is not None else None)
        b = np.where(sub[:, None] == np.arange(nc)[None, :], xd[sb * 256 + xoff][:, None], 0.0)
        p, xs = a @ b, (np.ones((1, 256)) @ b)[0]
        xsb = xd[sb * 256:(sb + 1) * 256].reshape(nc, span)
        np.testing.assert_allclose(xs, xsb.sum(1), rtol=1e-12, atol=1e-12)
        d = dd[sb, :, 0]
        if qtype == "Q6_K":
            y += ((sc[sb] * d[:, None]) * (64 * p - 96 * xs)).sum(1)
        else:
            # against the codes by arithmetic: weight i of sub-block S is nibble S of word i (quant_layout)
            q = (lo[sb][:, :, None] >> (4 * np.arange(8, dtype=np.uint32))[None, None, :]) & 15  # [n, 32 i, 8 S]
            np.testing.assert_allclose(p, np.einsum("nis,si->ns", 1 + q / 128.0, xsb), rtol=1e-12, atol=1e-12)
            y += ((sc[sb, :, :8] * 128 * d[:, None]) * (p - xs) - (sc[sb, :, 8:] * dd[sb, :, 1:2]) * xs).sum(1)
    ref = quant_linear(x.float(), w).double().numpy()[0]
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from ktrans.kernels.triton import quant_gemv_reg

MMA_PTX = "mma.sync.aligned.m16n8k16.row.col.f32.bf16"


def facts(k):
    ptx = k.asm["ptx"]
    return {"shared": k.metadata.shared, "mma": ptx.count(MMA_PTX), "v4": ptx.count("ld.global.v4.b32"),
            "cp": len(re.findall(r"cp\.async", ptx))}


fn = quant_gemv_reg.gemv_reg_kernel
aligned = ["x_ptr", "out_ptr", "part_ptr", "cnt_ptr", "lo_ptr", "hi_ptr", "d_ptr", "sc_ptr", "N"]
out = []
for qt, cc, warps, reps, fused, ch in json.loads(sys.argv[1]):
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "lo_ptr": "*i32",
           "hi_ptr": "*i32", "d_ptr": "*fp16", "sc_ptr": "*i8" if qt == 2 else "*u8", "N": "i32", "NSB": "i32",
           "SB_PER": "i32", "SPLIT": "i32", "TILES_A": "i32", "N_B": "i32", "b_lo": "i32", "b_hi": "i32",
           "b_d": "i32", "b_sc": "i32"}
    consts = {"QT": qt, "FUSED_SUM": bool(fused), "HAS_B": True, "PDL": cc >= 90,
              **quant_gemv_reg.tiling("test", 16 * warps * reps, warps), "PF": bool(fused), "CH": ch}
    src = GluonASTSource(fn, signature={**sig, **{k: "constexpr" for k in consts}},
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    out.append(facts(triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})))
mfn = quant_gemv_reg.moe_reg_kernel
maligned = ["x_ptr", "out_ptr", "part_ptr", "cnt_ptr", "ids_ptr", "rw_ptr", "lo_ptr", "hi_ptr", "d_ptr", "sc_ptr",
            "N", "N_ROWS", "s_lo", "s_hi", "s_d", "s_sc"]  # as a launch at the real shapes specialises them
for qt, gated in ((0, True), (0, False), (2, True), (2, False)):
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "ids_ptr": "*i32",
           "rw_ptr": "*fp32", "lo_ptr": "*i32", "hi_ptr": "*i32", "d_ptr": "*fp16",
           "sc_ptr": "*i8" if qt == 2 else "*u8", **{n: "i64" if n.startswith("s_") else "i32" for n in (
               "s_lo", "s_hi", "s_d", "s_sc", "P", "N", "N_ROWS", "NSB", "SB_PER", "X_DIV", "stride_x", "stride_o",
               "E_X", "x_lo", "x_hi", "x_d", "x_sc")}}
    consts = {"QT": qt, "GATED": gated, "SPLIT": 2, "HAS_X": True, "PDL": True,
              **quant_gemv_reg.tiling("test", 128, 4), "CH": 2 if gated else 1}
    src = GluonASTSource(mfn, signature={**sig, **{k: "constexpr" for k in consts}},
                         constexprs={(mfn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs={(mfn.arg_names.index(n),): [["tt.divisibility", 16]] for n in maligned})
    out.append(facts(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})))
print(json.dumps(out))
"""


@gluon_only
@pytest.mark.slow
def test_compiles_in_registers():
    """Compiled for sm_80 and sm_90 without a GPU, in a process without the interpreter (Gluon does not run under
    it): every convert_layout is asserted trivial, so a layout that moved data would not compile, and nothing goes
    through shared memory, the point of the body; with the fused split sum, only the count's atomic result (a few
    bytes, broadcast to the program's threads once). Every case is a pair launch (HAS_B) or has an extra expert
    (HAS_X), whose plane offsets are kernel arguments: the code words are still loaded 16 bytes at a time
    (planes.step16), and none through cp.async."""
    import json
    import os
    import subprocess
    import sys

    cases = [[qt, cc, warps, reps, fused, 1] for qt in (0, 2) for cc in (80, 90) for warps, reps in ((4, 1), (4, 4))
             for fused in (0, 1)] + [[0, 90, 8, 2, 1, 1], [0, 80, 4, 2, 1, 2], [2, 90, 4, 2, 0, 2]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    moe = [[0, 90, 4, 2, 1, 1]] * 4  # then the MoE kernel's four (Q4_K, Q6_K; gated, down)
    assert len(got) == len(cases) + len(moe)
    for i, (case, g) in enumerate(zip(cases + moe, got)):
        assert g["mma"] > 0 and g["cp"] == 0, (case, g)
        assert g["shared"] <= (16 if case[4] or i >= len(cases) else 0), (case, g)
        assert g["v4"] >= 4 * case[3], (case, g)  # two 16-byte loads a row, two rows a thread a row tile


def test_layouts_reject_what_row_sums_cannot_tile():
    if not quant_gemv_reg._GLUON:
        pytest.skip("this Triton has no Gluon")
    for warps, reps in ((3, 1), (4, 3), (4, 16)):
        with pytest.raises(ValueError, match="powers of two"):
            quant_gemv_reg.layouts(warps, reps)


def test_tiling_names_the_setting_whose_rows_do_not_tile():
    if not quant_gemv_reg._GLUON:
        pytest.skip("this Triton has no Gluon")
    assert quant_gemv_reg.tiling("F", 128, 4)["R"] == 2
    for bn, warps in ((96, 4), (40, 2)):
        with pytest.raises(ValueError, match="KTRANS_X: .* not a multiple of 16"):
            quant_gemv_reg.tiling("KTRANS_X", bn, warps)


def test_plane_offsets_are_16_byte_steps():
    """A second matrix's planes are reached by element offsets that the kernels round to 16-byte steps
    (planes.step16), so an offset that is not one is refused by name rather than read wrong."""
    from ktrans.kernels.triton.quant import plane_offsets

    base = torch.zeros(64, dtype=torch.int32)
    assert plane_offsets([base], [base[8:]]) == [8]
    with pytest.raises(ValueError, match="not a 16-byte step"):
        plane_offsets([base], [base[2:]])


@pytest.fixture
def reg():
    """quant with GEMV["reg"] on; every GEMV setting a test changes is restored after it."""
    from ktrans.kernels.triton import quant

    saved = dict(quant.GEMV)
    quant.GEMV["reg"] = 1
    yield quant
    quant.GEMV.clear()
    quant.GEMV.update(saved)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K"))
@pytest.mark.parametrize("bn,warps,on,chains", ((256, 4, 1, 1), (64, 4, 1, 1), (128, 8, 1, 1), (64, 2, 1, 1),
                                               (256, 4, 2, 1), (64, 4, 2, 1), (128, 4, 1, 2), (256, 4, 1, 2)))
def test_reg_gemv_matches_reference(qtype, bn, warps, on, chains, reg):
    """Every split of three super-blocks, within the bf16 output's rounding of the reference, with the code words
    loaded ahead (on = 2) or not, each dot as one mma chain or two: splits of 1, 2 and 3 super-blocks a program."""
    dev = torch.device("cuda")
    reg.GEMV.update(reg=on, reg_bn=bn, reg_bn6=bn, reg_warps=warps, reg_chains=chains)
    n, k = 200, 768
    w = _weight(qtype, n, k, dev, seed=5)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(7)) * 0.5).to(torch.bfloat16).to(dev)
    assert reg.gemv_reg(x, qtype)
    ref = quant_linear(x, w)
    for split in (None, 1, 2, 3):
        y = reg.qlinear(x, w, split=split)
        assert y.dtype == torch.bfloat16 and y.shape == (1, n)
        assert _close(y, ref), (bn, warps, split)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K"))
def test_reg_pair_bitwise_and_big_shape(qtype, reg):
    """Both matrices in one launch: each output bitwise the single GEMV's at the same split; a layer's largest
    projection shape ([12288, 2048]) within tolerance, by the default split."""
    dev = torch.device("cuda")
    k = 3 * 256
    wa, wb = _weight(qtype, 96 + 5, k, dev, seed=1), _weight(qtype, 24, k, dev, seed=2)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16).to(dev)
    for split in (1, 2):
        ya, yb = reg.qlinear_pair(x, wa, wb, split=split)
        assert torch.equal(ya, reg.qlinear(x, wa, split=split)) and torch.equal(yb, reg.qlinear(x, wb, split=split))
        assert _close(ya, quant_linear(x, wa)) and _close(yb, quant_linear(x, wb))
    w = _weight(qtype, 12288, 2048, dev, seed=4)
    x = (torch.randn(1, 2048, generator=torch.Generator().manual_seed(5)) * 0.5).to(torch.bfloat16).to(dev)
    assert _close(reg.qlinear(x, w), quant_linear(x, w))


@pytest.mark.gpu
def test_reg_only_where_it_applies(reg):
    """fp32 x, the other types and the reg switch off take the other bodies, still right."""
    dev = torch.device("cuda")
    x = torch.randn(1, 512).to(torch.bfloat16).to(dev)
    assert reg.gemv_reg(x, "Q4_K")
    assert not reg.gemv_reg(x.float(), "Q4_K") and not reg.gemv_reg(x, "Q5_K") and not reg.gemv_reg(x.cpu(), "Q4_K")
    w = _weight("Q5_K", 72, 512, dev, seed=6)
    assert _close(reg.qlinear(x, w), quant_linear(x, w))
    reg.GEMV["reg"] = 0
    assert not reg.gemv_reg(x, "Q4_K")


@pytest.mark.gpu
@pytest.mark.parametrize("t, down_type", [(1, "Q6_K"), (2, "Q4_K"), (3, "Q8_0")])
def test_reg_moe_lanes_path(t, down_type, monkeypatch):
    """The MoE's few-token path through the register body (LANES["reg"]: gate and up sharing x's operand, split over
    K; down on the bf16 h; a Q8_0 down keeps the lanes kernel), a skipped slot: within the bf16 output's rounding of
    the float64 reference (relative Frobenius 1e-2), and near the lanes kernel's output."""
    from ktrans.kernels.torch.moe import moe_experts
    from ktrans.kernels.triton import moe_quant as mq
    from tests.kernels.test_moe_quant import _err, _layer, _routing

    dev = torch.device("cuda")
    monkeypatch.setitem(mq.LANES, "on", True)
    monkeypatch.setitem(mq.LANES, "reg", 1)
    gate_up, down, (g, u, d) = _layer(dev, down_type, h=3 * 256)
    ids, weights = _routing(t, dev, seed=30 + t)
    ids[0, 1] = -1
    x = (torch.randn(t, 3 * 256, generator=torch.Generator().manual_seed(t)) * 0.05).to(torch.bfloat16).to(dev)
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    for split, chains in ((None, 1), (1, 1), (3, 1), (None, 2), (3, 2)):
        monkeypatch.setitem(mq.LANES, "split", split)
        monkeypatch.setitem(mq.LANES, "reg_chains", chains)
        y = mq.moe_quant(x, ids, weights, gate_up, down)
        assert _err(y, ref) < 1e-2, (t, down_type, split, chains)
    mq.LANES["reg"] = 0
    assert _err(y, mq.moe_quant(x, ids, weights, gate_up, down).double().cpu()) < 1e-2


@pytest.mark.gpu
def test_reg_moe_with_an_extra_expert(monkeypatch):
    """The shared expert as one more pair a token (id E, its planes reached by offset from the routed stack's, HAS_X)
    through the register kernel, with bf16 x: routed + weight * shared (float64 references) within the bf16 output's
    1e-2, with a skipped slot."""
    from ktrans.kernels.torch.moe import moe_experts
    from ktrans.kernels.torch.quant import dequantize_packed
    from ktrans.kernels.triton import moe_quant as mq
    from ktrans.kernels.triton.quant_layout import as_stack, concat_rows
    from tests.kernels.test_moe_quant import E, H, I, _err, _layer, _routing, _stack

    dev = torch.device("cuda")
    monkeypatch.setitem(mq.LANES, "on", True)
    monkeypatch.setitem(mq.LANES, "reg", 1)
    t = 3
    gate_up, down, (g, u, d) = _layer(dev, "Q6_K")
    sg, su, sd = _stack("Q4_K", I, H, 300, dev), _stack("Q4_K", I, H, 400, dev), _stack("Q6_K", H, I, 500, dev)
    extra = (as_stack(concat_rows([sg, su]).expert(2)), as_stack(sd.expert(2)))
    ref_sh = [dequantize_packed(w.to("cpu")).double()[2:3] for w in (sg, su, sd)]
    ids, weights = _routing(t, dev, seed=12)
    ids[0, 1] = -1
    gate_w = torch.rand(t, 1, device=dev)
    x = (torch.randn(t, H, generator=torch.Generator().manual_seed(4)) * 0.05).to(torch.bfloat16).to(dev)
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d) + moe_experts(
        x.cpu().double(), torch.zeros(t, 1, dtype=torch.int64), gate_w.cpu().double(), *ref_sh)
    ids_x = torch.cat([ids, torch.full((t, 1), E, device=dev, dtype=ids.dtype)], 1)
    y = mq.moe_quant(x, ids_x, torch.cat([weights, gate_w], 1), gate_up, down, extra=extra)
    assert y.shape == (t, H) and _err(y, ref) < 1e-2
