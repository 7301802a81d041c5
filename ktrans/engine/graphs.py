"""DecodeGraphs: the runner's decode step captured as CUDA graphs, one per (sequences, KV length) bucket.

A decode step's launches (about a hundred per layer with the reference ops) cost more host time than the GPU
spends on them, so each bucket's step is captured once and replayed: one launch per step.

- **Buckets.** A step of b sequences is padded to the next of 1, 2, 4, 8, 16, ... (up to the runner's maximum);
  its KV length to the next power of two from 128 (up to the block tables' width). Pad rows write only to the
  pools' pad page and pad slot (ModelRunner.prepare), and the CPU experts compute only the live rows: the host cell
  they read is set to b before each replay.
- **Fixed addresses.** The graph reads the runner's index buffers (views at fixed offsets, refilled by one copy
  before each replay), the pools, and the CPU experts' pinned staging; its logits are a static output, read by the
  sampler before the next step.
- **Host plans.** Ops whose kernels read a schedule planned on the host from the step's real lengths (FlashInfer's
  attention) plan each replayed step into the buffers their captured kernels read (ModelRunner.replan).
- **Capture.** The first step of a bucket runs eagerly (that is its real step: pools updated, logits returned), then
  the same batch is captured, which executes nothing. Later steps of the bucket replay. Every graph shares one
  memory pool: they run one at a time, and none keeps data in it across a step.
- Eager and replayed steps of one bucket run the same kernels on the same shapes, so their tokens are identical
  (tests/engine/test_graphs.py); against the unpadded eager step they agree within the model's tolerance.
"""
from __future__ import annotations

import gc

import torch
from torch import nn

from ktrans.kernels import cpu_stream
from ktrans.operators.base import BaseOperator
from ktrans.runtime.batch import GENERATE, SeqChunk

MIN_KV_BUCKET = 128


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


def kv_bucket(max_kv_len: int, cap: int) -> int:
    """The next power of two from MIN_KV_BUCKET at or above max_kv_len, at most cap (the block tables' tokens)."""
    b = MIN_KV_BUCKET
    while b < max_kv_len:
        b *= 2
    return max(min(b, cap), max_kv_len)


def graph_blockers(model: nn.Module) -> list[str]:
    """Modules whose decode work a graph cannot hold: they compute on the CPU in the generate phase (a replay
    would skip them) and are not ops that put their CPU work on the GPU's stream (the CPU experts are)."""
    cuda = torch.device("cuda")
    out = []
    for name, m in model.named_modules():
        if isinstance(m, BaseOperator):
            op = m.impl.get(GENERATE)
            on_stream = op is not None and callable(getattr(op, "input_device", None)) and \
                op.input_device(cuda).type == "cuda"
            if op is not None and m.devices[GENERATE].type == "cpu" and not on_stream:
                out.append(name)
        elif getattr(m, "_ktrans_device", None) is not None and m._ktrans_device.type == "cpu" and \
                next(m.parameters(recurse=False), None) is not None:
            out.append(name)
    return out


class DecodeGraphs:
    def __init__(self, runner):
        self.runner = runner
        self.buckets = batch_buckets(runner.max_num_seqs)
        self.kv_cap = runner.width * runner.kv.page_size
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.num_replays = 0
        self.num_captures = 0
        self.capture = True  # False: pad to the buckets but run every step eagerly (the replays' oracle in tests)

    def takes(self, chunks: list[SeqChunk]) -> bool:
        """A decode-only step (one token per already-started sequence) asking for last-token logits."""
        return all(len(c.token_ids) == 1 and c.cached_len > 0 and c.logits == "last" for c in chunks)

    def bucket(self, chunks: list[SeqChunk]) -> tuple[int, int]:
        b = next(n for n in self.buckets if n >= len(chunks))
        return b, kv_bucket(max(c.cached_len + 1 for c in chunks), self.kv_cap)

    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [len(chunks), vocab] of this decode step, from its bucket's graph (captured after its first step)."""
        runner = self.runner
        key = self.bucket(chunks)
        batch = runner.prepare(chunks, is_decode=True, pad_to=key[0], kv_len_bucket=key[1])
        entry = self.graphs.get(key)
        if entry is None:
            logits = runner.forward(batch)  # the bucket's first step, eager: its real step
            if self.capture:
                self._capture(key, batch)
            return logits[: len(chunks)]
        graph, logits = entry
        cpu_stream.set_live_rows(len(chunks))  # an eager step's experts set it themselves (batch.num_live)
        runner.replan(batch)  # host plans of this step's lengths, into the captured buffers (KAttentionFlashInfer)
        graph.replay()
        runner.mark_end()
        self.num_replays += 1
        return logits[: len(chunks)]

    def _capture(self, key: tuple[int, int], batch) -> None:
        runner = self.runner
        torch.cuda.synchronize()  # the eager step is done with every buffer the capture reads
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls are checked during the capture (another thread of the process, an
        # API server or a finalizer, may use CUDA meanwhile without invalidating it; the engine's CUDA work is all
        # on this thread, and the CPU experts' threads make no CUDA calls).
        # No garbage collection while capturing: a collection may run on this thread at any allocation and free an
        # object whose release is illegal during a capture (a dropped engine's pinned or registered host memory:
        # cudaFreeHost, cudaHostUnregister), which invalidates the capture silently; the next launch then fails with
        # "operation failed due to a previous error during capture". What a capture leaves is collected after it.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                runner.plan(batch)
                logits = runner.model(batch)
        finally:
            if collecting:
                gc.enable()
        self.graphs[key] = (graph, logits)
        self.num_captures += 1
