"""ForwardBatch: everything one model step needs to know about the sequences in it, and nothing else.

The model runs on flat tokens [T, hidden] of several sequences at once (no padding). Sequence i contributes
seq_lens[i] new tokens at positions cached_lens[i] .. cached_lens[i] + seq_lens[i] - 1; its DeltaNet state lives
in state slot state_slots[i] and its attention KV in the pages of block_tables[i]. A sequence whose cached length
is 0 starts from zero state; otherwise the state in its slot continues (chunked prefill, decode).

The batch also names the phase (prefill or generate) that picks each operator's device and op, and it can hand
out a copy of its index tensors on any device (`on`), so an operator on another device never reads indices across
the bus. While the model runs, `current_batch()` gives the batch to operators whose call carries no batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ktrans.runtime.pools import KVPool, StatePool


PREFILL = "prefill"
GENERATE = "generate"
PHASES = (PREFILL, GENERATE)

_INDEX_FIELDS = ("input_ids", "positions", "state_slots", "block_tables", "slot_mapping", "logits_indices")


@dataclass
class SeqChunk:
    """One sequence's part of a step: the new tokens, what is already cached, and where its memory is."""

    token_ids: list[int]
    cached_len: int
    state_slot: int
    pages: list[int]
    logits: str = "last"  # "last" (next-token logits), "all" (every new token: prompt scoring) or "none"
    # (position, state slot) pairs: after tokens [0, position) the sequence's DeltaNet state is also written to that
    # slot (the prefix cache's snapshots inside a prefill chunk; cached_len < position < cached_len + len(token_ids))
    emit: tuple[tuple[int, int], ...] = ()


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    seq_lens: list[int]          # new tokens per sequence
    cached_lens: list[int]       # tokens already in KV / state per sequence
    state_slots: torch.Tensor    # [B] int64
    block_tables: torch.Tensor   # [B, max_pages] int64, -1 past the end
    slot_mapping: torch.Tensor   # [T] int64: KV row of each new token
    logits_indices: torch.Tensor  # [N] int64: flat token indices whose logits are returned
    kv: KVPool
    states: StatePool
    is_decode: bool = False      # every sequence is a one-token decode step: operators use their generate op
    slots: list[int] = field(default_factory=list)  # state_slots on the host (plan with these, never read the tensor)
    kv_lens_t: torch.Tensor | None = None      # [B] int64 kv_lens on the batch's device (ModelRunner batches)
    cu_seqlens_t: torch.Tensor | None = None   # [B + 1] int64 cu_seqlens on the batch's device (ModelRunner batches)
    kv_len_bucket: int = 0       # decode kernels gather KV up to at least this (a CUDA graph's fixed length)
    num_live: int | None = None  # sequences before the pad rows of a padded decode batch (None: all are live)
    emits: list[tuple[tuple[int, int], ...]] | None = None  # per sequence, SeqChunk.emit (None: no sequence emits)
    _cu: torch.Tensor | None = field(default=None, repr=False)
    _on: dict | None = field(default=None, repr=False)  # device -> copy of this batch there (shared by all copies)

    INDEX_FIELDS = _INDEX_FIELDS

    @property
    def phase(self) -> str:
        """'generate' for a pure decode batch, else 'prefill' (any prefill chunk in the batch)."""
        return GENERATE if self.is_decode else PREFILL

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def on(self, device: str | torch.device) -> "ForwardBatch":
        """This batch with its index tensors on `device`, built once per device per step and then cached.

        Pools are shared, not copied: an operator must run on the device its pool lives on.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.device == device:
            return self
        if self._on is None:
            self._on = {self.device: self}
        if device not in self._on:
            moved = {f: getattr(self, f).to(device) for f in _INDEX_FIELDS}
            moved.update({f: getattr(self, f).to(device) for f in ("kv_lens_t", "cu_seqlens_t")
                          if getattr(self, f) is not None})
            self._on[device] = dataclasses.replace(self, **moved, _cu=self._cu, _on=self._on)
        return self._on[device]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def kv_lens(self) -> list[int]:
        return [c + n for c, n in zip(self.cached_lens, self.seq_lens)]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[B + 1] int64 offsets of each sequence's tokens in the flat batch."""
        if self._cu is None:
            self._cu = torch.tensor([0, *torch.tensor(self.seq_lens).cumsum(0).tolist()], dtype=torch.int64)
        return self._cu

    @property
    def cu_seqlens_host(self) -> list[int]:
        """cu_seqlens as Python ints: what an op's plan reads (no device read in a forward)."""
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    @property
    def max_kv_len(self) -> int:
        """The longest KV length, or the batch's bucket when larger: the length decode kernels are planned for."""
        return max(max(self.kv_lens), self.kv_len_bucket)

    @property
    def decode_seqs(self) -> list[int]:
        """Sequences whose part of the step is one token continuing a cached state (the batched decode path)."""
        return [i for i, (n, c) in enumerate(zip(self.seq_lens, self.cached_lens)) if n == 1 and c > 0]

    @property
    def has_initial_state(self) -> list[bool]:
        return [c > 0 for c in self.cached_lens]

    @contextlib.contextmanager
    def active(self) -> Iterator["ForwardBatch"]:
        """Make this batch `current_batch()` for the duration of one forward (nests; per thread)."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    @classmethod
    def build(cls, chunks: list[SeqChunk], kv: KVPool, states: StatePool, is_decode: bool | None = None,
              device: str | torch.device = "cpu") -> "ForwardBatch":
        """A batch of new tensors (tests, one-off forwards); the engine's ModelRunner writes into fixed buffers."""
        f = flatten(chunks, kv, is_decode)
        width = max(1, max(len(c.pages) for c in chunks))
        tables = torch.full((len(chunks), width), -1, dtype=torch.int64)
        for i, c in enumerate(chunks):
            tables[i, : len(c.pages)] = torch.tensor(c.pages, dtype=torch.int64)
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            input_ids=as_t(f.input_ids), positions=as_t(f.positions), seq_lens=f.seq_lens, cached_lens=f.cached_lens,
            state_slots=as_t(f.slots), block_tables=tables.to(device), slot_mapping=as_t(f.slot_mapping),
            logits_indices=as_t(f.logits_indices), kv=kv, states=states, is_decode=f.is_decode, slots=f.slots,
            emits=f.emits,
        )


