"""Q4_K and Q5_K repacked 16 rows at a time at load (Q4_K_X16, Q5_K_X16, csrc/cpu/quant.h) and the AVX-512
kernels that read them.

The layout is checked byte by byte against its definition (written out here in numpy), the kernels against the
torch reference on dequantized weights and bitwise against the VNNI tiles on the original rows (the fused kernels do
the tiles' arithmetic: exact integer dots, the same float operations in the same order; for Q4_K the high nibbles'
factor 16 is folded exactly into their scales).
"""
import numpy as np
import pytest
import torch

from ktrans import _cpu
from ktrans.kernels import cpu
from ktrans.kernels.torch.moe import moe_experts
from ktrans.weights import quants as Q

X16 = _cpu.reads_x16("auto") if _cpu.path_status()["avx512"] is None else False
needs_x16 = pytest.mark.skipif(not X16, reason="the AVX-512 kernels read Q4_K_X16 and Q5_K_X16")
FORMATS = ["Q4_K", "Q5_K"]
X16_NAME = {"Q4_K": "Q4_K_X16", "Q5_K": "Q5_K_X16"}
BLOCK = {"Q4_K": 144, "Q5_K": 176}


def quantized(qtype, shape, seed) -> tuple[torch.Tensor, np.ndarray]:
    x = (np.random.default_rng(seed).standard_normal(shape) * 0.1).astype(np.float32)
    raw = Q.quantize(x, qtype)
    return torch.from_numpy(np.ascontiguousarray(raw)), Q.dequantize(raw, qtype, shape).astype(np.float64)


