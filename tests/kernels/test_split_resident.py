"""The resident experts' id split (ktrans.kernels.triton.moe_quant.split_resident, one launch a layer) against its
torch oracle (ktrans.kernels.torch.moe.split_resident): bitwise, at odd sizes, for int64 and int32 ids, with pairs
masked off (-1), resident experts at scattered slots and a step wider than one program's block."""
from __future__ import annotations

import pytest
import torch

from ktrans.kernels.torch.moe import split_resident as split_reference

pytest.importorskip("triton")

from ktrans.kernels.triton.moe_quant import split_resident  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("t,k,e", [(1, 10, 512), (7, 3, 13), (300, 2, 37)])
def test_split_matches_reference(triton_device, t, k, e, dtype):
    g = torch.Generator().manual_seed(t * 131 + k)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[torch.rand(t, k, generator=g) < 0.2] = -1
    resident = torch.randperm(e, generator=g)[: max(1, e // 3)]
    slot_of = torch.full((e,), -1, dtype=torch.int64)
    slot_of[resident] = torch.arange(resident.numel())
    ids_d, slot_d = ids.to(dtype).to(triton_device), slot_of.to(triton_device)
    slots, cpu_ids = split_resident(ids_d, slot_d)
    want_slots, want_cpu = split_reference(ids.to(dtype), slot_of)
    assert slots.dtype == cpu_ids.dtype == dtype and slots.shape == cpu_ids.shape == ids.shape
    assert torch.equal(slots.cpu(), want_slots) and torch.equal(cpu_ids.cpu(), want_cpu)
    # every live pair lands on exactly one side, under its slot or its id
    live = ids >= 0
    assert torch.equal((slots.cpu() >= 0) ^ (cpu_ids.cpu() >= 0), live)
    on_gpu = slots.cpu() >= 0
    assert torch.equal(slot_of[ids[on_gpu]], slots.cpu()[on_gpu].long())


def test_a_transposed_view_is_read_in_its_logical_order(triton_device):
    ids = torch.tensor([[0, 3, -1], [2, 1, 4]]).t().to(triton_device)  # [3, 2], not contiguous
    slot_of = torch.tensor([-1, 0, -1, 1, -1], device=triton_device)
    slots, cpu_ids = split_resident(ids, slot_of)
    assert slots.cpu().tolist() == [[-1, -1], [1, 0], [-1, -1]]
    assert cpu_ids.cpu().tolist() == [[0, 2], [-1, -1], [-1, 4]]


def test_an_id_past_the_table_stays_the_cpus(triton_device):
    """An id at or past slot_of's length reads no slot (no load out of bounds): it goes to the CPU's side, whose
    kernel refuses it with a clear error, as the oracle says."""
    ids = torch.tensor([[0, 5], [2, 3]])
    slot_of = torch.tensor([1, -1, 0])
    want_slots, want_cpu = split_reference(ids, slot_of)
    assert want_slots.tolist() == [[1, -1], [0, -1]] and want_cpu.tolist() == [[-1, 5], [-1, 3]]
    slots, cpu_ids = split_resident(ids.to(triton_device), slot_of.to(triton_device))
    assert torch.equal(slots.cpu(), want_slots) and torch.equal(cpu_ids.cpu(), want_cpu)
