"""Q4_K/Q5_K prefill tiles (csrc/cpu/kernels_avx512_tile.cpp): 16 weight rows at a time with AVX-512 VNNI, or AMX.

The tile kernels must agree with the row kernels (same integer dot products, a different float summation order:
relative difference ~1e-6), with the torch reference on dequantized weights, and with each other bitwise: the AMX
path and its C++ emulation (run everywhere) use the same float operations in the same order as the VNNI tiles.
Which kernels run is each object's CPUMoEConfig (tile_min_tokens, amx).
"""
import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ktrans import _cpu  # noqa: E402
from ktrans.kernels import cpu  # noqa: E402
from ktrans.kernels.torch.moe import moe_experts  # noqa: E402
from ktrans.weights import quants as Q  # noqa: E402

STATUS = _cpu.path_status()
needs_avx512 = pytest.mark.skipif(STATUS["avx512"] is not None, reason="the AVX-512 / AMX tiles")
HW_AMX = bool(_cpu.isa_info().get("amx_int8", False))


def tiles(min_tokens: int, amx: int) -> cpu.CPUMoEConfig:
    """The defaults with the tiles from min_tokens activation rows per call on (10**9: never), in AMX mode amx."""
    return cpu.CPUMoEConfig(tile_min_tokens=min_tokens, amx=amx)


def tuned(obj, min_tokens: int, amx: int):
    """obj (a CPULinear or CPUMoE) with its config set to tiles(min_tokens, amx)."""
    obj.set_config(tiles(min_tokens, amx))
    return obj


def quantized(qtype, shape, seed):
    x = (np.random.default_rng(seed).standard_normal(shape) * 0.1).astype(np.float32)
    raw = Q.quantize(x, qtype)
    deq = gguf_quants.dequantize(raw, GGMLQuantizationType[qtype])
    return torch.from_numpy(raw), torch.from_numpy(deq).double()


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


MODES = [0, 2] + ([1] if HW_AMX else [])  # VNNI, emulated AMX, real AMX where the CPU has it


@needs_avx512
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
# AMX (and its emulation) runs for blocks of >= 128 rows and >= 16 activation rows; smaller ones take the VNNI tiles
@pytest.mark.parametrize("n_out,n_in,tokens", [(37, 512, 9), (64, 2048, 33), (16, 256, 1), (5, 768, 100),
                                               (1024, 512, 33), (1040, 256, 16), (600, 768, 21),
                                               (1224, 256, 17)])  # on 2 threads: blocks of 256, then 200 rows
def test_linear_tiles_match_rows_and_reference(qtype, n_out, n_in, tokens, pool):
    assert pool.size == 2  # the block sizes above (and so which blocks reach AMX) assume the 2-thread fixture pool
    raw, deq = quantized(qtype, (n_out, n_in), seed=n_out + tokens)
    lin = cpu.CPULinear(raw, n_out, n_in, qtype=qtype, pool=pool, isa="avx512")
    x = torch.randn(tokens, n_in, generator=torch.Generator().manual_seed(tokens))
    ref = x.double() @ deq.T
    rows = tuned(lin, 10**9, 0)(x)
    outs = {}
    for mode in MODES:
        outs[mode] = tuned(lin, 1, mode)(x)
        assert rel(outs[mode], ref) < 0.02, f"mode {mode}"
        assert rel(outs[mode], rows) < 1e-5, f"mode {mode} vs the row kernel"
    for mode in MODES[1:]:
        assert torch.equal(outs[mode], outs[0]), f"mode {mode} differs from the VNNI tiles"