def layout_reference(qtype: str, raw: np.ndarray, rows: int, k: int) -> np.ndarray:
    """The X16 bytes of rows x k values, from the layout's definition: per 16-row group and superblock, the 16
    blocks' heads (4 dwords each), then Q5_K's fifth bits (8 dwords), then the nibbles (32 dwords), dword w of row
    r at dword 16 w + r of its part."""
    nb, bb = k // 256, BLOCK[qtype]
    blocks = raw.reshape(rows // 16, 16, nb, bb)  # [group, row, superblock, byte]
    parts, start = [], 0
    for n_dwords in ([4, 8, 32] if qtype == "Q5_K" else [4, 32]):  # heads, (qh), qs
        part = blocks[..., start:start + 4 * n_dwords].reshape(rows // 16, 16, nb, n_dwords, 4)
        parts.append(part.transpose(0, 2, 3, 1, 4).reshape(rows // 16, nb, 64 * n_dwords))
        start += 4 * n_dwords
    assert start == bb
    return np.concatenate(parts, axis=2).reshape(-1)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows,k", [(16, 256), (48, 768), (160, 2048)])
def test_repack_layout_byte_by_byte(qtype, rows, k, pool):
    raw, _ = quantized(qtype, (rows, k), rows + k)
    out = torch.empty_like(raw)
    _cpu.repack_x16(pool, cpu.type_id(qtype), raw.data_ptr(), out.data_ptr(), rows, k)
    assert np.array_equal(out.numpy().reshape(-1), layout_reference(qtype, raw.numpy(), rows, k))


def test_repack_refuses_bad_shapes_and_overlap(pool):
    raw, _ = quantized("Q4_K", (32, 256), 1)
    with pytest.raises(ValueError, match="only Q4_K and Q5_K"):
        _cpu.repack_x16(pool, cpu.type_id("Q6_K"), raw.data_ptr(), torch.empty(32 * 210).data_ptr(), 32, 256)
    out = torch.empty_like(raw)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        _cpu.repack_x16(pool, 12, raw.data_ptr(), out.data_ptr(), 24, 256)
    with pytest.raises(ValueError, match="overlap"):
        _cpu.repack_x16(pool, 12, raw.data_ptr(), raw.data_ptr() + 144, 32, 256)
    for path, why in _cpu.path_status().items():  # the tuning aid checks the layout's needs too
        if why is None:
            with pytest.raises(ValueError, match="Q4_K_X16"):
                _cpu.bench_gemm(_cpu.Q4_K_X16, raw.data_ptr(), 24 if _cpu.reads_x16(path) else 32, 256, 1, 1,
                                path)


def _layer(e, h, i, seed, qtype="Q4_K"):
    mats = [quantized(qtype, (e, r, c), seed + j) for j, (r, c) in enumerate([(i, h), (i, h), (h, i)])]
    return [m[0] for m in mats], [torch.from_numpy(m[1]) for m in mats]


@needs_x16
@pytest.mark.parametrize("qtype", FORMATS)
def test_moe_on_x16_matches_reference_and_the_tiles_bitwise(qtype, pool):
    e, h, i = 8, 768, 512
    raw, deq = _layer(e, h, i, 20, qtype)
    # the tiles' arithmetic for every call (plain: the tiles from 1 row on, no AMX)
    kw = dict(n_experts=e, hidden=h, intermediate=i, types=(qtype,) * 3, pool=pool,
              config=cpu.CPUMoEConfig(tile_min_tokens=1, amx=0))
    x16 = cpu.CPUMoE(*raw, **kw)
    plain = cpu.CPUMoE(*raw, repack=False, **kw)
    assert x16.layouts == (X16_NAME[qtype],) * 3 and plain.layouts == (qtype,) * 3
    for w, r in zip(x16.weights, raw):  # the same number of bytes, reordered
        assert w.numel() == r.numel() and not torch.equal(w.view(torch.uint8), r.view(-1))
    gen = torch.Generator().manual_seed(21)
    # 1-4 activation rows per expert run fused in one pass, more in passes of four; > 256 pairs: down by rows
    for t, k in [(1, 4), (1, 8), (2, 3), (3, 8), (5, 2), (9, 8), (40, 8), (131, 3)]:
        x = torch.randn(t, h, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen)
        y = x16(x, ids, w)
        assert torch.equal(y, plain(x, ids, w)), f"{qtype}, T={t}, k={k}"
        ref = moe_experts(x.double(), ids, w.double(), *deq)
        assert float((y.double() - ref).norm() / ref.norm()) < 0.04


def test_only_paths_that_read_it_get_it(pool):
    e, h, i = 4, 256, 256
    raw, _ = _layer(e, h, i, 30)
    q5 = quantized("Q5_K", (e, h, i), 31)[0]
    q6 = quantized("Q6_K", (e, h, i), 32)[0]
    for down, dtype, dname in [(q5, "Q5_K", "Q5_K_X16"), (q6, "Q6_K", "Q6_K")]:  # Q6_K has no 16-row layout
        kw = dict(n_experts=e, hidden=h, intermediate=i, types=("Q4_K", "Q4_K", dtype), pool=pool)
        for path, why in _cpu.path_status().items():
            if why is None:
                moe = cpu.CPUMoE(raw[0], raw[1], down, isa=path, **kw)
                want = ("Q4_K_X16", "Q4_K_X16", dname) if _cpu.reads_x16(path) else ("Q4_K", "Q4_K", dtype)
                assert moe.layouts == want, path
    assert not _cpu.reads_x16("scalar") and not _cpu.reads_x16("avx2")
    with pytest.raises(ValueError, match="do not read repacked"):
        _cpu.MoE(pool, e, h, i, raw[0].data_ptr(), _cpu.Q4_K_X16, raw[1].data_ptr(), 12, raw[2].data_ptr(), 12,
                 "scalar")


@needs_x16
@pytest.mark.parametrize("qtype", FORMATS)
def test_amx_on_x16_matches_the_vnni_tiles_bitwise(qtype):
    """16+ activation rows on blocks of 128+ rows take AMX (weights as its B operand): the AMX data flow in plain C++
    everywhere, the real tiles where the CPU has them, both bitwise equal to the VNNI tiles on the original blocks.
    One thread, so a gate/up task is 128 rows; 40 tokens on two experts pad the last group of 16."""
    pool1 = cpu.make_pool(1, pin=False)
    e, h, i = 4, 768, 512
    raw, deq = _layer(e, h, i, 40, qtype)
    vnni = cpu.CPUMoEConfig(tile_min_tokens=1, amx=0)
    kw = dict(n_experts=e, hidden=h, intermediate=i, types=(qtype,) * 3, pool=pool1, config=vnni)
    x16, plain = cpu.CPUMoE(*raw, **kw), cpu.CPUMoE(*raw, repack=False, **kw)
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(40, h, generator=gen)
    ids = torch.tensor([[0, 1]] * 20 + [[1, 0]] * 20)
    w = torch.rand(40, 2, generator=gen)
    want = plain(x, ids, w)
    modes = [2] + ([1] if _cpu.isa_info().get("amx_int8") else [])
    for mode in modes:
        x16.set_config(vnni.replace(amx=mode))
        assert x16.config.amx_mode == mode
        assert torch.equal(x16(x, ids, w), want), f"{qtype}, AMX mode {mode}"
    ref = moe_experts(x.double(), ids, w.double(), *deq)
    assert float((want.double() - ref).norm() / ref.norm()) < 0.04


@needs_x16
def test_x16_prefetch_distance_is_tunable_and_changes_no_result(pool):
    e, h, i = 4, 512, 256
    raw, _ = _layer(e, h, i, 50)
    moe = cpu.CPUMoE(*raw, n_experts=e, hidden=h, intermediate=i, types=("Q4_K",) * 3, pool=pool)
    gen = torch.Generator().manual_seed(51)
    x = torch.randn(3, h, generator=gen)
    ids = torch.tensor([[0, 3], [1, 2], [3, 3]])
    w = torch.rand(3, 2, generator=gen)
    start = moe.config.x16_prefetch_bytes
    assert start % 64 == 0 and start >= 64
    assert cpu.isa_report()["prefetch_bytes"]["q4_k_x16"] == start
    outs = []
    for dist in (64, 960, 8192):
        moe.set_config(moe.config.replace(x16_prefetch_bytes=dist))
        assert moe.config.x16_prefetch_bytes == dist and moe._moe.config["x16_prefetch_bytes"] == dist
        outs.append(moe(x, ids, w))
    assert all(torch.equal(o, outs[0]) for o in outs)
    with pytest.raises(ValueError, match="x16_prefetch_bytes"):  # not a multiple of 64
        moe.set_config(moe.config.replace(x16_prefetch_bytes=1000))
    assert moe.config.x16_prefetch_bytes == 8192  # a refused config leaves the last one