@dataclass
class FlatChunks:
    """A step's sequences flattened into host lists: what a ForwardBatch's index tensors are made of."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]      # KV row of each new token
    logits_indices: list[int]
    seq_lens: list[int]
    cached_lens: list[int]
    kv_lens: list[int]
    cu_seqlens: list[int]        # B + 1 offsets
    slots: list[int]             # state slot per sequence
    is_decode: bool
    emits: list[tuple[tuple[int, int], ...]] | None = None  # SeqChunk.emit per sequence, None when none emits


def flatten(chunks: list[SeqChunk], kv: KVPool, is_decode: bool | None = None) -> FlatChunks:
    """Check and flatten a step's sequences. ValueError says what does not fit."""
    if not chunks:
        raise ValueError("a ForwardBatch needs at least one sequence")
    page = kv.page_size
    f = FlatChunks([], [], [], [], [], [], [], [0], [], False)
    for c in chunks:
        n = len(c.token_ids)
        if n == 0:
            raise ValueError("a sequence in a ForwardBatch has no new tokens")
        end = c.cached_len + n
        if kv.pages_for(end) > len(c.pages):
            raise ValueError(f"sequence needs {kv.pages_for(end)} KV pages for {end} tokens, has {len(c.pages)}")
        offset = f.cu_seqlens[-1]
        f.input_ids.extend(c.token_ids)
        p = range(c.cached_len, end)
        f.positions.extend(p)
        f.slot_mapping.extend(c.pages[t // page] * page + t % page for t in p)
        if c.logits == "last":
            f.logits_indices.append(offset + n - 1)
        elif c.logits == "all":
            f.logits_indices.extend(range(offset, offset + n))
        elif c.logits != "none":
            raise ValueError(f"SeqChunk.logits must be 'last', 'all' or 'none', got {c.logits!r}")
        f.seq_lens.append(n)
        f.cached_lens.append(c.cached_len)
        f.kv_lens.append(end)
        f.cu_seqlens.append(offset + n)
        f.slots.append(c.state_slot)
        if c.emit:
            for pos, _slot in c.emit:
                if not c.cached_len < pos < end:
                    raise ValueError(f"a state emitted at position {pos} lies outside the chunk's open span "
                                     f"({c.cached_len}, {end})")
            if f.emits is None:
                f.emits = [()] * (len(f.slots) - 1)
        if f.emits is not None:
            f.emits.append(tuple(c.emit))
    f.is_decode = all(n == 1 and c > 0 for n, c in zip(f.seq_lens, f.cached_lens)) if is_decode is None else is_decode
    return f


# A context variable, not a global: the engine loop may run in its own thread, each with its own batch.
_CURRENT: ContextVar[ForwardBatch | None] = ContextVar("ktrans_current_batch", default=None)


def current_batch() -> ForwardBatch | None:
    """The batch of the forward running in this thread, or None outside one."""
    return _CURRENT.get()


def current_phase() -> str:
    """Phase of the running forward; 'prefill' outside one (a direct call, e.g. in a test)."""
    batch = _CURRENT.get()
    return PREFILL if batch is None else batch.phase
