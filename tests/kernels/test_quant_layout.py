"""The packed GPU layout of GGUF blocks (ktrans.kernels.triton.quant_layout): dequantized through its planes (the
torch reference, and the Triton kernel under `triton`), every type equals gguf-py's dequantize of the same blocks,
bit for bit for the reference; the Triton kernel within one fp32 rounding (a fused multiply-add), stated below."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ktrans.kernels.torch.quant import dequantize_packed  # noqa: E402
from ktrans.kernels.triton.quant_layout import TYPES, concat_rows, packable, repack  # noqa: E402
from ktrans.weights import quants as Q  # noqa: E402

ROWS = 37  # odd: no row tile divides it


def random_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes in every field (all codes and scales reachable), with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, Q.row_bytes(qtype, k)), dtype=np.uint8)
    t = Q.quant_type(qtype)
    blocks = raw.reshape(rows, -1, t.type_size)
    d = rng.uniform(-0.02, 0.02, blocks.shape[:2] + (2,)).astype(np.float16).view(np.uint8)
    off = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q8_0": [0]}[qtype]
    for j, o in enumerate(off):
        blocks[:, :, o:o + 2] = d[:, :, 2 * j:2 * j + 2]
    return raw


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_dequantize_equals_gguf_py(qtype):
    k = 512
    raw = random_blocks(qtype, ROWS, k)
    want = gguf_quants.dequantize(raw, GGMLQuantizationType[qtype])
    p = repack(torch.from_numpy(raw), qtype, (ROWS, k))
    got = dequantize_packed(p).numpy()
    assert got.shape == (ROWS, k)
    np.testing.assert_array_equal(got, want)


def test_experts_and_concatenated_rows():
    k = 256
    raws = [random_blocks("Q6_K", ROWS, k, seed=s) for s in range(3)]
    stack = repack(torch.from_numpy(np.stack(raws)), "Q6_K", (3, ROWS, k))
    assert stack.experts == 3 and stack.lo.shape[:3] == (3, 1, ROWS)
    for e in range(3):
        want = gguf_quants.dequantize(raws[e], GGMLQuantizationType.Q6_K)
        np.testing.assert_array_equal(dequantize_packed(stack.expert(e)).numpy(), want)
        np.testing.assert_array_equal(dequantize_packed(stack)[e].numpy(), want)
    cat = concat_rows([repack(torch.from_numpy(r), "Q6_K", (ROWS, k)) for r in raws[:2]])
    np.testing.assert_array_equal(dequantize_packed(cat).numpy(),
                                  np.concatenate([gguf_quants.dequantize(r, GGMLQuantizationType.Q6_K)
                                                  for r in raws[:2]]))


def test_packed_bytes_per_weight():
    bpw = {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625, "Q8_0": 8.5}
    for qtype in TYPES:
        p = repack(torch.from_numpy(random_blocks(qtype, 16, 512)), qtype, (16, 512))
        assert p.nbytes * 8 / (16 * 512) == bpw[qtype]
    assert not packable("Q5_0", 512) and not packable("Q4_K", 64) and packable("Q8_0", 256)


def test_repack_in_larger_chunks_gives_the_same_planes():
    import numpy as np

    raw = torch.from_numpy(np.stack([random_blocks("Q4_K", 48, 512, s) for s in range(3)]))
    a = repack(raw, "Q4_K", (3, 48, 512))
    b = repack(raw, "Q4_K", (3, 48, 512), rows_per_chunk=7)  # chunks that cut experts
    assert all(torch.equal(x, y) for x, y in zip(a.planes().values(), b.planes().values()))
