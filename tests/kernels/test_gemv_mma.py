"""The one-row GEMV's tensor-core body (GEMV["mma"], ktrans.kernels.triton.quant_gemv_mma.row_dot_mma: codes as bf16
1 + q / 2^b, dotted with x placed block-diagonally, the sub-block scales applied after the dot) against the float64
reference and against the lane-group body, for Q4_K and Q6_K, at awkward shapes: N = 200 (a partial last row tile),
K = 768 (three super-blocks: a split leaves a program one), split K or not, as a pair of matrices in one launch, and
under the pipelined loop. Interpreted without a GPU (marked `triton`): there the codes are made by arithmetic, on a
GPU by the inline PTX, whose bit operations test_codes_ptx_bits checks on the dev box by emulating them.

Tolerance: y is bf16 (x's dtype), each output the float64 product rounded once to bf16 up to fp32 summation error
(the dot's products are exact: bf16 codes times bf16 x): |y - ref| <= 2^-7 |ref| + 1e-5 max|ref|, as the row-owning
body's tests state it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf.quants")
from ktrans.kernels.torch.quant import quant_linear  # noqa: E402
from tests.kernels.test_gemv_rows import _close  # noqa: E402
from tests.kernels.test_quant_triton import _weight  # noqa: E402

TYPES = ("Q4_K", "Q6_K")


@pytest.fixture
def mma(monkeypatch):
    from ktrans.kernels.triton import quant

    monkeypatch.setitem(quant.GEMV, "mma", True)
    monkeypatch.setitem(quant.GEMV, "mma_bn", 64)
    return quant


@pytest.mark.triton
@pytest.mark.parametrize("qtype", TYPES)
def test_mma_gemv_matches_reference(qtype, mma, triton_device):
    """Every split of three super-blocks, within the bf16 output's rounding of the reference and of the lane-group
    body's output."""
    n, k = 200, 768
    w = _weight(qtype, n, k, triton_device, seed=5)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(7)) * 0.5).to(torch.bfloat16).to(triton_device)
    assert mma.gemv_mma(x, qtype)
    ref = quant_linear(x, w)
    for split in (None, 1, 2, 3):
        y = mma.qlinear(x, w, split=split)
        assert y.dtype == torch.bfloat16 and y.shape == (1, n)
        assert _close(y, ref), (qtype, split)
    mma.GEMV["mma"] = False
    assert _close(y, mma.qlinear(x, w, split=3))


@pytest.mark.triton
@pytest.mark.parametrize("qtype", TYPES)
def test_mma_pair_and_pipelined_loop(qtype, mma, triton_device):
    """Both matrices in one launch: each output bitwise the tensor-core GEMV's at the same split. The pipelined loop
    (GEMV["mma_pipe"]) moves the loads, not the arithmetic: the same bits at every split."""
    k = 3 * 256
    wa, wb = _weight(qtype, 96 + 5, k, triton_device, seed=1), _weight(qtype, 24, k, triton_device, seed=2)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16).to(triton_device)
    ya, yb = mma.qlinear_pair(x, wa, wb, split=2)
    assert torch.equal(ya, mma.qlinear(x, wa, split=2)) and torch.equal(yb, mma.qlinear(x, wb, split=2))
    assert _close(ya, quant_linear(x, wa)) and _close(yb, quant_linear(x, wb))
    plain = [mma.qlinear(x, wa, split=s) for s in (1, 3)]
    mma.GEMV["mma_pipe"] = 3
    for got, want in zip([mma.qlinear(x, wa, split=s) for s in (1, 3)], plain):
        assert torch.equal(got, want), qtype


@pytest.mark.triton
def test_mma_body_only_where_it_applies(mma, triton_device):
    """fp32 x and the other types take the lane-group body, still right."""
    k = 512
    x = torch.randn(1, k).to(torch.bfloat16).to(triton_device)
    assert mma.gemv_mma(x, "Q4_K") and mma.gemv_mma(x, "Q6_K")
    assert not mma.gemv_mma(x.float(), "Q4_K") and not mma.gemv_mma(x, "Q5_K") and not mma.gemv_mma(x, "Q8_0")
    w = _weight("Q5_K", 72, k, triton_device, seed=6)
    assert _close(mma.qlinear(x, w), quant_linear(x, w))
    mma.GEMV["mma"] = False
    assert not mma.gemv_mma(x, "Q4_K")


# -- the inline PTX's bit operations, emulated (no GPU): each output half is the bf16 1 + q / 2^b of its code --

