"""The Q4_K and Q6_K linear at 2-16 rows on tensor cores with the weights in registers
(ktrans.kernels.triton.quant_rows_reg, Gluon; opt-in, `KTRANS_GEMV_ROWS_REG`).

As for the one-row register body (tests/kernels/test_gemv_reg.py), Gluon does not run under the interpreter:
- the index algebra, on the CPU: the B operand from the code words by the PTX's own bit operations (the one-row
  body's A operand, transposed), the A operand (each token twice, one copy a column parity) by the kernel's own
  offset and mask formulas, the chunk dots, the sums of x and the scale step as the kernel takes them from the scale
  plane's words, give quant_linear's output;
- the compile, without a GPU: sm_80 and sm_90, every layout conversion asserted trivial, no shared memory beyond
  the split sum's count, and the expected mma and 16-byte load counts;
- on a GPU (marked `gpu`): against the float64 reference at awkward shapes (N = 203, a partial row tile and 8-row
  tile; K = 768, three super-blocks; 2 to 16 rows, a partial token group; every split; strided rows), the same bits
  run to run, and the inputs it does not take left to the other paths.

Tolerance: y is bf16, each output the float64 product rounded once to bf16 up to fp32 summation error (the dots'
products are exact): |y - ref| <= 2^-7 |ref| + 1e-5 max|ref|, as the other GEMV bodies' tests state it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("gguf.quants")
from ktrans.kernels.torch.quant import quant_linear  # noqa: E402
from ktrans.kernels.triton import quant_gemv_reg, quant_rows_reg  # noqa: E402
from tests.kernels.test_gemv_reg import _a_operand, _columns  # noqa: E402
from tests.kernels.test_gemv_rows import _close  # noqa: E402
from tests.kernels.test_quant_triton import _weight  # noqa: E402

gluon_only = pytest.mark.skipif(not quant_gemv_reg._GLUON, reason="this Triton has no Gluon")


def test_operands_make_the_reference():
    """B (the PTX's bits, transposed) and A (tokens t0.. at rows 8 e + t, the columns of parity e, by the column
    formulas and by _x_operand's joins and permutes of x loaded by sub-block): each chunk j's dots are the tokens'
    sums over sub-blocks j (e = 0) and j + 4 (e = 1), and the kernel's scale step on the scale plane's int32 words
    gives quant_linear's output (fp32: within 1e-6 of the largest)."""
    n, k, m = 24, 512, 5
    w = _weight("Q4_K", n, k, "cpu", seed=12)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(3)) * 0.5).to(torch.bfloat16)
    xd = x.double().numpy()
    lo = w.lo.view(torch.int32).numpy().reshape(w.nsb, n, 32).view(np.uint32)
    sc32 = w.sc.view(torch.int32).numpy().reshape(w.nsb, n, 4)
    dd = w.d.float().numpy().reshape(w.nsb, n, 2).astype(np.float64)
    # the kernel's A formulas: row r = 8 e + t, column k: x of token t at sub-block * 32 + word where k % 2 == e
    r, kk = np.arange(16)[:, None], np.arange(256)[None, :]
    sub = kk // 64 + 4 * (kk % 2)
    word = ((kk // 2) % 4) * 8 + (kk // 8) % 8
    assert (_columns("Q4_K")[1] == (sub * 32 + word)[0]).all()  # the one-row body's column order
    tok, live = r % 8, (kk % 2) == (r // 8)
    y = np.zeros((16, n))
    for sb in range(w.nsb):
        b = _a_operand("Q4_K", lo[sb], None).T  # [256, n]
        a = np.where(live & (tok < m), xd[np.minimum(tok, m - 1), sb * 256 + sub * 32 + word], 0.0)
        d, dmin = dd[sb, :, 0] * 128.0, dd[sb, :, 1]
        for j in range(4):
            p = a[:, 64 * j:64 * j + 64] @ b[64 * j:64 * j + 64]
            xs = a[:, 64 * j:64 * j + 64] @ np.ones((64, n))
            for e in range(2):
                c = j + 4 * e  # the sub-block these rows summed
                want = (xd[:, sb * 256 + c * 32:sb * 256 + c * 32 + 32]).sum(1)
                np.testing.assert_allclose(xs[8 * e:8 * e + m, 0], want, rtol=1e-12, atol=1e-12)
            byte = lambda wd: ((wd >> (8 * j)) & 0xFF).astype(np.float64)  # noqa: E731
            s = np.where(r >= 8, byte(sc32[sb, :, 1]) * d, byte(sc32[sb, :, 0]) * d)
            mn = np.where(r >= 8, byte(sc32[sb, :, 3]) * dmin, byte(sc32[sb, :, 2]) * dmin)
            y += s * (p - xs) - mn * xs
    # the kernel builds that A from x loaded as [token, sub-block c, a, m] (_x_operand): the same matrix
    xv = np.stack([xd[min(t, m - 1), :256].reshape(8, 4, 8) * (t < m) for t in range(8)])  # super-block 0
    x6 = xv.reshape(8, 2, 4, 4, 8).transpose(0, 2, 3, 4, 1)  # [t, j, a, m, e]
    x_e0, x_e1 = x6[..., 0], x6[..., 1]
    z = np.zeros_like(x_e0)
    built = np.stack([np.stack([x_e0, z], -1), np.stack([z, x_e1], -1)], -1)  # gl.join: a new last axis
    built = built.transpose(5, 0, 1, 3, 2, 4).reshape(16, 256)
    want = np.where(live & (tok < m), xd[np.minimum(tok, m - 1), sub * 32 + word], 0.0)
    np.testing.assert_array_equal(built, want)
    got = y[:8] + y[8:]
    ref = quant_linear(x.float(), w).double().numpy()
    np.testing.assert_allclose(got[:m], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert not got[m:].any()  # the token group's pad rows stay zero


def test_q6_k_operands_make_the_reference():
    """Q6_K: its word groups a = 2, 3 hold sub-blocks 8.., so A's rows are 8 e + 4 h + u (four tokens), token u's x
    where the column's parity is e and a // 2 is h (by the kernel's formulas and by _x_operand6's joins of x loaded
    as [u, h, c, a, m]); each chunk j's dots are sums over sub-blocks j + 4 e + 8 h, and the signed scale bytes of the
    plane's words give, with d sc (64 P - 96 X), quant_linear's output."""
    n, k, m = 24, 512, 3
    w = _weight("Q6_K", n, k, "cpu", seed=13)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * 0.5).to(torch.bfloat16)
    xd = x.double().numpy()
    lo = w.lo.view(torch.int32).numpy().reshape(w.nsb, n, 32).view(np.uint32)
    hi = w.hi.view(torch.int32).numpy().reshape(w.nsb, n, 16).view(np.uint32)
    sc32 = w.sc.view(torch.int32).numpy().reshape(w.nsb, n, 4)
    dd = w.d.float().numpy().reshape(w.nsb, n).astype(np.float64)
    r, kk = np.arange(16)[:, None], np.arange(256)[None, :]
    aa = (kk // 2) % 4
    sub = kk // 64 + 4 * (kk % 2) + 8 * (aa // 2)
    word = (aa * 8 + (kk // 8) % 8) % 16
    assert (_columns("Q6_K")[1] == (sub * 16 + word)[0]).all()
    u, e, h = r % 4, r // 8, (r // 4) % 2
    live = ((kk % 2) == e) & ((aa // 2) == h) & (u < m)
    y = np.zeros((16, n))
    for sb in range(w.nsb):
        b = _a_operand("Q6_K", lo[sb], hi[sb]).T
        a = np.where(live, xd[np.minimum(u, m - 1), sb * 256 + sub * 16 + word], 0.0)
        if sb == 0:  # _x_operand6 builds the same A from x loaded as [u, h, c, a, m]
            uu, hh, cc, a4, mm = np.meshgrid(np.arange(4), np.arange(2), np.arange(8), np.arange(4), np.arange(8),
                                             indexing="ij")
            xv = np.where((uu < m) & (hh == a4 // 2),
                          xd[np.minimum(uu, m - 1), (cc + 8 * (a4 // 2)) * 16 + 8 * (a4 % 2) + mm], 0.0)
            x6 = xv.reshape(4, 2, 2, 4, 4, 8).transpose(0, 1, 3, 4, 5, 2)  # [u, h, j, a, m, e]
            z = np.zeros_like(x6[..., 0])
            built = np.stack([np.stack([x6[..., 0], z], -1), np.stack([z, x6[..., 1]], -1)], -1)
            np.testing.assert_array_equal(built.transpose(6, 1, 0, 2, 4, 3, 5).reshape(16, 256), a)
        for j in range(4):
            p = a[:, 64 * j:64 * j + 64] @ b[64 * j:64 * j + 64]
            xs = a[:, 64 * j:64 * j + 64] @ np.ones((64, n))
            word_i = (e + 2 * h)[:, 0]  # the scale word of each row's sub-block j + 4 e + 8 h
            sw = sc32[sb][:, word_i].T  # [16, n]
            s8 = ((sw.astype(np.int64) << (24 - 8 * j)) & 0xFFFFFFFF).astype(np.uint32).view(np.int32) >> 24
            y += (s8 * dd[sb][None, :]) * (64 * p - 96 * xs)
    got = y.reshape(2, 2, 4, n).sum((0, 1))
    ref = quant_linear(x.float(), w).double().numpy()
    np.testing.assert_allclose(got[:m], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert not got[m:].any()


_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from ktrans.kernels.triton import quant_rows_reg as qr

fn = qr.rows_reg_kernel
aligned = ["x_ptr", "out_ptr", "part_ptr", "cnt_ptr", "lo_ptr", "hi_ptr", "d_ptr", "sc_ptr", "N", "stride_x"]
out = []
for cc, warps, tiles, qtype in json.loads(sys.argv[1]):
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "lo_ptr": "*i32",
           "hi_ptr": "*i32", "d_ptr": "*fp16", "sc_ptr": "*i8" if qtype == "Q6_K" else "*u8", "M": "i32", "N": "i32",
           "NSB": "i32", "SB_PER": "i32", "SPLIT": "i32", "stride_x": "i32"}
    consts = {"PDL": cc >= 90, **qr.tiling("test", warps, tiles, qtype)}
    src = GluonASTSource(fn, signature={**sig, **{k: "constexpr" for k in consts}},
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})
    ptx = k.asm["ptx"]
    cubin = tempfile.mktemp(suffix=".cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    use = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"),
                          "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    stack = re.search(r"STACK:(\d+)", use)
    out.append({"shared": k.metadata.shared, "mma": ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16"),
                "v4": ptx.count("ld.global.v4.b32"), "stack": int(stack.group(1)) if stack else None})
print(json.dumps(out))
"""


@gluon_only
@pytest.mark.slow
def test_compiles_in_registers():
    """Compiled for sm_80 and sm_90 without a GPU, in a process without the interpreter: every convert_layout is
    asserted trivial, so a layout that moved data would not compile; nothing goes through shared memory but the split
    sum's count; a super-block's dots are 4 chunks x 4 K tiles x (the warp's 8-row tiles for the sums, and one for
    the sums of x, which are the same in every column), each tile's code words two 16-byte loads and x's eight; the
    default tiling spills no registers."""
    cases = [(90, 4, 2, "Q4_K"), (80, 4, 2, "Q4_K"), (90, 2, 1, "Q4_K"), (90, 4, 2, "Q6_K"), (80, 4, 2, "Q6_K")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for (cc, warps, tiles, qtype), got in zip(cases, json.loads(done.stdout.strip().splitlines()[-1])):
        # Q6_K: the high-bit words' two more 16-byte loads a tile
        assert got["mma"] == 16 * tiles + 16 and got["v4"] == (4 if qtype == "Q6_K" else 2) * tiles + 8, (cc, qtype, got)
        assert got["shared"] <= 16, (cc, got)  # the split sum's count, broadcast once
        assert got["stack"] in (0, None), (cc, warps, tiles, got)  # no register spills (None: no cuobjdump here)


def test_tilings_are_checked():
    if not quant_gemv_reg._GLUON:
        pytest.skip("this Triton has no Gluon")
    with pytest.raises(ValueError, match="KTRANS_GEMV_ROWS_REG.*powers of two"):
        quant_rows_reg.tiling("KTRANS_GEMV_ROWS_REG", 3, 4)
    with pytest.raises(ValueError, match="at most 8"):
        quant_rows_reg.tiling("KTRANS_GEMV_ROWS_REG", 4, 16)


def test_applies_only_where_it_can():
    x = torch.zeros(4, 512, dtype=torch.bfloat16)
    w = _weight("Q4_K", 16, 512, "cpu")
    was = dict(quant_rows_reg.ROWS_REG)
    try:
        quant_rows_reg.ROWS_REG["on"] = 1
        assert not quant_rows_reg.applies(x, w)  # a CPU tensor
        quant_rows_reg.ROWS_REG["on"] = 0
        assert not quant_rows_reg.applies(x, w)
    finally:
        quant_rows_reg.ROWS_REG.update(was)


@pytest.fixture
def rows_reg():
    was = dict(quant_rows_reg.ROWS_REG)
    quant_rows_reg.ROWS_REG["on"] = 1
    yield
    quant_rows_reg.ROWS_REG.update(was)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [2, 5, 8, 13, 16])
@pytest.mark.parametrize("warps,tiles", [(4, 2), (4, 4), (4, 1), (2, 2)])
def test_rows_reg_matches_reference(qtype, m, warps, tiles, rows_reg):
    """2 to 16 rows (a partial token group at 5 and 13; Q6_K's groups are of four) at N = 203 (a partial row tile,
    and a partial 8-row tile in it) and K = 768 (three super-blocks), every split: within the stated tolerance of the
    float64 reference, and the same bits run to run (the split sums in a fixed order); x's rows strided as a slice
    of a wider buffer."""
    from ktrans.kernels.triton import quant

    quant_rows_reg.ROWS_REG.update(warps=warps, tiles=tiles)
    dev = torch.device("cuda")
    w = _weight(qtype, 203, 768, dev, seed=21)
    buf = (torch.randn(m, 768 + 64, device=dev) * 0.5).to(torch.bfloat16)
    for x in (buf[:, :768].contiguous(), buf[:, 64:]):
        assert quant_rows_reg.applies(x, w)
        ref = quant_linear(x.float(), w).double()
        for split in (None, 1, 2, 3):
            y = quant.qlinear(x, w, split=split)
            assert y.shape == (m, 203) and y.dtype == torch.bfloat16
            assert _close(y, ref), (qtype, m, warps, tiles, split, x.stride())
            assert torch.equal(y, quant.qlinear(x, w, split=split))
    assert not quant.counters(dev).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_reg_leaves_the_rest_to_the_other_paths(rows_reg):
    """One row, 17 rows, fp16 or fp32 x and a Q8_0 or Q5_K matrix do not take this body, and still give the
    reference's products (by the one-row GEMV or the tile path)."""
    from ktrans.kernels.triton import quant

    dev = torch.device("cuda")
    q4, q8, q5 = (_weight(t, 96, 512, dev, seed=3) for t in ("Q4_K", "Q8_0", "Q5_K"))
    for m, dtype, w in ((1, torch.bfloat16, q4), (17, torch.bfloat16, q4), (4, torch.float16, q4),
                        (4, torch.float32, q4), (4, torch.bfloat16, q8), (4, torch.bfloat16, q5)):
        x = (torch.randn(m, 512, device=dev) * 0.5).to(dtype)
        assert not quant_rows_reg.applies(x, w), (m, dtype, w.qtype)
        assert _close(quant.qlinear(x, w), quant_linear(x.float(), w).double()), (m, dtype, w.qtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_reg_in_a_cuda_graph(rows_reg):
    """Replayed from a CUDA graph on new activations as an eager call computes them, counters back at zero."""
    from ktrans.kernels.triton import quant

    dev = torch.device("cuda")
    w = _weight("Q4_K", 2048, 2048, dev)
    x = torch.randn(16, 2048, device=dev).to(torch.bfloat16)
    quant.qlinear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = quant.qlinear(x, w)
    for _ in range(2):
        x.copy_(torch.randn(16, 2048, device=dev).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, quant.qlinear(x, w))
        assert _close(y, quant_linear(x.float(), w).double())
    assert not quant.counters(dev).any()