@needs_avx512
@pytest.mark.parametrize("qtypes", [("Q4_K", "Q4_K", "Q4_K"), ("Q5_K", "Q4_K", "Q6_K")])
def test_moe_prefill_tiles(qtypes, pool):
    """A prefill-sized batch: 8 experts get 20-60 tokens each, so gate/up/down run on the tiles (Q6_K on rows)."""
    E, H, I = 8, 512, 256
    mats = [quantized(t, (E,) + s, seed=i) for i, (t, s) in enumerate(zip(qtypes, [(I, H), (I, H), (H, I)]))]
    moe = cpu.CPUMoE(*(m[0] for m in mats), n_experts=E, hidden=H, intermediate=I, types=qtypes, pool=pool,
                     isa="avx512")
    gen = torch.Generator().manual_seed(0)
    T, k = 150, 2
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    ref = moe_experts(x.double(), ids, w.double(), *(m[1] for m in mats))
    rows = tuned(moe, 10**9, 0)(x, ids, w)
    outs = {}
    for mode in MODES:
        outs[mode] = tuned(moe, 6, mode)(x, ids, w)
        assert rel(outs[mode], ref) < 0.04
        # h = silu(gate) * up is quantized to int8 for down: a 1e-7 difference in gate/up can move h across a
        # rounding step there, so the row and tile results differ by more than at the linear level
        assert rel(outs[mode], rows) < 2e-3
        assert torch.equal(outs[mode], outs[0])
    for mode in MODES:  # and the result does not depend on the thread count (blocks move between AMX and VNNI)
        for n in (1, 3):
            moe_n = cpu.CPUMoE(*(m[0] for m in mats), n_experts=E, hidden=H, intermediate=I, types=qtypes,
                               pool=cpu.make_pool(n, pin=False), isa="avx512", config=tiles(6, mode))
            assert torch.equal(moe_n(x, ids, w), outs[0]), f"mode {mode}, {n} threads"


@pytest.mark.skipif(STATUS["avx2"] is not None, reason="the AVX2 tiles")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("n_out,n_in,tokens", [(37, 512, 9), (64, 2048, 33), (13, 768, 100)])
def test_avx2_tiles_match_rows_reference_and_avx512_tiles(qtype, n_out, n_in, tokens, pool):
    """8-row AVX2 tiles (from 8 tokens on): close to the AVX2 row kernels, and bitwise equal to the AVX-512 tiles
    (the same float operations in the same order)."""
    raw, deq = quantized(qtype, (n_out, n_in), seed=n_out + tokens)
    x = torch.randn(tokens, n_in, generator=torch.Generator().manual_seed(tokens))
    lin2 = cpu.CPULinear(raw, n_out, n_in, qtype=qtype, pool=pool, isa="avx2", config=tiles(10**9, 0))
    rows = lin2(x)
    tiled = tuned(lin2, 1, 0)(x)
    other = None
    if STATUS["avx512"] is None:
        other = cpu.CPULinear(raw, n_out, n_in, qtype=qtype, pool=pool, isa="avx512", config=tiles(1, 0))(x)
    assert rel(tiled, x.double() @ deq.T) < 0.02
    assert 0 < rel(tiled, rows) < 1e-5  # > 0: the tiles really ran (another summation order)
    if other is not None:
        assert torch.equal(tiled, other)


def test_tile_settings_are_per_object(pool):
    raw, _ = quantized("Q4_K", (16, 256), seed=1)
    a = cpu.CPULinear(raw, 16, 256, qtype="Q4_K", pool=pool, config=tiles(7, 2))
    b = cpu.CPULinear(raw, 16, 256, qtype="Q4_K", pool=pool, config=tiles(1, 0))
    assert (a.config.tile_min_tokens, a.config.amx, b.config.tile_min_tokens, b.config.amx) == (7, 2, 1, 0)
    assert cpu.CPUMoEConfig.from_native(a._lin.config) == a.config  # the C++ side holds the same
    tuned(a, 9, 1)
    assert a.config == tiles(9, 1) and b.config == tiles(1, 0)
    assert cpu.CPUMoEConfig.from_native(a._lin.config) == a.config
    # what runs: 2 and 0 as asked, 1 only where the CPU has AMX-INT8
    assert [tiles(1, m).amx_mode for m in (0, 1, 2)] == [0, 1 if HW_AMX else 0, 2]
