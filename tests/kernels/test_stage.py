"""The CPU experts' hand-off kernels (ktrans.kernels.triton.stage) against the torch copies they replace
(ktrans.kernels.torch.stage): bitwise equal, being casts and copies. Odd sizes: a hidden size past one block, k = 3,
strided inputs, bf16 and fp32 activations, int32 and int64 ids, a staging taller than the rows. Interpreted without a
GPU (marked `triton`); on a GPU the staging is pinned host memory, read and written in place by the kernels."""
from __future__ import annotations

import pytest
import torch

from ktrans.kernels.torch import stage as ref

pytestmark = pytest.mark.triton


def _staging(rows, h, k, device):
    pinned = device.type == "cuda"
    return (torch.full((rows, h), 5.0, pin_memory=pinned), torch.full((rows, k), -7, dtype=torch.int64,
            pin_memory=pinned), torch.full((rows, k), 5.0, pin_memory=pinned))


@pytest.mark.parametrize("t, h, dtype, ids_dtype", [(1, 1031, torch.bfloat16, torch.int64),
                                                     (5, 2048, torch.float32, torch.int32),
                                                     (3, 17, torch.bfloat16, torch.int32)])
def test_stage_in_equals_the_copies(t, h, dtype, ids_dtype, triton_device):
    from ktrans.kernels.triton import stage

    k, rows = 3, 8
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 2 * h, generator=gen).to(dtype)[:, ::2].to(triton_device)  # strided rows and columns
    ids = torch.randint(0, 512, (t, k), generator=gen).to(ids_dtype).to(triton_device)
    w = torch.rand(t, k + 1, generator=gen).to(dtype)[:, :k].to(triton_device)
    got, want = _staging(rows, h, k, triton_device), _staging(rows, h, k, triton_device)
    stage.stage_in(x, ids, w, *got)
    ref.stage_in(x, ids, w, *want)
    if triton_device.type == "cuda":
        torch.cuda.synchronize()
    for g, r in zip(got, want):
        assert torch.equal(g, r)  # the rows past t untouched in both
    with pytest.raises(ValueError, match="do not fit the staging"):
        stage.stage_in(x, ids[:, :2], w, *got)


@pytest.mark.parametrize("rows, h, dtype", [(1, 1031, torch.bfloat16), (4, 2048, torch.float32), (0, 64, torch.bfloat16)])
def test_stage_out_equals_the_copy(rows, h, dtype, triton_device):
    from ktrans.kernels.triton import stage

    src = torch.randn(6, h, generator=torch.Generator().manual_seed(h), pin_memory=triton_device.type == "cuda")
    got = stage.stage_out(src, rows, triton_device, dtype)
    want = ref.stage_out(src, rows, triton_device, dtype)
    assert got.shape == (rows, h) and got.dtype == dtype and got.device == want.device
    assert torch.equal(got.cpu(), want.cpu())
