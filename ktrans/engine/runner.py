"""ModelRunner: between the engine and the model. It turns a step's sequences into a ForwardBatch whose index
tensors live in buffers allocated once, plans the operators, and runs the forward.

Every index tensor of a batch (input ids, positions, KV slot mapping, logits indices, state slots, block tables,
kv lengths, cu_seqlens) is a view at a fixed offset of one flat int64 buffer on the model's device. A step writes
them into a pinned host copy of that buffer and moves the used prefix with one asynchronous copy, so the forward
never reads an index back from the device, and the same addresses serve every step (what a captured CUDA graph
needs: `run_decode(batch_size)` then replays at fixed addresses). The host copy of the batch goes to operators that
run on the CPU (`batch.on("cpu")`), so they never copy indices back from the GPU either.

Before the forward, `plan(batch)` is called once on every operator that has one: attention metadata, DeltaNet's
split of decode rows from prefill sequences, whatever an op derives from the batch's host lists. A decode-only
step then does no host<->device synchronisation inside the forward.

On a GPU, decode-only steps replay CUDA graphs (`ktrans.engine.graphs.DecodeGraphs`): the batch is padded to a
bucket of sequences (1, 2, 4, 8, ...) whose pad rows write only to the pools' pad page and pad slot, and to a
bucket of KV length, and each (sequences, KV length) bucket is captured once, the first time it is seen.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ktrans.kernels import cpu_stream
from ktrans.runtime.batch import GENERATE, ForwardBatch, SeqChunk, flatten
from ktrans.runtime.pools import KVPool, StatePool

log = logging.getLogger(__name__)

# Fields of the flat index buffer, in order. T: tokens, B: sequences, W: block table width (pages per sequence).
_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices", "state_slots", "kv_lens", "cu_seqlens",
           "block_tables")


def plan_operators(model: nn.Module) -> list[nn.Module]:
    """The modules whose plan(batch) a step calls: the operators that plan something, themselves or through one of
    their ops (an op's plan is its operator's business). The rest (linears, norms, ...: ~14 of a layer's operators)
    would be a Python call each per step for nothing, ~700 at the 80B's 48 layers."""
    from ktrans.operators.base import BaseOperator, Op

    def plans(m: BaseOperator) -> bool:
        return type(m).plan is not BaseOperator.plan or any(type(op).plan is not Op.plan for op in m.impl.values())

    return [m for m in model.modules() if isinstance(m, BaseOperator) and callable(getattr(m, "plan", None))
            and plans(m)]


def model_gpus(model: nn.Module) -> list[torch.device]:
    """The GPUs the model computes on, cuda:0 first."""
    from ktrans.inject import compute_devices

    return sorted((d for d in compute_devices(model) if d.type == "cuda"), key=lambda d: d.index or 0)


def operator_ops(model: nn.Module, method: str, phase: str | None = None) -> list:
    """Every distinct op of the model's operators that has `method` (reserve: sizes fixed before capture; check:
    failures reported from the CUDA stream); with `phase`, only the ops that run that phase."""
    from ktrans.operators.base import BaseOperator

    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, BaseOperator):
            for p, op in m.impl.items():
                if (phase is None or p == phase) and id(op) not in seen and callable(getattr(op, method, None)):
                    seen.add(id(op))
                    out.append(op)
    return out


# KTRANS_SPIN_WAIT=1: wait for a forward's end by polling, as a bare CUDA copy back does (for comparison)
_SPIN_WAIT = os.environ.get("KTRANS_SPIN_WAIT", "0") not in ("", "0")
# KTRANS_CPU_DECODE (default 1): a CPU-only model's decode steps run ktrans.engine.cpu_decode's flat loop (the same
# ops and kernels; 0: the module forward). Measured alternating in one process at full size on the 16-core Xeon
# (scripts/cpu_decode_ab.py, doc/benchmarks.md session 15), median ms a token, torch's OpenMP threads spinning /
# passive: module forward 80.5 / 63.3, flat step 185.2 / 70.0, flat step with torch on one thread 61.4 / 52.1. The
# flat step's slowdown of sessions 12-13 was torch's --cpu_infer OpenMP threads, woken by its many small ops,
# fighting the pool's pinned, polling workers for the same cores.
_CPU_DECODE = os.environ.get("KTRANS_CPU_DECODE", "1") not in ("", "0")
# torch's threads during a decode step on the CPU (None: torch's own, --cpu_infer). Its ops there are views and
# small ops (scripts/cpu_decode_ops.py: none but the logits' cast reaches its grain size) while the experts and
# linears run on the CPU pool: one thread (figures above; on the 2-core dev box 0.97-1.39x, noise).
DECODE_TORCH_THREADS: int | None = 1