_MASK = 0xFFFFFFFF


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result is bit (a_i b_i c_i) of the look-up table (a the high index bit)."""
    return sum(((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i
               for i in range(32))


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i..4i+2] of {b, a}."""
    bs = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(bs[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _run_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    env = dict(regs)

    def val(t):
        return env[t] if t in env else int(t, 0)
    for line in text.split("\n"):
        line = line.strip().rstrip(";")
        if not line or line.startswith(("{", "}", ".reg")):
            continue
        op, rest = line.split(None, 1)
        o = [t.strip() for t in rest.split(",")]
        if op == "shl.b32":
            env[o[0]] = (val(o[1]) << int(o[2])) & _MASK
        elif op == "shr.u32":
            env[o[0]] = val(o[1]) >> int(o[2])
        elif op == "prmt.b32":
            env[o[0]] = _prmt(val(o[1]), val(o[2]), int(o[3], 0))
        elif op == "lop3.b32":
            env[o[0]] = _lop3(val(o[1]), val(o[2]), val(o[3]), int(o[4], 0))
        else:
            raise AssertionError(f"no emulation of {op}")
    return env


def _bf16(bits: int) -> float:
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def test_codes_ptx_bits():
    """Output element 2j + h (register $j, half h, low half first) is 1 + q / 16 of nibble j + 4h (Q4_K), and
    1 + q6 / 64 of the word's sub-block j + 4h with its two high bits at bits 2(j + 4h) of the high word (Q6_K),
    for random words."""
    from ktrans.kernels.triton import quant_gemv_mma

    q4, q6 = quant_gemv_mma._Q4_ASM.value, quant_gemv_mma._Q6_ASM.value
    rng = np.random.default_rng(0)
    for _ in range(64):
        a, b = (int(v) for v in rng.integers(0, 2 ** 32, size=2))
        e4, e6 = _run_ptx(q4, {"$4": a}), _run_ptx(q6, {"$4": a, "$12": b})
        for e in range(8):
            s = e // 2 + 4 * (e % 2)
            half4 = (e4[f"${e // 2}"] >> (16 * (e % 2))) & 0xFFFF
            half6 = (e6[f"${e // 2}"] >> (16 * (e % 2))) & 0xFFFF
            assert _bf16(half4) == 1 + ((a >> (4 * s)) & 15) / 16, (hex(a), e)
            q6v = ((a >> (4 * s)) & 15) | (((b >> (2 * s)) & 3) << 4)
            assert _bf16(half6) == 1 + q6v / 64, (hex(a), hex(b), e)


@pytest.mark.triton
@pytest.mark.parametrize("t, down_type", [(1, "Q6_K"), (2, "Q4_K"), (2, "Q8_0")])
def test_mma_moe_lanes_path(t, down_type, triton_device, monkeypatch):
    """The MoE's few-token path with the tensor-core row_dot (LANES["mma"]: gate and up split over K, down on the
    bf16 h; a Q8_0 down keeps the lane-group form), a skipped slot: within the bf16 output's rounding of the float64
    reference (relative Frobenius 1e-2) and of the lane-group form's output."""
    from ktrans.kernels.torch.moe import moe_experts
    from ktrans.kernels.triton import moe_quant as mq
    from tests.kernels.test_moe_quant import _err, _layer, _routing

    monkeypatch.setitem(mq.LANES, "on", True)  # the few-token path, whatever KTRANS_MOE_LANES says
    monkeypatch.setitem(mq.LANES, "reg", 0)  # the lanes kernel's own form (bf16 x would take the register kernel)
    monkeypatch.setitem(mq.LANES, "mma", True)
    gate_up, down, (g, u, d) = _layer(triton_device, down_type, h=3 * 256)
    ids, weights = _routing(t, triton_device, seed=30 + t)
    ids[0, 1] = -1
    x = (torch.randn(t, 3 * 256, generator=torch.Generator().manual_seed(t)) * 0.05).to(torch.bfloat16)
    x = x.to(triton_device)
    ref = moe_experts(x.cpu().double(), ids.cpu(), weights.cpu().double(), g, u, d)
    y = mq.moe_quant(x, ids, weights, gate_up, down)
    mq.LANES["mma"] = False
    lanes = mq.moe_quant(x, ids, weights, gate_up, down)
    assert y.dtype == torch.bfloat16 and _err(y, ref) < 1e-2 and _err(y, lanes.double().cpu()) < 1e-2
