"""CacheManager: reference-counted KV pages, owned DeltaNet state slots, copy_slot on the pools' device."""
from __future__ import annotations

import pytest
import torch

from ktrans.config import ModelConfig
from ktrans.engine.cache import CacheManager, OutOfMemoryError
from ktrans.model.tiny import preset_config
from ktrans.runtime.pools import KVPool, StatePool

CONFIG = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")  # 3 DeltaNet layers, 1 attention layer


def manager(num_pages=8, page_size=4, num_slots=5, device="cpu") -> CacheManager:
    kv = KVPool(CONFIG, num_pages, page_size, device=device)
    return CacheManager.from_pools(kv, StatePool(CONFIG, num_slots, device=device))


def test_pages_come_lowest_first_and_return_in_order():
    c = CacheManager(8, 4, 2)
    assert c.alloc_pages(3) == [0, 1, 2] and c.alloc_pages(2) == [3, 4]
    assert c.decref([3, 1]) == [3, 1]
    assert c.alloc_pages(3) == [1, 3, 5]  # freed ids first, lowest first, whatever order they came back in
    assert c.alloc_slot() == 0 and c.alloc_slot() == 1
    c.free_slot(0)
    assert c.alloc_slot() == 0


def test_allocation_order_depends_only_on_the_calls():
    def trace():
        c, out = CacheManager(16, 4, 3), []
        held = [c.alloc_pages(n) for n in (3, 1, 4)]
        c.decref(held[0][1:])
        c.incref(held[2])
        c.decref(held[2])
        out.append(c.alloc_pages(3))
        c.decref(held[2])
        out.append(c.alloc_pages(5))
        return out
    assert trace() == trace() == [[1, 2, 8], [4, 5, 6, 7, 9]]


def test_shared_page_survives_until_its_last_holder_lets_go():
    c = CacheManager(4, 4, 1)
    a = c.alloc_pages(2)  # holder 1
    c.incref(a[:1])  # holder 2 shares the first page
    assert c.refcount(a[0]) == 2 and c.num_shared_pages == 1 and c.num_free_pages == 2
    assert c.decref(a) == [a[1]]  # holder 1 lets go: only the unshared page is free
    assert c.refcount(a[0]) == 1 and c.num_free_pages == 3
    assert c.alloc_pages(3) == [1, 2, 3]  # the shared page is not handed out again
    assert c.decref(a[:1]) == [a[0]]  # holder 2 lets go: back to the free list
    assert c.refcount(a[0]) == 0 and c.num_free_pages == 1


def test_a_page_listed_twice_counts_twice():
    c = CacheManager(2, 4, 1)
    p = c.alloc_pages(1)
    c.incref(p + p)
    assert c.refcount(p[0]) == 3 and c.decref(p + p) == [] and c.decref(p) == p


def test_errors_name_the_page_or_slot_and_change_nothing():
    c = CacheManager(4, 4, 2)
    pages = c.alloc_pages(2)
    c.decref(pages[:1])
    with pytest.raises(ValueError, match="KV page 0 is already free"):
        c.decref(pages)  # page 1 is valid, page 0 is not: neither changes
    assert c.refcount(1) == 1 and c.num_free_pages == 3
    with pytest.raises(ValueError, match="KV page 1 has 1 holder"):
        c.decref([1, 1])
    with pytest.raises(ValueError, match="KV page 3 is free"):
        c.incref([1, 3])  # sharing needs an allocated page
    assert c.refcount(1) == 1
    with pytest.raises(ValueError, match="KV page 9 does not exist"):
        c.decref([9])
    with pytest.raises(OutOfMemoryError, match="asked for 4 KV pages, 3 free of 4"):
        c.alloc_pages(4)
    assert c.num_free_pages == 3 and c.can_alloc_pages(3) and not c.can_alloc_pages(4)
    s = c.alloc_slot()
    c.free_slot(s)
    with pytest.raises(ValueError, match="state slot 0 is already free"):
        c.free_slot(s)
    with pytest.raises(ValueError, match="state slot 1 is already free"):
        c.free_slot(1)  # never allocated
    c.alloc_slot(), c.alloc_slot()
    with pytest.raises(OutOfMemoryError, match="all 2 DeltaNet state slots"):
        c.alloc_slot()


def test_usage_numbers():
    c = CacheManager(8, 4, 4)
    assert c.all_free and c.kv_usage == 0.0 and c.slot_usage == 0.0
    c.alloc_pages(2)
    c.alloc_slot()
    st = c.stats()
    assert st["kv_usage"] == 0.25 and st["slot_usage"] == 0.25 and st["kv_pages_free"] == 6 and st["slots_free"] == 3
    assert st["kv_pages"] == 8 and st["slots"] == 4 and not c.all_free and c.num_used_pages == 2


def test_manager_and_pools_must_agree():
    kv = KVPool(CONFIG, 4, 4)
    with pytest.raises(ValueError, match="4 pages of 4, not 5 of 4"):
        CacheManager(5, 4, 2, kv=kv)
    with pytest.raises(RuntimeError, match="no state pool"):
        c = CacheManager(4, 4, 2)
        c.copy_slot(c.alloc_slot(), c.alloc_slot())


def _fill(c: CacheManager) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for t in (*c.states.conv, *c.states.ssm):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return [t.clone() for t in (*c.states.conv, *c.states.ssm)]


