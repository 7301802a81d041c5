"""CacheManager: who holds which KV page and which DeltaNet state slot.

The tensors live in `runtime.pools` (KVPool, StatePool), where the model reads and writes them at the rows a
ForwardBatch names; this class owns the bookkeeping over them, and the scheduler allocates, frees and shares
through it.

- **KV pages are reference-counted.** `alloc_pages(n)` hands out the lowest free ids (deterministic) with one
  reference each; `incref(pages)` adds a holder (a prefix-cache node, a second request); `decref(pages)` drops
  one and frees a page when its last holder lets go. A page is shared only whole and only read by its sharers:
  whoever writes past a shared prefix writes into its own pages.
- **DeltaNet state slots are owned, never shared**: decode updates a slot in place. `alloc_slot()` /
  `free_slot(slot)`; `copy_slot(src, dst)` (or `copy_slots`) copies every linear-attention layer's conv and
  recurrent state rows on the pool's device, one batched `index_copy_` a kind (a part keeps its layers in one
  tensor a kind), with no host sync. Under a model split over devices the pools are per device
  (runtime.pools.SplitKVPool / SplitStatePool) and share these ids: one page or slot id names the same rows in
  every device's part, so the bookkeeping here is device-blind. That is how a state snapshot (a slot the prefix
  cache keeps) is taken from a request's slot, and how a hit gives a request its own copy.
- **Snapshot slots are a second range of the same pool**: slots [num_slots, num_slots + num_snapshot_slots) are
  handed out only by `alloc_snapshot_slot()` (the prefix cache's), so a request never takes a snapshot's place
  and the scheduler's `num_free_slots` counts request slots only. `copy_page_rows(src, dst, n)` copies a page's
  first n KV rows into another page (a hit on a snapshot that falls mid-page: pages are shared only whole).

Errors: a page or slot freed twice (refcount already 0), or never allocated, raises ValueError naming it; a
call that raises changes nothing. Running out raises OutOfMemoryError; `can_alloc_pages` / `num_free_slots`
let the scheduler ask first.

Made with `CacheManager.from_pools(kv, states)` in the engine, or with sizes alone (no tensors) where only the
accounting matters (the scheduler's tests); copy_slot then has nothing to copy and refuses.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from ktrans.runtime.pools import KVPool, StatePool


class OutOfMemoryError(RuntimeError):
    """No free KV pages or DeltaNet state slots are left for the request."""


class _FreeList:
    """Free ids, lowest first (a heap): allocation order depends only on the sequence of calls."""

    def __init__(self, n: int, first: int = 0):
        self.heap = list(range(first, first + n))  # sorted, hence a heap

    def __len__(self) -> int:
        return len(self.heap)

    def pop(self) -> int:
        return heapq.heappop(self.heap)

    def push(self, i: int) -> None:
        heapq.heappush(self.heap, i)


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, kv: KVPool | None = None,
                 states: StatePool | None = None, num_snapshot_slots: int = 0):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("num_slots", num_slots)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if num_snapshot_slots < 0:
            raise ValueError(f"num_snapshot_slots must be >= 0, got {num_snapshot_slots}")
        if kv is not None and (kv.num_pages, kv.page_size) != (num_pages, page_size):
            raise ValueError(f"the KV pool has {kv.num_pages} pages of {kv.page_size}, not {num_pages} of {page_size}")
        total = num_slots + num_snapshot_slots
        if states is not None and states.num_slots != total:
            raise ValueError(f"the state pool has {states.num_slots} slots, not {num_slots} + {num_snapshot_slots} "
                             f"for snapshots")
        self.num_pages, self.page_size, self.num_slots = num_pages, page_size, num_slots
        self.num_snapshot_slots = num_snapshot_slots
        self.kv, self.states = kv, states
        self._refs = [0] * num_pages  # holders of each page; 0 = free
        self._free_pages = _FreeList(num_pages)
        self._slot_used = [False] * total
        self._free_slots = _FreeList(num_slots)
        self._free_snapshots = _FreeList(num_snapshot_slots, first=num_slots)
        self._index_cache: dict[tuple, torch.Tensor] = {}

    @classmethod
    def from_pools(cls, kv: KVPool, states: StatePool, num_snapshot_slots: int = 0) -> "CacheManager":
        return cls(kv.num_pages, kv.page_size, states.num_slots - num_snapshot_slots, kv, states, num_snapshot_slots)

    # ---- KV pages -----------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_alloc_pages(self, n: int) -> bool:
        return n <= len(self._free_pages)

    def alloc_pages(self, n: int) -> list[int]:
        """n free pages, lowest ids first, each with refcount 1 (held by the caller)."""
        if n < 0:
            raise ValueError(f"asked for {n} KV pages")
        if n > len(self._free_pages):
            raise OutOfMemoryError(f"asked for {n} KV pages, {len(self._free_pages)} free of {self.num_pages}")
        pages = [self._free_pages.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more holder for each page (a page listed twice gains two). Only pages in use can be shared."""
        counts = Counter(pages)
        for p in counts:
            self._check_page(p)
            if self._refs[p] == 0:
                raise ValueError(f"KV page {p} is free: only an allocated page can be shared")
        for p, k in counts.items():
            self._refs[p] += k

    def decref(self, pages: Iterable[int]) -> list[int]:
        """One holder fewer for each page; pages whose count reaches 0 are free again. Returns those, in order."""
        pages = list(pages)
        counts = Counter(pages)
        for p, k in counts.items():
            self._check_page(p)
            if self._refs[p] < k:
                what = "is already free (freed twice, or never allocated)" if self._refs[p] == 0 else \
                    f"has {self._refs[p]} holder(s), released {k} times"
                raise ValueError(f"KV page {p} {what}")
        freed = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free_pages.push(p)
                freed.append(p)
        return freed

    def refcount(self, page: int) -> int:
        self._check_page(page)
        return self._refs[page]

    def _check_page(self, p: int) -> None:
        if not isinstance(p, int) or not 0 <= p < self.num_pages:
            raise ValueError(f"KV page {p!r} does not exist (the pool has {self.num_pages})")

    def copy_page_rows(self, src: int, dst: int, n: int) -> None:
        """The first n token rows of page dst := those of page src, K and V of every attention layer (on the
        device, no sync). A prefix-cache hit mid-page gives the request its own copy of the partial page."""
        if self.kv is None:
            raise RuntimeError("this CacheManager has no KV pool (made from sizes alone): nothing to copy")
        if not 0 < n <= self.page_size:
            raise ValueError(f"copy_page_rows: {n} rows of a page of {self.page_size}")
        for p in (src, dst):
            self._check_page(p)
            if self._refs[p] == 0:
                raise ValueError(f"KV page {p} is free: copy only between allocated pages")
        s, d = src * self.page_size, dst * self.page_size
        for t in (*self.kv.k, *self.kv.v):
            t[d : d + n].copy_(t[s : s + n])

    # ---- DeltaNet state slots -----------------------------------------------------------------------
    def alloc_slot(self) -> int:
        """The lowest free slot. Its contents are stale: the model zeroes it when a sequence starts at 0, and a
        prefix-cache hit overwrites it with copy_slot."""
        if not self._free_slots:
            raise OutOfMemoryError(f"all {self.num_slots} DeltaNet state slots are in use")
        slot = self._free_slots.pop()
        self._slot_used[slot] = True
        return slot

    def free_slot(self, slot: int) -> None:
        """Give back a request slot or a snapshot slot (each returns to its own range)."""
        self._check_slot(slot)
        if not self._slot_used[slot]:
            raise ValueError(f"state slot {slot} is already free (freed twice, or never allocated)")
        self._slot_used[slot] = False
        (self._free_slots if slot < self.num_slots else self._free_snapshots).push(slot)

    def alloc_snapshot_slot(self) -> int:
        """The lowest free snapshot slot (beyond the request slots), for the prefix cache to copy a state into."""
        if not self._free_snapshots:
            raise OutOfMemoryError(f"all {self.num_snapshot_slots} snapshot slots are in use")
        slot = self._free_snapshots.pop()
        self._slot_used[slot] = True
        return slot

    def _check_slot(self, s: int) -> None:
        total = self.num_slots + self.num_snapshot_slots
        if not isinstance(s, int) or not 0 <= s < total:
            raise ValueError(f"state slot {s!r} does not exist (the pool has {total})")

    def copy_slot(self, src: int, dst: int) -> None:
        """dst's conv and recurrent state := src's, in every linear-attention layer (on the device, no sync)."""
        self.copy_slots([src], [dst])

    def copy_slots(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Row dst[i] := row src[i] of every conv and recurrent state tensor: one index_copy_ a kind and pool part.

        Indices given as ints go to the device through pinned memory without blocking (and are cached for
        reuse), so nothing waits for the device; a caller with the indices already on the device passes tensors.
        Both lists name allocated slots and dst holds no duplicates; the rows are read before any is written, so
        src and dst may overlap (a swap works). Tensor indices are the caller's to check: checking them would sync.
        """
        if self.states is None:
            raise RuntimeError("this CacheManager has no state pool (made from sizes alone): nothing to copy")
        if not (isinstance(src, torch.Tensor) or isinstance(dst, torch.Tensor)):
            src, dst = list(src), list(dst)
            if len(src) != len(dst):
                raise ValueError(f"copy_slots: {len(src)} sources for {len(dst)} destinations")
            for s in (*src, *dst):
                self._check_slot(s)
                if not self._slot_used[s]:
                    raise ValueError(f"state slot {s} is free: copy only between allocated slots")
            if len(set(dst)) != len(dst):
                raise ValueError(f"copy_slots: the destinations {dst} repeat a slot")
            if not src:
                return
        # A split pool's parts sit on several devices: each device reads its own copy of the indices. A part keeps
        # its layers' slots in one tensor a kind (StatePool.conv_all, ssm_all): one copy a kind and part.
        index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for part in self.states.parts:
            for t in (part.conv_all, part.ssm_all):
                if t.device not in index:
                    index[t.device] = self._device_index(src, t.device), self._device_index(dst, t.device)
                src_i, dst_i = index[t.device]
                t.index_copy_(1, dst_i, t.index_select(1, src_i))

    def _device_index(self, idx: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
        if isinstance(idx, torch.Tensor):
            return idx.to(device=device, dtype=torch.long, non_blocking=True)
        idx = tuple(idx)
        if (t := self._index_cache.get((idx, device))) is not None:
            return t
        host = torch.tensor(idx, dtype=torch.long)
        if device.type == "cuda":
            host = host.pin_memory()  # a pinned source lets the copy run async on the stream
        t = host.to(device, non_blocking=True)
        if len(self._index_cache) < 4096:  # (src, dst) pairs recur: a request's slot, a snapshot's slot
            self._index_cache[(idx, device)] = t
        return t

    # ---- numbers for /metrics, the startup summary and the leak checks ------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def num_shared_pages(self) -> int:
        """Pages with more than one holder."""
        return sum(r > 1 for r in self._refs)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_snapshot_slots(self) -> int:
        return len(self._free_snapshots)

    @property
    def kv_usage(self) -> float:
        return self.num_used_pages / self.num_pages

    @property
    def slot_usage(self) -> float:
        return 1.0 - self.num_free_slots / self.num_slots

    @property
    def all_free(self) -> bool:
        return (self.num_free_pages == self.num_pages and self.num_free_slots == self.num_slots
                and self.num_free_snapshot_slots == self.num_snapshot_slots)

    def stats(self) -> dict:
        return {"kv_usage": self.kv_usage, "slot_usage": self.slot_usage, "kv_pages_free": self.num_free_pages,
                "kv_pages": self.num_pages, "kv_pages_shared": self.num_shared_pages,
                "slots_free": self.num_free_slots, "slots": self.num_slots,
                "snapshot_slots_free": self.num_free_snapshot_slots, "snapshot_slots": self.num_snapshot_slots}
