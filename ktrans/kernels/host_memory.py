"""Host memory of the CPU kernels' process: transparent huge pages for expert weights, and resident set size.

Huge pages: a decode step's scattered expert rows miss the TLB far less often in 2 MiB pages than in the 4 KiB pages
of a GGUF file's mmap, so CPUMoE copies (or repacks) its matrices into buffers advised before first touch.
"""
from __future__ import annotations

import torch

from ktrans import _cpu

_HUGEPAGE_MIN_BYTES = 4 << 20


def host_rss() -> tuple[int | None, int | None]:
    """(resident bytes now, peak resident bytes) of this process, from /proc (None where there is none)."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    fields[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return fields.get("VmRSS"), fields.get("VmHWM")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), None where it cannot be read."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def hugepage_buffer(n: int) -> tuple[torch.Tensor, bool]:
    """n fresh bytes advised into transparent huge pages before first touch (2 MiB: a decode step's scattered expert
    rows then miss the TLB ~500x less often than in 4 KiB pages, such as those of a GGUF file's mmap), and whether
    the advice took."""
    h = 1 << 21
    buf = torch.empty(n + h, dtype=torch.uint8)  # large: mmap'd by the allocator, untouched until written
    off = (-buf.data_ptr()) % h
    view = buf[off:off + n]
    return view, _cpu.advise_hugepages(view.data_ptr(), n)


def in_hugepages(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A copy of t's bytes in a hugepage_buffer, and whether the advice took."""
    view, ok = hugepage_buffer(t.numel() * t.element_size())
    view.view(t.dtype).view(t.shape).copy_(t)  # one copy, also from a non-contiguous t
    return view, ok
