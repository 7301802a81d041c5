"""PrefixCache: the hybrid radix prefix cache. Requests that share a prefix (a system prompt, the earlier turns of
a chat, an agent's growing context, a preempted request's own tokens) reuse its KV pages and its DeltaNet state
instead of recomputing them.

A Qwen3-Next prefix has two kinds of memory, and they are not alike:

- **KV pages** (the full-attention layers) hold one row per token, so any page-aligned prefix of a cached
  sequence is reusable. The tree's edges are runs of whole pages of token ids, and each node holds (a reference
  on) the pages of its edge, ref-counted through the CacheManager like a request's.
- **The DeltaNet state** (conv window and recurrent matrix of every linear-attention layer) is one point of a
  recurrence: it is valid at exactly the token where it was taken, and cannot be rebuilt from KV. A node keeps
  *snapshots*: slots of their own (the StatePool's snapshot range) holding a state copied from a request's slot.
  A snapshot sits at its node's end plus a `tail` of fewer than a page of tokens; a tail's KV rows live in a
  page the snapshot holds a reference on (pages are shared only whole, so a hit copies those rows out).

A request therefore reuses the prefix up to the deepest matched snapshot, never past it, and recomputes from
there: `lookup` finds it, and `attach` shares the whole pages before it, copies the snapshot into the request's
own slot (decode mutates a slot, so a state is never shared) and the tail rows into the request's own page. The
hit stops at least one token before the request's end, so that the step computing the rest gives logits.

Snapshots are taken (`on_computed`, `release`) where a request's state lies at a chunk end: at every prefill
chunk end (the prompt's end is one), and when a request finishes (the end of a reply, so that a chat's next turn
hits the whole conversation before it) or is preempted (so that it resumes where it was). When a lookup matches
KV pages deeper than its deepest snapshot, the point where the request branches off the cached path is not
covered; `clip` then ends one of its chunks there, so the snapshot taken at that chunk end serves the next
request that shares the same prefix, and a request admitted meanwhile that would cut at the same point waits
for that snapshot instead of computing the prefix again (eight requests under one system prompt: the first
covers the branch point, the other seven hit it).

Budgets are separate. Snapshots have a fixed number of slots (`--prefix_cache_max_snapshots`); taking one when
all are held evicts the least recently used. Pages come from the KV pool itself: the tree keeps them while
nobody needs them, and the scheduler evicts the least recently used leaves when a request needs pages
(`evict_pages`). A node that a running request uses (one it hit, or the last one it inserted) is locked and
never evicted; a leaf that holds no snapshot is useless for a hybrid model and is pruned at once.

Pure Python over the CacheManager; the only tensor work is copy_slot and copy_page_rows, queued on the device
after the step that computed the state. Every LRU clock is a counter, so eviction order depends only on the
calls made.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

from ktrans.engine.cache import CacheManager
from ktrans.engine.request import Request


@dataclass(eq=False)
class Snapshot:
    """A DeltaNet state valid after `node.depth + len(tail)` tokens."""

    node: "Node"
    tail: tuple[int, ...]  # tokens past the node's end, fewer than a page
    slot: int  # a snapshot slot of the StatePool
    page: int | None  # the page holding the tail's KV rows (None for an empty tail)
    last_use: int = 0

    @property
    def position(self) -> int:
        return self.node.depth + len(self.tail)


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # this edge's tokens, whole pages
    pages: list[int]  # one per page of key
    parent: "Node | None"
    depth: int  # tokens from the root to this node's end
    seq: int  # creation order: ties in LRU order break the same way every run
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)  # by the first page of their key
    snapshots: dict[tuple[int, ...], Snapshot] = field(default_factory=dict)  # by tail
    lock: int = 0  # running requests using this node
    last_use: int = 0


@dataclass
class Match:
    """What a lookup found: reuse `num_tokens` tokens, `pages` (the whole ones before the hit) and `snapshot`."""

    node: Node
    num_tokens: int
    pages: list[int]
    snapshot: Snapshot | None
    kv_len: int  # tokens whose KV pages matched (page-aligned); past num_tokens when no snapshot covers them

    @property
    def is_hit(self) -> bool:
        return self.snapshot is not None

    def cut(self, num_tokens: int) -> int | None:
        """Where a request of num_tokens tokens should end a chunk: at the matched KV's end when no snapshot
        covers it (the branch point), so that a snapshot is taken there."""
        return self.kv_len if self.num_tokens < self.kv_len < num_tokens else None


# States are emitted where the DeltaNet kernels' chunks end (ktrans/kernels/triton/gated_delta.py CHUNK)
EMIT_ALIGN = 64


def check_snapshot_interval(n: int, page_size: int, align: int = EMIT_ALIGN) -> None:
    """--prefix_cache_snapshot_interval: 0 (off) or a multiple of `align` and of the page size."""
    if n < 0 or (n and (n % align or n % page_size)):
        raise ValueError(f"--prefix_cache_snapshot_interval must be 0 (off) or a multiple of {align} and of "
                         f"--page_size {page_size}, got {n}")


@dataclass
class PrefixCacheStats:
    """Running totals for /metrics (vLLM's prefix_cache_queries and _hits count tokens)."""

    queries: int = 0  # admissions that looked the cache up
    query_tokens: int = 0
    hits: int = 0  # of those, the ones that reused something
    hit_tokens: int = 0
    snapshots_taken: int = 0
    evicted_snapshots: int = 0
    evicted_pages: int = 0


class PrefixCache:
    def __init__(self, cache: CacheManager, snapshot_interval: int = 0, align: int = EMIT_ALIGN):
        """snapshot_interval: also snapshot every this many prompt tokens inside a prefill chunk (0: off); a multiple
        of `align` (where the DeltaNet kernels can emit a state; tests of the tree alone use smaller ones) and of the
        page size (a snapshot inside a chunk has no tail)."""
        if cache.num_snapshot_slots <= 0:
            raise ValueError("a prefix cache needs snapshot slots (CacheManager num_snapshot_slots > 0)")
        check_snapshot_interval(snapshot_interval, cache.page_size, align)
        self.cache = cache
        self.page_size = cache.page_size
        self.snapshot_interval = snapshot_interval
        self._emitting: dict[Request, list[tuple[int, int]]] = {}  # slots the next forward writes, per request
        self._seq = itertools.count()
        self.root = Node((), [], None, 0, next(self._seq))
        self._clock = 0
        self._snapshots: set[Snapshot] = set()
        self._holds: dict[Request, Node] = {}  # the node each running request locks
        self._cuts: dict[Request, int] = {}  # where a request's chunk must end so a snapshot covers its branch
        self._refs: Counter[int] = Counter()  # the tree's references per page (node pages and snapshot tails)
        self._pinned: Snapshot | None = None  # the snapshot an admission is about to copy
        self.stats = PrefixCacheStats()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup and hit -------------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], limit: int) -> Match:
        """The deepest snapshot matching `tokens` at a position below `limit` (changes nothing)."""
        P = self.page_size
        node, path = self.root, [self.root]
        best: Snapshot | None = None
        kv_len = 0
        while True:
            d = node.depth
            for tail, snap in node.snapshots.items():
                pos = d + len(tail)
                if pos < limit and (best is None or pos > best.position) and tuple(tokens[d:pos]) == tail:
                    best = snap
            child = node.children.get(tuple(tokens[d : d + P]))
            if child is None:
                break
            n = len(child.pages)
            j = 1
            while j < n and tuple(tokens[d + j * P : d + (j + 1) * P]) == child.key[j * P : (j + 1) * P]:
                j += 1
            kv_len = d + j * P
            if j < n:
                break
            node = child
            path.append(node)
        if best is None:
            return Match(self.root, 0, [], None, kv_len)
        pages = [p for n in path[1 : path.index(best.node) + 1] for p in n.pages]
        return Match(best.node, best.position, pages, best, kv_len)

    def attach(self, req: Request, match: Match) -> None:
        """Account for the lookup at an admission; on a hit, take a reference on the shared pages (req.pages starts
        with them, and whatever the scheduler allocates follows) and lock the hit node."""
        s = self.stats
        s.queries += 1
        s.query_tokens += req.num_tokens
        if (cut := match.cut(req.num_tokens)) is not None:
            self._cuts[req] = cut
        if match.snapshot is None:
            return
        s.hits += 1
        s.hit_tokens += match.num_tokens
        self.cache.incref(match.pages)
        req.pages = list(match.pages)
        self._hold(req, match.node)
        now = self._tick()
        match.snapshot.last_use = now
        n: Node | None = match.node
        while n is not None:
            n.last_use = now
            n = n.parent

    def pin(self, match: Match, by: int = 1) -> None:
        """Lock (by=1) or unlock (by=-1) a match's node and snapshot while the scheduler makes room for its
        request: eviction must not take the pages it is about to share nor the state it is about to copy."""
        match.node.lock += by
        self._pinned = match.snapshot if by > 0 else None

    def restore(self, req: Request, match: Match) -> None:
        """After the scheduler gave the request its slot and its own pages: the snapshot into its slot, the tail's
        KV rows into its first own page, and the request computes from the hit on."""
        snap = match.snapshot
        assert snap is not None and req.slot is not None
        self.cache.copy_slot(snap.slot, req.slot)
        if snap.tail:
            self.cache.copy_page_rows(snap.page, req.pages[len(match.pages)], len(snap.tail))
        req.num_computed_tokens = match.num_tokens

    def waits_for_branch(self, req: Request, match: Match) -> bool:
        """Whether another request is computing, from before it, the very snapshot this one would cut at: then
        waiting a step or two for it saves recomputing the prefix (eight requests under one system prompt)."""
        cut = match.cut(req.num_tokens)
        if cut is None:
            return False
        return any(c == cut and other.num_computed_tokens < c and other.all_token_ids[:c] == req.all_token_ids[:c]
                   for other, c in self._cuts.items() if other is not req)

    def clip(self, req: Request, n: int) -> int:
        """n, or fewer so that the chunk ends at the request's branch point (see the module's note)."""
        cut = self._cuts.get(req)
        if cut is None:
            return n
        start = req.num_computed_tokens
        if cut <= start:
            del self._cuts[req]
            return n
        return min(n, cut - start)

    # ---- taking snapshots -----------------------------------------------------------------------------------------
    def emits_for(self, req: Request, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """Where a prefill chunk [start, end) also emits its DeltaNet state, as (position, snapshot slot) pairs for
        SeqChunk.emit: every multiple of --prefix_cache_snapshot_interval inside the chunk, within the prompt, that
        the tree holds no snapshot at yet. The slots are taken now (the forward writes them); on_computed hangs
        them in the tree, release gives back what a failed step left."""
        n = self.snapshot_interval
        if not n or end - start <= 1:
            return ()
        out = []
        tokens = req.all_token_ids
        for pos in range((start // n + 1) * n, min(end, req.num_prompt_tokens + 1), n):
            if pos >= end or self._has_snapshot(tokens, pos):
                continue
            slot = self._snapshot_slot()
            if slot is None:
                break
            out.append((pos, slot))
        if out:
            self._emitting.setdefault(req, []).extend(out)
        return tuple(out)

    def _has_snapshot(self, tokens: list[int], pos: int) -> bool:
        """Whether the tree holds a snapshot at exactly tokens[:pos] (pos a multiple of the page size)."""
        P, node, i = self.page_size, self.root, 0
        while i < pos:
            child = node.children.get(tuple(tokens[i: i + P]))
            if child is None or child.depth > pos or tuple(tokens[i: child.depth]) != child.key:
                return False
            node, i = child, child.depth
        return () in node.snapshots

    def on_computed(self, req: Request, start: int, end: int) -> None:
        """A chunk [start, end) of the request is computed: the states it emitted go into the tree, and a prefill
        chunk's end gets a snapshot; decode steps (one token past the prompt) do not, the reply's end gets one at
        release."""
        pending = self._emitting.pop(req, None)
        for pos, slot in pending or ():
            self._insert(req, pos, slot)
        if end - start > 1 or end <= req.num_prompt_tokens:
            self._insert(req, end)

    def release(self, req: Request, keep: bool) -> None:
        """The request lets go of its memory (finished, aborted or preempted): when `keep`, its computed tokens go
        into the tree first (pages, and a snapshot at their end); then its lock goes."""
        self._cuts.pop(req, None)
        for _pos, slot in self._emitting.pop(req, ()):  # its step did not complete: nothing was written there
            self.cache.free_slot(slot)
        if keep and req.slot is not None and req.num_computed_tokens > 0:
            self._insert(req, req.num_computed_tokens)
        node = self._holds.pop(req, None)
        if node is not None:
            node.lock -= 1
            self._prune(node)

    def _insert(self, req: Request, end: int, filled: int | None = None) -> None:
        """Tokens [0, end) of the request: its whole pages into the tree (where the tree lacks them), a snapshot of
        its slot at `end` (or the snapshot slot `filled`, which the forward wrote: an emitted state), and its lock
        moved to the node the snapshot hangs on."""
        P, tokens = self.page_size, req.all_token_ids
        k = end // P
        node, i, now = self.root, 0, self._tick()
        while i < k:
            child = node.children.get(tuple(tokens[i * P : (i + 1) * P]))
            if child is None:
                pages = req.pages[i:k]
                self._take(pages)
                child = Node(tuple(tokens[i * P : k * P]), list(pages), node, k * P, next(self._seq))
                node.children[child.key[:P]] = child
                node, i = child, k
            else:
                n = len(child.pages)
                j = 1
                while j < n and i + j < k and tuple(tokens[(i + j) * P : (i + j + 1) * P]) == \
                        child.key[j * P : (j + 1) * P]:
                    j += 1
                node = self._split(child, j) if j < n else child
                i += j
            node.last_use = now
        self._hold(req, node)
        tail = tuple(tokens[k * P : end])
        snap = node.snapshots.get(tail)
        if snap is not None and filled is not None:
            self.cache.free_slot(filled)  # taken meanwhile (another request emitted or ended there)
        if snap is None:
            slot = self._snapshot_slot() if filled is None else filled
            if slot is None:
                return
            page = req.pages[k] if tail else None
            if page is not None:
                self._take([page])
            if filled is None:
                self.cache.copy_slot(req.slot, slot)
            snap = node.snapshots[tail] = Snapshot(node, tail, slot, page)
            self._snapshots.add(snap)
            self.stats.snapshots_taken += 1
        snap.last_use = now

    def _split(self, node: Node, j: int) -> Node:
        """Cut node's edge after j pages: a new node takes the upper part; `node` keeps the lower part, and with it
        its identity (locks and snapshots belong to its end, which does not move)."""
        P = self.page_size
        parent = node.parent
        upper = Node(node.key[: j * P], node.pages[:j], parent, node.depth - len(node.key) + j * P, next(self._seq),
                     last_use=node.last_use)
        parent.children[upper.key[:P]] = upper
        node.key, node.pages, node.parent = node.key[j * P :], node.pages[j:], upper
        upper.children[node.key[:P]] = node
        return upper

    def _hold(self, req: Request, node: Node) -> None:
        old = self._holds.get(req)
        if old is node:
            return
        node.lock += 1
        self._holds[req] = node
        if old is not None:
            old.lock -= 1
            self._prune(old)

    def _snapshot_slot(self) -> int | None:
        if self.cache.num_free_snapshot_slots == 0:
            if not self._snapshots:
                return None
            self._drop_snapshot(min(self._snapshots, key=lambda s: (s.last_use, s.node.seq, s.tail)))
            self.stats.evicted_snapshots += 1
        return self.cache.alloc_snapshot_slot()

    def _drop_snapshot(self, snap: Snapshot) -> None:
        del snap.node.snapshots[snap.tail]
        self._snapshots.discard(snap)
        self.cache.free_slot(snap.slot)
        if snap.page is not None:
            self._give([snap.page])
        self._prune(snap.node)

    # ---- eviction -------------------------------------------------------------------------------------------------
    def _evictable(self, node: Node) -> bool:
        return node is not self.root and node.lock == 0 and not node.children

    def _remove(self, node: Node) -> list[int]:
        """Drop a leaf with its snapshots; the pages freed by it."""
        freed = []
        for snap in list(node.snapshots.values()):
            del node.snapshots[snap.tail]
            self._snapshots.discard(snap)
            self.cache.free_slot(snap.slot)
            if snap.page is not None:
                freed += self._give([snap.page])
        del node.parent.children[node.key[: self.page_size]]
        return freed + self._give(node.pages)

    def _take(self, pages: list[int]) -> None:
        self.cache.incref(pages)
        self._refs.update(pages)

    def _give(self, pages: list[int]) -> list[int]:
        """The tree's reference on each page goes; returns the pages that are free now."""
        freed = self.cache.decref(pages)
        self._refs.subtract(pages)
        for p in pages:
            if self._refs[p] == 0:
                del self._refs[p]
        return freed

    def _prune(self, node: Node | None) -> None:
        """Remove leaves that hold no snapshot and no lock, from `node` up: no hit can use their pages."""
        while node is not None and self._evictable(node) and not node.snapshots:
            parent = node.parent
            self._remove(node)
            node = parent

    def _victims(self) -> tuple[list[Node], list[Snapshot]]:
        """What page eviction may take: unlocked subtrees (leaf by leaf), and the snapshots holding a tail page
        elsewhere (on the root, on inner or locked nodes: dropping a snapshot never hurts a running request, which
        copied its state at admission), but the pinned one."""
        nodes: list[Node] = []

        def walk(n: Node) -> bool:  # whether n's subtree has no lock
            free = all([walk(c) for c in n.children.values()]) and n.lock == 0
            if free and n is not self.root:
                nodes.append(n)
            return free

        walk(self.root)
        inside = set(nodes)
        snaps = sorted((x for x in self._snapshots if x.page is not None and x.node not in inside
                        and x is not self._pinned), key=lambda x: (x.node.seq, x.tail))
        return nodes, snaps

    def reclaimable_pages(self) -> int:
        """Pages that evict_pages could free (those no request also holds)."""
        nodes, snaps = self._victims()
        held: Counter[int] = Counter()
        for n in nodes:
            held.update(n.pages)
            held.update(x.page for x in n.snapshots.values() if x.page is not None)
        held.update(x.page for x in snaps)
        return sum(1 for p, k in held.items() if self.cache.refcount(p) == k)

    def evict_pages(self, n: int, slack: int = 0) -> int:
        """Free at least n pages, least recently used first (unlocked leaves with their snapshots, and snapshots
        holding a tail page), or evict nothing when that cannot reach n (so that a request that will not fit
        anyway costs the cache nothing). Up to `slack` more go in the same pass when they can: the walk that
        counts what is reclaimable costs as much as the pages the tree holds, and a full cache under decode
        would otherwise pay it at every page boundary. Returns the pages freed."""
        if n <= 0:
            return 0
        reclaimable = self.reclaimable_pages()
        if reclaimable < n:
            return 0
        n = min(n + slack, reclaimable)
        nodes, snaps = self._victims()
        order = itertools.count()
        heap = [(x.last_use, next(order), x) for x in nodes if self._evictable(x)]
        heap += [(x.last_use, next(order), x) for x in snaps]
        heapq.heapify(heap)
        before = self.cache.num_free_pages
        while self.cache.num_free_pages - before < n and heap:
            _, _, victim = heapq.heappop(heap)
            if isinstance(victim, Snapshot):
                if victim in self._snapshots:
                    self._drop_snapshot(victim)
                    self.stats.evicted_snapshots += 1
                continue
            if victim.parent is None or victim.parent.children.get(victim.key[: self.page_size]) is not victim \
                    or not self._evictable(victim):
                continue  # pruned meanwhile
            parent = victim.parent
            self.stats.evicted_snapshots += len(victim.snapshots)  # a leaf's snapshots go with it
            self._remove(victim)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_use, next(order), parent))
        freed = self.cache.num_free_pages - before
        self.stats.evicted_pages += freed
        return freed

    def flush(self) -> dict:
        """Drop every snapshot, and every node no running request uses. Returns what was freed."""
        before_pages, before_snaps = self.cache.num_free_pages, len(self._snapshots)
        for snap in sorted(self._snapshots, key=lambda s: (s.node.seq, s.tail)):
            self._drop_snapshot(snap)
        for node in sorted(self._nodes(), key=lambda x: -x.depth):
            if node.parent is not None and self._evictable(node):
                self._remove(node)
        return {"pages_freed": self.cache.num_free_pages - before_pages, "snapshots_freed": before_snaps}

    # ---- numbers --------------------------------------------------------------------------------------------------
    def _nodes(self) -> list[Node]:
        out, todo = [], [self.root]
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(n.children.values())
        return out

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_pages(self) -> int:
        """Distinct pages the tree holds a reference on (read from any thread: a len, not a walk)."""
        return len(self._refs)
