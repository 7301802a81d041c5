"""`ktrans bench kernels`: device time of the GPU layer kernels, against the bytes they must move.

A case is one kernel call at one shape (`KernelCase`): its setup builds the inputs and returns the call plus the
bytes it must read and write (and its flops, where compute bounds it). Families register cases in their own
modules (`ktrans/bench/kernels_*.py`, listed in FAMILIES); a family whose imports fail is reported, not fatal.

Timing on CUDA: the call is captured into a CUDA graph and replayed, each replay timed by its own pair of events
with the L2 flushed before it (a write over twice the L2's size), so each timed call reads its inputs from HBM. Host
launch overhead is out of the figure by construction: this measures the kernel, and `bench e2e` measures the
launches. Each replay also carries a fixed floor, the graph's own launch between the two events (3.9-4.3 us for a
one-element fill on the H200, doc/benchmarks.md, session 23), which weighs on the small decode kernels; cases that
can make fresh copies of their weights (`Timed.copies`) are also timed streamed (`time_cuda_stream`): many calls,
each on its own copy, back to back in one graph, as a decode step's graph runs them, the L2 cold for each when the
copies together exceed twice its size, and the floor shared among them. The HBM bandwidth is measured in the same
run (a device-to-device copy), so the ratio is to this machine's own ceiling. Without CUDA the cases run once on the
CPU (the torch references, or the Triton kernels under TRITON_INTERPRET=1) so the bench itself is tested; those
timings mean nothing.
"""
from __future__ import annotations

import importlib
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

FAMILIES = ("ktrans.bench.kernels_gdn", "ktrans.bench.kernels_attention", "ktrans.bench.kernels_quant",
            "ktrans.bench.kernels_flashinfer")


@dataclass(frozen=True)
class Timed:
    fn: Callable[[], object]   # the call; captured into a graph on CUDA, so it must not sync or allocate per call
    bytes: int                 # bytes it must read plus write (the bandwidth figure's numerator)
    flops: int = 0
    peer: Callable[[], object] | None = None  # the same work by another implementation, timed alike, when present
    peer_name: str = ""
    # the call on a fresh copy i (1, 2, ...) of its inputs that the L2 must not hold (a GEMV's weights), for the
    # streamed timing; None: not streamed
    copies: Callable[[int], Callable[[], object]] | None = None


@dataclass(frozen=True)
class KernelCase:
    family: str
    name: str                                   # e.g. "gdn_decode B=64"
    setup: Callable[[torch.device], Timed]
    tags: tuple[str, ...] = field(default=())   # e.g. ("decode",)


CASES: list[KernelCase] = []


def case(family: str, name: str, tags: tuple[str, ...] = ()) -> Callable:
    """Decorator for a setup function: `@case("gdn", "decode B=1")`."""
    def wrap(setup: Callable[[torch.device], Timed]) -> Callable[[torch.device], Timed]:
        CASES.append(KernelCase(family, name, setup, tags))
        return setup
    return wrap


def load_families() -> dict[str, str]:
    """Import every family module; returns {module: why it did not import} for those whose optional package is
    missing. A name missing from ktrans itself is a bug, not a skip: it raises."""
    failed = {}
    for mod in FAMILIES:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] == "ktrans":
                raise
            failed[mod] = str(exc)
    return failed


def _l2_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 64 << 20)


