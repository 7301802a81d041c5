"""CPU experts on a CUDA stream: a MoE layer's routed experts computed by the CPU pool, enqueued in GPU order.

When the rest of the model runs on a GPU, a CPU expert layer used to copy its inputs to the host with a blocking
`.to("cpu")`, wait for the pool in Python and copy the result back: two host syncs per layer, and the GPU idle
while Python waited. Here the layer's work is put on the CUDA stream instead:

    x, ids, weights  --DtoH copy-->  pinned staging  --host fn: pool.submit-->   (GPU runs the shared expert)
    host fn: pool.wait  -->  pinned out  --HtoD copy-->  routed output on the GPU

The host functions are the driver's cuLaunchHostFunc (resolved at run time by ktrans._cpu, so nothing here needs a
CUDA toolkit); they read and write only the pinned buffers, at addresses fixed for the life of the model, so a CUDA
graph captures the whole sequence and replays it. The live row count is read from a host cell when the submit runs:
a padded decode batch (a graph bucket) writes its real batch size there before the replay, and pad rows cost the
CPU nothing.

The copies around the host functions are two Triton launches that read and write the pinned staging in place
(ktrans.kernels.triton.stage): one before the submit, one after the wait, where torch's copies take six operations a
layer. On the H200 at full size (doc/benchmarks.md, session 16) that took a batch-1 decode token from 17.9 to 16.1
ms under the serve rules (the GPU's share 3.90 -> 3.49 ms, device operations 1,128 -> 888).
`KTRANS_STAGE_KERNELS=0` selects torch's copies (ktrans.kernels.torch.stage).

`Staging` holds one set of pinned buffers for every layer of a model: layer L+1's copies follow layer L's wait on
the stream, so they never overlap. Ordering rule: a forward must have finished (the engine's step ends by reading
the sampled tokens) before the next one writes the row cell; ModelRunner.prepare waits for the previous forward's
end for that reason.
"""
from __future__ import annotations

import os
import weakref

import torch

from ktrans import _cpu
from ktrans.kernels import cpu

STAGE_KERNELS = os.environ.get("KTRANS_STAGE_KERNELS", "1") == "1"  # read when a layer's StreamMoE is made
# One host function a layer (the submit and the wait together, enqueued by sync) instead of two: a driver round trip
# less, but the GPU work between submit and sync (the shared expert) no longer overlaps the CPU's. Not measured yet:
# off by default (KTRANS_STREAM_ONE_HOST_FN=1 turns it on).
ONE_HOST_FN = os.environ.get("KTRANS_STREAM_ONE_HOST_FN", "0") == "1"
# The flag path: no host functions. The stage-in kernel ends by storing a sequence number into a pinned `go` cell,
# the relay thread of ktrans._cpu (polling those cells) runs the layer's submit and wait and stores the number into
# `done`, and a one-program kernel on the stream polls `done` before the stage-out (ktrans.kernels.triton.stage).
# Needs the stage kernels. On the H200 at full size (doc/benchmarks.md, session 17) a batch-1 serve token took 15.0
# and 14.6 ms this way against 15.8 with the host functions, in one call; KTRANS_STREAM_FLAGS=0 selects those.
FLAGS = os.environ.get("KTRANS_STREAM_FLAGS", "1") == "1"
_STAGING: dict[tuple, "Staging"] = {}
_LAST_END: list = [None]  # the end of the last forward on a GPU (a CUDA event; ModelRunner.mark_end: note_end)
_ALL: "weakref.WeakSet[Staging]" = weakref.WeakSet()  # every staging alive, grown ones included


