"""What `bench e2e` reads off a run besides its clocks: the model's CUDA devices, the profiled decode steps' device
time (the busiest kernels; the device's busy time as the union of its operations' spans), host and GPU memory."""
from __future__ import annotations

import torch

from ktrans.kernels import cpu

TOP_KERNELS = 12  # the kernels the profiled decode steps list by device time


def cuda_devices(model) -> list[torch.device]:
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"} |
                  {b.device for b in model.buffers() if b.device.type == "cuda"}, key=str)


def top_kernels(events, steps: int, n: int = TOP_KERNELS, own: bool = False) -> dict[str, tuple[float, float]]:
    """The n device operations (profiler events; names cut at 80 characters) with the most device time: name ->
    (us, calls) a step, the largest first. own: each operation's own time (own_times: what is left of its span once
    everything that started before it has ended), where a kernel launched early under programmatic dependent launch
    counts its wait for its predecessor in its span."""
    per: dict[str, list[float]] = {}
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    times = own_times(spans) if own else [b - a for a, b in spans]
    for e, us in zip(events, times):
        t = per.setdefault(e.name[:80], [0.0, 0.0])
        t[0] += us / steps
        t[1] += 1 / steps
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:n]
    return {k: (round(us, 1), round(calls, 2)) for k, (us, calls) in ranked}


def own_times(spans: list[tuple[float, float]]) -> list[float]:
    """Per (start, end) span, in the given order: the part of it after every span that started earlier has ended
    (busy_union's rule for one operation; the first in start order keeps all of it, an empty span none)."""
    out, end = [0.0] * len(spans), float("-inf")
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        a, b = spans[i]
        out[i] = max(0.0, b - max(a, end))
        end = max(end, b)
    return out


def busy_union(spans: list[tuple[float, float, bool]]) -> float:
    """The time the device works, from its operations' (start, end, waiting) spans: the union of the spans, less the
    waiting ones (the CPU experts' poll), where a span that starts before everything earlier has ended counts only
    from that end (a kernel launched with programmatic dependent launch waits there for its predecessor). Meant for
    one stream (a decode step's): work on another stream that overlaps a poll would be left out. The sum of the
    non-waiting spans' own_times (ordered with a working span before a waiting one of the same extent)."""
    ordered = sorted(s for s in spans if s[1] > s[0])
    own = own_times([(a, b) for a, b, _ in ordered])  # already in start order: kept as given
    return sum(t for t, (_, _, waiting) in zip(own, ordered) if not waiting)


def host_memory() -> dict[str, float]:
    now, peak = cpu.host_rss()
    huge = cpu.host_hugepages()
    return {"host_rss_gib": now and now / 2**30, "host_peak_rss_gib": peak and peak / 2**30,
            "host_hugepages_gib": huge and huge / 2**30}


def gpu_memory(devices: list[torch.device]) -> dict[str, dict[str, float]]:
    return {str(d): {"allocated_gib": torch.cuda.memory_allocated(d) / 2**30,
                     "peak_allocated_gib": torch.cuda.max_memory_allocated(d) / 2**30,
                     "reserved_gib": torch.cuda.memory_reserved(d) / 2**30} for d in devices}
