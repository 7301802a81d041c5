"""The Triton repack of K-quant blocks (ktrans.kernels.triton.repack) against the torch repack
(ktrans.kernels.triton.quant_layout.repack), its oracle: every plane equal bit for bit (tolerance zero: it moves
bits), from row-major blocks and from the CPU experts' 16-row layout, for a single matrix and a stack of experts at
odd row counts. Marked `triton` (interpreted without a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf.quants")
from ktrans.kernels.triton.quant_layout import BLOCK_BYTES, QK, repack  # noqa: E402
from ktrans.kernels.triton.repack import repack_blocks  # noqa: E402
from tests.kernels.test_quant_layout import random_blocks  # noqa: E402

pytestmark = pytest.mark.triton


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A plane's raw bytes (equal bits compare equal, NaN patterns included)."""
    return t.contiguous().view(torch.uint8).cpu()


def _assert_same(got, want):
    assert (got.qtype, got.n, got.k, got.experts) == (want.qtype, want.n, want.k, want.experts)
    for name, w in want.planes().items():
        g = got.planes()[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(_bits(g), _bits(w)), name


def _to_x16(raw: np.ndarray, qtype: str, rows: int, k: int) -> np.ndarray:
    """Row-major blocks -> the 16-row layout: per group of 16 rows and super-block, the rows' 4-byte words
    interleaved (csrc/cpu repack_x16 writes the same bytes; checked below where it runs)."""
    nsb, words = k // QK, BLOCK_BYTES[qtype] // 4
    return raw.reshape(rows // 16, 16, nsb, words, 4).transpose(0, 2, 3, 1, 4).copy().reshape(-1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("experts", [None, 3])
def test_row_major_blocks_equal_the_torch_repack(qtype, experts, triton_device):
    rows, k = 37, 512  # odd: no row tile divides it
    raws = [random_blocks(qtype, rows, k, seed=s) for s in range(experts or 1)]
    raw = np.stack(raws) if experts else raws[0]
    shape = ((experts,) if experts else ()) + (rows, k)
    want = repack(torch.from_numpy(raw), qtype, shape)
    got = repack_blocks(torch.from_numpy(raw).to(triton_device), qtype, shape)
    assert got.device.type == triton_device.type
    _assert_same(got, want)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_16_row_layout_equals_the_torch_repack_of_plain_rows(qtype, triton_device):
    experts, rows, k = 3, 48, 768
    raw = np.stack([random_blocks(qtype, rows, k, seed=10 + s) for s in range(experts)])
    want = repack(torch.from_numpy(raw), qtype, (experts, rows, k))
    x16 = _to_x16(raw, qtype, experts * rows, k)
    got = repack_blocks(torch.from_numpy(x16).to(triton_device), qtype, (experts, rows, k), x16=True)
    _assert_same(got, want)


def test_16_row_layout_is_the_cpu_experts_layout():
    """The layout the test builds is the one the C++ repack writes (where this CPU's kernels read it)."""
    from ktrans import _cpu
    from ktrans.kernels import cpu
    if not _cpu.reads_x16("auto"):
        pytest.skip("this CPU's kernels do not read the 16-row layout")
    rows, k = 32, 512
    raw = random_blocks("Q4_K", rows, k, seed=3)
    dst = np.empty_like(raw)
    _cpu.repack_x16(cpu.make_pool(1), cpu.GGML_TYPES["Q4_K"], raw.ctypes.data, dst.ctypes.data, rows, k)
    np.testing.assert_array_equal(dst.reshape(-1), _to_x16(raw, "Q4_K", rows, k))


def test_bad_inputs_name_the_problem():
    raw = torch.zeros(17 * 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16-row layout"):
        repack_blocks(raw, "Q4_K", (17, 256), x16=True)
    with pytest.raises(ValueError, match="16-row layout"):
        repack_blocks(torch.zeros(16 * 210, dtype=torch.uint8), "Q6_K", (16, 256), x16=True)
    with pytest.raises(ValueError, match="expected 2448 uint8 bytes"):
        repack_blocks(raw[:-1], "Q4_K", (17, 256))
    with pytest.raises(ValueError, match="super-blocks"):
        repack_blocks(raw, "Q4_K", (17, 200))