def available() -> tuple[bool, str]:
    """(True, '') where CPU expert work can be enqueued on CUDA streams here; else (False, why)."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    return _cpu.stream_hooks_available()


class Staging:
    """Pinned host buffers for up to `max_rows` tokens of one hidden size and top-k: x, ids, weights, out, rows."""

    def __init__(self, max_rows: int, hidden: int, k: int, pinned: bool = True):
        if max_rows <= 0:
            raise ValueError(f"Staging: max_rows must be positive, got {max_rows}")
        self.max_rows, self.hidden, self.k = max_rows, hidden, k
        self.x = torch.zeros(max_rows, hidden, dtype=torch.float32, pin_memory=pinned)
        self.ids = torch.full((max_rows, k), -1, dtype=torch.int64, pin_memory=pinned)
        self.weights = torch.zeros(max_rows, k, dtype=torch.float32, pin_memory=pinned)
        self.out = torch.zeros(max_rows, hidden, dtype=torch.float32, pin_memory=pinned)
        self.rows = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self._rows_np = self.rows.numpy()
        _ALL.add(self)

    @classmethod
    def shared(cls, hidden: int, k: int, max_rows: int) -> "Staging":
        """The process's staging for (hidden, k), grown to hold max_rows. A grown staging is a new object: calls
        made on the old one keep it (and its addresses) alive, so a captured graph never loses its buffers."""
        key = (hidden, k)
        s = _STAGING.get(key)
        if s is None or s.max_rows < max_rows:
            s = _STAGING[key] = cls(max(max_rows, 2 * s.max_rows if s else max_rows), hidden, k)
        return s

    def set_rows(self, n: int) -> None:
        """The live row count the next submits read (a graph replay's real batch size). A forward still running on
        the GPU reads the cell when its layers' submits run: a new count waits for the last forward's end first
        (one runner waits for its own before it prepares a step; two runners on one model, as tests have, would
        otherwise give the first one's late layers the second one's count)."""
        if not 0 <= n <= self.max_rows:
            raise ValueError(f"live rows {n} outside [0, {self.max_rows}]")
        if self._rows_np[0] != n:
            _wait_last_end()
        self._rows_np[0] = n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.ids, self.weights, self.out, self.rows))


def note_end(event) -> None:
    """The last forward enqueued ends at `event` (any runner's): a row count that changes waits for it."""
    _LAST_END[0] = event


def _wait_last_end() -> None:
    end = _LAST_END[0]
    if end is not None and not end.query():
        end.synchronize()


def set_live_rows(n: int) -> None:
    """Before a graph replay: the live rows every CPU expert layer's submit will read (and, on the flag path, the
    relay thread woken to poll for the replay's layers)."""
    for s in list(_ALL):
        s.set_rows(min(n, s.max_rows))
    if _FLAGGED:
        _cpu.relay_kick(max(s.moe.pool.spin_us for s in list(_FLAGGED)))


_FLAGGED: "weakref.WeakSet[StreamMoE]" = weakref.WeakSet()  # the StreamMoEs on the flag path


def _drop_flags(call, flags) -> None:
    """Off the flag path (a StreamMoE collected: a grown staging's, or at exit). The GPU may still have its stage-ins
    queued (the host runs ahead): the last forward ends first, so none rings a cell nobody serves or that the host
    allocator has handed out again."""
    try:
        _wait_last_end()
    except Exception:  # at interpreter exit CUDA may be gone already; nothing is queued then
        pass
    call.drop_flags()  # returns once the relay is done with call and flags; both are released after


class StreamMoE:
    """One CPU MoE layer (a ktrans.kernels.cpu.CPUMoE) called from a CUDA stream through a Staging."""

    def __init__(self, moe, staging: Staging, name: str = "MoE"):
        if staging.hidden != moe.hidden:
            raise ValueError(f"{name}: staging hidden {staging.hidden} != the layer's {moe.hidden}")
        self.moe, self.staging, self.name = moe, staging, name
        moe.pool.spin_us = max(moe.pool.spin_us, cpu.stream_spin_us())  # see cpu.STREAM_SPIN_US
        s = staging
        # the copies as two kernels on the pinned staging (ktrans.kernels.triton.stage); else torch's copies
        self.kernels = STAGE_KERNELS and s.x.is_pinned()
        if self.kernels:
            from ktrans.kernels.triton import stage
        else:
            from ktrans.kernels.torch import stage
        self.stage = stage
        self.one_host_fn = ONE_HOST_FN
        self.call = _cpu.StreamCall(moe._moe, s.x.data_ptr(), s.hidden, s.ids.data_ptr(), s.weights.data_ptr(), s.k,
                                    s.out.data_ptr(), s.hidden, s.max_rows, s.rows.data_ptr())
        self._rows = 0
        # the flag path: [go, done, GPU timed out] in pinned host memory, [arrived, seq] on the layer's device
        # The relay polls for the GPU's rings as the pool's workers poll for jobs: where they may not (a pool whose
        # threads share cores, or KTRANS_CPU_SPIN_US=0), it would sleep between layers, and the host functions serve.
        self.flagged = FLAGS and self.kernels and moe.pool.spin_us > 0
        self.ring: torch.Tensor | None = None
        if self.flagged:
            self.flags = torch.zeros(3, dtype=torch.int64, pin_memory=True)
            self.call.use_flags(self.flags.data_ptr())
            weakref.finalize(self, _drop_flags, self.call, self.flags)
            _FLAGGED.add(self)

    def check(self) -> None:
        """Raise what a host function of an earlier forward reported (its output was not computed)."""
        err = self.call.take_error()
        if err:
            raise RuntimeError(f"{self.name}: the CPU experts failed on the CUDA stream: {err}")
        if self.flagged and int(self.flags[2]):
            seq, self.flags[2] = int(self.flags[2]), 0
            raise RuntimeError(f"{self.name}: the GPU stopped waiting for the CPU experts' call {seq} (the relay "
                               f"thread never stored it as done; the layer's output is wrong)")

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               live: int | None = None) -> None:
        """Enqueue on the current stream: copies of the inputs into the staging, then the pool's submit of the first
        `live` rows (default all; a padded batch's live sequences, so its eager step computes what its replays do)."""
        if topk_ids.shape != (x.shape[0], self.staging.k):
            raise ValueError(f"{self.name}: topk_ids {tuple(topk_ids.shape)}, expected ({x.shape[0]}, "
                             f"{self.staging.k})")
        capturing = self._begin(x, live)
        s = self.staging
        if self.flagged:
            self.stage.stage_in(x, topk_ids, topk_weights, s.x, s.ids, s.weights, self.ring, self.flags)
            if not capturing:
                _cpu.relay_kick(self.moe.pool.spin_us)
            return
        self.stage.stage_in(x, topk_ids, topk_weights, s.x, s.ids, s.weights)
        if not self.one_host_fn:  # else sync enqueues the submit with the wait
            self.call.enqueue_submit(torch.cuda.current_stream(x.device).cuda_stream)

    def submit_logits(self, x: torch.Tensor, logits: torch.Tensor, renorm: bool, live: int | None = None) -> None:
        """submit() with the routing done here: the router's top-k of `logits` [T, E] runs inside the stage-in
        launch and writes the ids and weights straight into the staging (the flag path only: `flagged`)."""
        if not self.flagged:
            raise RuntimeError(f"{self.name}: submit_logits needs the flag path (KTRANS_STREAM_FLAGS=1)")
        capturing = self._begin(x, live)
        s = self.staging
        self.stage.route_stage_in(x, logits, s.k, renorm, s.x, s.ids, s.weights, self.ring, self.flags)
        if not capturing:
            _cpu.relay_kick(self.moe.pool.spin_us)

    def _begin(self, x: torch.Tensor, live: int | None) -> bool:
        """A call's checks, its live rows (eager) and, on the flag path, the ring counter; True while capturing."""
        self.check()
        s, t = self.staging, x.shape[0]
        if t > s.max_rows:
            raise ValueError(f"{self.name}: {t} tokens, the CPU experts' staging holds {s.max_rows}")
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            s.set_rows(t if live is None else live)  # eager; a replay's rows are set by whoever replays
        self._rows = t
        if self.flagged and (self.ring is None or self.ring.device != x.device):
            if capturing:  # the counter must outlive the graph, not sit in its private pool
                raise RuntimeError(f"{self.name}: the flag path's first call is being captured; run it eagerly "
                                   f"first (ModelRunner's warm-up does)")
            if self.ring is not None:  # a new device: the old one's calls end first, and numbering goes on
                torch.cuda.synchronize(self.ring.device)
            # [arrived, seq]: seq continues from the last go (the relay serves a number it has not seen)
            self.ring = torch.tensor([0, int(self.flags[0])], dtype=torch.int64).to(x.device)
        return capturing

    def sync_staged(self) -> torch.Tensor:
        """The flag path's poll only: the output rows [T, hidden] fp32 as they lie in the pinned staging, for a
        kernel after it on the stream to read in place (volatile loads; the MoE block's gated sum), valid until the
        next call's stage-in."""
        if not self.flagged:
            raise RuntimeError(f"{self.name}: sync_staged needs the flag path (KTRANS_STREAM_FLAGS=1)")
        self.stage.cpu_wait(self.ring, self.flags)
        return self.staging.out[: self._rows]

    def sync(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Enqueue the pool's wait (with one_host_fn, the submit and the wait), then the copy of the output to
        `device`: [T, hidden] in `dtype`."""
        if self.flagged:
            self.stage.cpu_wait(self.ring, self.flags)
            return self.stage.stage_out(self.staging.out, self._rows, device, dtype, flagged=True)
        stream = torch.cuda.current_stream(device).cuda_stream
        (self.call.enqueue_submit_wait if self.one_host_fn else self.call.enqueue_wait)(stream)
        return self.stage.stage_out(self.staging.out, self._rows, device, dtype)