def time_cuda(fn: Callable[[], object], device: torch.device, reps: int = 50, flush: torch.Tensor | None = None,
              graph: bool = True) -> list[float]:
    """Per-call device milliseconds of `fn`, replayed from a CUDA graph with a cold L2 before each call."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: Triton compiles and autotunes outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


STREAM_MAX_COPIES = 64


def stream_copies(nbytes: int, device: torch.device) -> int:
    """How many copies of a call's inputs the streamed timing runs: enough that they exceed twice the L2 (each call
    then reads from HBM), at least 2 and at most STREAM_MAX_COPIES (a small kernel's copies may then fit the L2:
    the report says so, `streamed_cold`)."""
    return max(2, min(STREAM_MAX_COPIES, -(-2 * _l2_bytes(device) // max(nbytes, 1)) + 1))


def time_cuda_stream(calls: list[Callable[[], object]], device: torch.device, reps: int = 20) -> list[float]:
    """Per-call device milliseconds of `calls` (the same kernel on different copies of its inputs) captured back to
    back into one CUDA graph: each replay's span over the number of calls. The graph's launch and the events' floor
    are spread over the calls; the gaps between kernels inside the graph are in the figure, as in a decode step."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up: compiles outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) / len(calls) for s, e in zip(starts, ends)]


def hbm_gb_per_s(device: torch.device) -> float:
    """A device-to-device copy of 1 GiB, bytes read plus written over the time."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = statistics.median(time_cuda(lambda: dst.copy_(src), device, reps=10, graph=False))
    return 2 * n / ms / 1e6


def run(families: list[str] | None, match: str | None, reps: int, as_json: bool,
        device: str | None = None) -> list[dict]:
    failed = load_families()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = dev.type == "cuda"
    flush = torch.empty(2 * _l2_bytes(dev), dtype=torch.uint8, device=dev) if on_cuda else None
    hbm = hbm_gb_per_s(dev) if on_cuda else None
    rows = []
    for mod, why in failed.items():
        rows.append({"family": mod.rsplit("_", 1)[-1], "skipped": why})
    for c in CASES:
        if families and c.family not in families:
            continue
        if match and not any(m in c.name for m in match.split("|")):
            continue
        row: dict = {"family": c.family, "case": c.name, "device": str(dev)}
        try:
            t = c.setup(dev)
            if on_cuda:
                ms = time_cuda(t.fn, dev, reps, flush)
            else:
                t0 = time.perf_counter()
                t.fn()
                ms = [(time.perf_counter() - t0) * 1e3]
        except Exception as exc:  # one case's failure is a row of the report, not the end of the run
            row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            continue
        med = statistics.median(ms)
        row.update(us=round(med * 1e3, 2), us_min=round(min(ms) * 1e3, 2), bytes=t.bytes,
                   gb_per_s=round(t.bytes / med / 1e6, 1))
        if t.flops:
            row["tflops"] = round(t.flops / med / 1e9, 2)
        if hbm:
            row["hbm_gb_per_s"] = round(hbm, 1)
            row["frac_of_hbm"] = round(t.bytes / med / 1e6 / hbm, 3)
        if on_cuda and t.copies is not None:
            _stream_row(row, t, dev, reps, hbm)
        if t.peer is not None:
            try:
                pms = statistics.median(time_cuda(t.peer, dev, reps, flush)) if on_cuda else float("nan")
                row[f"{t.peer_name}_us"] = round(pms * 1e3, 2)
                row[f"speedup_vs_{t.peer_name}"] = round(pms / med, 3)
            except Exception as exc:
                row[f"{t.peer_name}_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    for row in rows:
        if as_json:
            print(json.dumps(row))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return rows


def _stream_row(row: dict, t: Timed, dev: torch.device, reps: int, hbm: float | None) -> None:
    """The streamed timing's columns of a case's row (time_cuda_stream over stream_copies copies)."""
    n = stream_copies(t.bytes, dev)
    try:
        ms = statistics.median(time_cuda_stream([t.fn, *(t.copies(i) for i in range(1, n))], dev, reps))
    except Exception as exc:  # reported in the row, as a case's error is
        row["streamed_error"] = f"{type(exc).__name__}: {exc}"
        return
    row.update(streamed_us=round(ms * 1e3, 2), streamed_copies=n, streamed_cold=n * t.bytes >= 2 * _l2_bytes(dev))
    if hbm:
        row["streamed_frac_of_hbm"] = round(t.bytes / ms / 1e6 / hbm, 3)