def _check_copy(c: CacheManager, before: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
    after = [t for t in (*c.states.conv, *c.states.ssm)]
    assert len(after) == 2 * len(CONFIG.linear_attention_layers) == 6  # conv and recurrent, every DeltaNet layer
    for b, a in zip(before, after):
        want = b.clone()
        want[dst] = b[src]
        assert torch.equal(a.cpu(), want.cpu())  # dst rows are src's, exactly; every other row untouched


def _copy_slots_cases(device: str) -> None:
    c = manager(num_slots=5, device=device)
    slots = [c.alloc_slot() for _ in range(5)]
    before = _fill(c)
    c.copy_slot(slots[3], slots[1])
    _check_copy(c, before, [3], [1])
    before = [t.clone() for t in (*c.states.conv, *c.states.ssm)]
    c.copy_slots([0, 2], [2, 0])  # a swap: rows are read before any is written
    _check_copy(c, before, [0, 2], [2, 0])
    before = [t.clone() for t in (*c.states.conv, *c.states.ssm)]
    c.copy_slots(torch.tensor([4], device=device), torch.tensor([3], device=device))  # indices already there
    _check_copy(c, before, [4], [3])
    assert all(t.device.type == torch.device(device).type for t in (*c.states.conv, *c.states.ssm))


def test_copy_slot_copies_exactly_the_src_rows_of_every_layer():
    _copy_slots_cases("cpu")


def test_copy_slot_is_one_copy_a_kind(monkeypatch):
    """Every layer's state slots are views of one tensor a kind (StatePool.conv_all, ssm_all), so a slot's copy is
    two index_copy_ calls, not two a layer (the prefix cache's snapshots: 72 launches at the 80B's 36 layers)."""
    c = manager(num_slots=3)
    pool = c.states
    for views, whole in ((pool.conv, pool.conv_all), (pool.ssm, pool.ssm_all)):
        assert len(views) == whole.shape[0] == len(CONFIG.linear_attention_layers)
        assert all(v.is_contiguous() and v.data_ptr() == whole[i].data_ptr() for i, v in enumerate(views))
    calls = []
    real = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda t, *a: calls.append(t.shape) or real(t, *a))
    a, b = c.alloc_slot(), c.alloc_slot()
    c.copy_slot(a, b)
    assert calls == [pool.conv_all.shape, pool.ssm_all.shape]


def test_copy_slot_refuses_free_slots_and_repeated_destinations():
    c = manager(num_slots=3)
    a, b = c.alloc_slot(), c.alloc_slot()
    with pytest.raises(ValueError, match="state slot 2 is free"):
        c.copy_slot(a, 2)
    with pytest.raises(ValueError, match="repeat"):
        c.copy_slots([a, b], [b, b])
    with pytest.raises(ValueError, match="2 sources for 1"):
        c.copy_slots([a, b], [b])


@pytest.mark.gpu
def test_copy_slot_on_cuda_without_host_sync():
    _copy_slots_cases("cuda")
    c = manager(num_slots=4, device="cuda")
    a, b = c.alloc_slot(), c.alloc_slot()
    before = _fill(c)
    c.copy_slot(a, b)  # first call builds the index; the second reuses it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        c.copy_slot(b, a)
        c.copy_slots([a, b], [b, a])
        c.copy_slot(a, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    _check_copy(c, before, [a], [b])  # a := b (= a) , swap, b := a: every row is the original a


def _snapshot_and_page_rows(device: str) -> None:
    kv = KVPool(CONFIG, 4, 4, device=device)
    c = CacheManager.from_pools(kv, StatePool(CONFIG, 2 + 3, device=device), num_snapshot_slots=3)
    assert (c.num_slots, c.num_snapshot_slots, c.num_free_slots, c.num_free_snapshot_slots) == (2, 3, 2, 3)
    a, b = c.alloc_slot(), c.alloc_slot()
    with pytest.raises(OutOfMemoryError, match="state slots"):
        c.alloc_slot()  # the snapshot range is not for requests
    snaps = [c.alloc_snapshot_slot() for _ in range(3)]
    assert snaps == [2, 3, 4] and c.num_free_slots == 0 and kv.pad_page == 4
    with pytest.raises(OutOfMemoryError, match="snapshot slots"):
        c.alloc_snapshot_slot()
    c.copy_slot(a, snaps[1])  # a snapshot is taken like any copy
    c.free_slot(snaps[1])
    assert c.num_free_snapshot_slots == 1 and c.num_free_slots == 0 and c.alloc_snapshot_slot() == 3
    src, dst = c.alloc_pages(2)
    g = torch.Generator().manual_seed(2)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape, generator=g).to(t.device))
    before = [t.clone() for t in (*kv.k, *kv.v)]
    c.copy_page_rows(src, dst, 3)  # rows 0..2 of the page; row 3 and every other page untouched
    for b0, t in zip(before, (*kv.k, *kv.v)):
        want = b0.clone()
        want[dst * 4 : dst * 4 + 3] = b0[src * 4 : src * 4 + 3]
        assert torch.equal(t.cpu(), want.cpu())
    with pytest.raises(ValueError, match="KV page 3 is free"):
        c.copy_page_rows(src, 3, 1)
    with pytest.raises(ValueError, match="5 rows"):
        c.copy_page_rows(src, dst, 5)
    for s in (a, b, *snaps):
        c.free_slot(s)
    c.decref([src, dst])
    assert c.all_free


def test_snapshot_slots_and_page_rows():
    _snapshot_and_page_rows("cpu")


@pytest.mark.gpu
def test_page_rows_on_cuda_without_host_sync():
    _snapshot_and_page_rows("cuda")
    kv = KVPool(CONFIG, 4, 4, device="cuda")
    c = CacheManager.from_pools(kv, StatePool(CONFIG, 3, device="cuda"), num_snapshot_slots=1)
    src, dst = c.alloc_pages(2)
    slot, snap = c.alloc_slot(), c.alloc_snapshot_slot()
    c.copy_slot(slot, snap)  # builds the index once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a hit's copies: the state, then a partial page
    try:
        c.copy_slot(snap, slot)
        c.copy_page_rows(src, dst, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