def caller_cpu() -> int | None:
    """The core the CPU pool leaves to the calling thread (the allowed cores less those its workers are pinned to),
    or None when the pool is not pinned or leaves none."""
    from ktrans.kernels import cpu

    pool = cpu.get_pool()
    free = sorted(set(os.sched_getaffinity(0)) - set(pool.worker_cpus)) if pool.pinned else []
    return free[0] if free else None


class ModelRunner:
    """Builds batches into preallocated buffers and runs the model. One per engine (and per model)."""

    def __init__(self, model: nn.Module, kv: KVPool, states: StatePool, max_num_seqs: int, max_num_tokens: int,
                 max_pages_per_seq: int, device: torch.device | str | None = None, cuda_graph: bool = False):
        if min(max_num_seqs, max_num_tokens, max_pages_per_seq) <= 0:
            raise ValueError("ModelRunner sizes must be positive")
        self.model = model
        self.kv, self.states = kv, states
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_num_seqs, self.max_num_tokens, self.width = max_num_seqs, max_num_tokens, max_pages_per_seq
        t, b, w = max_num_tokens, max_num_seqs, max_pages_per_seq
        sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "logits_indices": t, "state_slots": b,
                 "kv_lens": b, "cu_seqlens": b + 1, "block_tables": b * w}
        self.offsets, n = {}, 0
        for f in _FIELDS:
            self.offsets[f] = n
            n += sizes[f]
        self.size = n
        pinned = self.device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=pinned)
        self.dev = torch.zeros(n, dtype=torch.int64, device=self.device) if pinned else self.host
        # A model split over several GPUs: each other GPU its own buffer, filled from the pinned host copy by its own
        # asynchronous copy, so its operators read their step's indices locally (batch.on(dev) finds them there).
        self.gpus = model_gpus(model) if pinned else []
        self.others = {d: torch.zeros(n, dtype=torch.int64, device=d) for d in self.gpus if d != self.device}
        self._host_np = self.host.numpy()
        self._copied: list[torch.cuda.Event] = []  # the last host->device copies, before the host copy is reused
        self._ended: torch.cuda.Event | None = None   # the end of the last forward on the stream
        self._planners = plan_operators(model)
        self._checked = operator_ops(model, "check")
        # ops that plan on the host into buffers a CUDA graph reads (KAttentionFlashInfer): planned before each replay
        # (generate-phase ops only: a replay runs decode steps)
        self._replanners = operator_ops(model, "replan", GENERATE)
        for op in operator_ops(model, "reserve"):  # buffers an op needs per token, at their final addresses
            op.reserve(max_num_tokens)
        for op in operator_ops(model, "reserve_seqs"):  # and per decode row (KAttentionFlashInfer's workspace)
            op.reserve_seqs(max_num_seqs)
        self.graphs = None
        self.cpu_decode = None  # ktrans.engine.cpu_decode.CPUDecodeStep where the model is all on the CPU ops it covers
        self.decode_threads = DECODE_TORCH_THREADS if self.device.type == "cpu" else None
        # the caller thread pinned to the core the CPU pool leaves it during CPU decode steps (off; the A/B in
        # scripts/cpu_decode_ab.py: can the scheduler put it beside a polling, pinned worker?)
        self.decode_cpu: int | None = None
        if self.device.type == "cpu" and _CPU_DECODE:
            from ktrans.engine.cpu_decode import CPUDecodeStep

            self.cpu_decode, why = CPUDecodeStep.build(model)
            if self.cpu_decode is None:
                log.debug("decode steps run the module forward: %s", why)
        if cuda_graph:
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need the model's batches on a GPU, not {self.device} "
                                 f"(--no-use_cuda_graph)")
            from ktrans.engine.graphs import DecodeGraphs, graph_blockers

            blockers = graph_blockers(model)
            if len(self.gpus) > 1:
                # A capture records one device's stream; a step that hands off to another GPU would need a graph
                # per device segment, joined by events: not built yet.
                log.warning("decode runs without CUDA graphs: the model spans %d GPUs (%s), and graphs are captured "
                            "on one device only", len(self.gpus), ", ".join(map(str, self.gpus)))
            elif blockers:
                log.warning("decode runs without CUDA graphs: %s compute on the CPU in the generate phase, outside "
                            "what a graph replays (place them on the GPU to capture decode)",
                            ", ".join(blockers[:4]) + (f" and {len(blockers) - 4} more" if len(blockers) > 4 else ""))
            else:
                self.graphs = DecodeGraphs(self)

    # ---- building a batch -----------------------------------------------------------------------------------------
    def prepare(self, chunks: list[SeqChunk], is_decode: bool | None = None, pad_to: int | None = None,
                kv_len_bucket: int = 0) -> ForwardBatch:
        """The step's ForwardBatch on the model's device, its index tensors views of the runner's buffers.

        pad_to: a decode step padded to that many sequences; each pad row is one token at position 1 of the pools'
        pad page and pad slot, so it writes nowhere a live sequence reads. kv_len_bucket: the KV length decode
        kernels are planned for (at least the longest sequence's)."""
        live = len(chunks)
        if pad_to is not None and pad_to > live:
            pad = SeqChunk([0], 1, self.states.pad_slot, [self.kv.pad_page])
            chunks = list(chunks) + [pad] * (pad_to - live)
            is_decode = True
        b = len(chunks)
        if b > self.max_num_seqs:
            raise ValueError(f"{b} sequences in a step, the runner holds {self.max_num_seqs} (--max_batch_size)")
        f = flatten(chunks, self.kv, is_decode)
        for c in chunks:
            if len(c.pages) > self.width:
                raise ValueError(f"sequence holds {len(c.pages)} KV pages, the runner's block tables hold "
                                 f"{self.width} (--max_model_len)")
        t = f.cu_seqlens[-1]
        if t > self.max_num_tokens:
            raise ValueError(f"{t} tokens in a step, the runner holds {self.max_num_tokens} (--chunk_size)")

        for copied in self._copied:
            copied.synchronize()  # the previous step's copies have left the host buffer (they always have by now)
        if self._ended is not None:
            # Host cells the last forward's stream work reads (the CPU experts' live rows) are rewritten next: an
            # engine step has sampled, so this never waits there.
            self._ended.synchronize()
        h, o = self._host_np, self.offsets
        for name, values in (("input_ids", f.input_ids), ("positions", f.positions), ("slot_mapping", f.slot_mapping),
                             ("logits_indices", f.logits_indices), ("state_slots", f.slots),
                             ("kv_lens", f.kv_lens), ("cu_seqlens", f.cu_seqlens)):
            h[o[name]: o[name] + len(values)] = values
        tables = h[o["block_tables"]: o["block_tables"] + b * self.width].reshape(b, self.width)
        tables.fill(-1)
        for i, c in enumerate(chunks):
            tables[i, : len(c.pages)] = c.pages
        used = o["block_tables"] + b * self.width
        if self.dev is not self.host:
            self._copied = []
            for dev, buf in ((self.device, self.dev), *self.others.items()):
                buf[:used].copy_(self.host[:used], non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dev))
                self._copied.append(event)

        sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "logits_indices": len(f.logits_indices),
                 "state_slots": b, "kv_lens": b, "cu_seqlens": b + 1}
        meta = dict(seq_lens=f.seq_lens, cached_lens=f.cached_lens, kv=self.kv, states=self.states,
                    is_decode=f.is_decode, slots=f.slots, kv_len_bucket=kv_len_bucket,
                    num_live=live if b > live else None, emits=f.emits)

        def views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
            out = {f: buf[o[f]: o[f] + n] for f, n in sizes.items()}
            out["block_tables"] = buf[o["block_tables"]: used].view(b, self.width)
            return out

        host_v = views(self.host)
        host_batch = ForwardBatch(**{f: host_v[f] for f in ForwardBatch.INDEX_FIELDS}, **meta, _cu=host_v["cu_seqlens"],
                                  kv_lens_t=host_v["kv_lens"], cu_seqlens_t=host_v["cu_seqlens"])
        if self.dev is self.host:
            return host_batch
        dev_v = views(self.dev)
        batch = ForwardBatch(**{f: dev_v[f] for f in ForwardBatch.INDEX_FIELDS}, **meta, _cu=host_v["cu_seqlens"],
                             kv_lens_t=dev_v["kv_lens"], cu_seqlens_t=dev_v["cu_seqlens"])
        batch._on = {self.device: batch, torch.device("cpu"): host_batch}
        for dev, buf in self.others.items():
            other_v = views(buf)
            batch._on[dev] = ForwardBatch(**{f: other_v[f] for f in ForwardBatch.INDEX_FIELDS}, **meta,
                                          _cu=host_v["cu_seqlens"], kv_lens_t=other_v["kv_lens"],
                                          cu_seqlens_t=other_v["cu_seqlens"], _on=batch._on)
        host_batch._on = batch._on
        return batch

    # ---- running --------------------------------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> None:
        for m in self._planners:
            m.plan(batch)

    def replan(self, batch: ForwardBatch) -> None:
        """Before a CUDA graph replays `batch`'s step: the ops whose kernels read a plan made on the host for the
        step's real lengths (not only its bucket's sizes) make it now, into the buffers the graph captured."""
        for op in self._replanners:
            op.replan(batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Plan, then run: fp32 logits [N, vocab] for batch.logits_indices."""
        self.plan(batch)
        # the CPU decode A/B's settings (None: as they are), restored after the step
        threads = torch.get_num_threads() if self.decode_threads and batch.is_decode else None
        threads = None if threads == self.decode_threads else threads
        cpus = os.sched_getaffinity(0) if self.decode_cpu is not None and batch.is_decode else None
        if threads is not None:
            torch.set_num_threads(self.decode_threads)
        if cpus is not None:
            os.sched_setaffinity(0, {self.decode_cpu})  # this thread only
        try:
            if self.cpu_decode is not None and self.cpu_decode.takes(batch):
                return self.cpu_decode(batch)
            logits = self.model(batch)
        finally:
            if threads is not None:
                torch.set_num_threads(threads)
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
        self.mark_end(logits.device)
        return logits

    def mark_end(self, device: torch.device | None = None) -> None:
        """Record the end of the forward on the stream of `device` (where the logits are; the runner's device by
        default). Under a split the last GPU's stream has waited for the others at each hand-off, so its end is
        the forward's."""
        if self.dev is not self.host:
            device = device if device is not None and device.type == "cuda" else self.device
            # blocking: a host thread that waits for it sleeps instead of polling a core the CPU experts use
            self._ended = torch.cuda.Event(blocking=True)
            self._ended.record(torch.cuda.current_stream(device))
            cpu_stream.note_end(self._ended)

    def wait_end(self) -> None:
        """Sleep until the last forward has ended on the GPU (a no-op where the model runs on the CPU). The engine
        calls it before sampling: otherwise the sampler's copy back polls a core for the whole forward."""
        if self._ended is not None and not _SPIN_WAIT:
            self._ended.synchronize()

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """One step's logits. A decode-only step on a GPU replays its bucket's graph (the rows of its live
        sequences first); every other step runs eagerly."""
        if self.graphs is not None and self.graphs.takes(chunks):
            return self.graphs.run(chunks)
        return self.forward(self.prepare(chunks))

    def check(self) -> None:
        """Raise a failure that work on the CUDA stream reported (the CPU experts' host functions). Call it once the
        step's results have been read (the engine does, after sampling)."""
        for op in self._checked:
            op.check()
