"""Host memory of the CPU kernels' process: transparent huge pages for expert weights, and resident set size.

Huge pages: a decode step's scattered expert rows miss the TLB far less often in 2 MiB pages than in the 4 KiB pages
of a GGUF file's mmap, so CPUMoE copies (or repacks) its matrices into buffers advised before first touch.

Once copied, the source pages of the file's mapping are let go (`release_file_pages`): the experts are then resident
once, in the copy, instead of twice (the copy plus the mapped file pages the copy read). A later read of the source
(a streaming prefill op reading the same blocks) faults them back in from the file.
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


def _file_mapping(addr: int, n: int) -> str | None:
    """The file whose mapping holds [addr, addr + n) in this process, or None (anonymous memory, several mappings,
    or no /proc)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    path = parts[5].strip() if len(parts) > 5 else ""
                    ok = addr + n <= hi and path.startswith("/") and not path.endswith("(deleted)")
                    return path if ok and "w" not in parts[1] else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def release_file_pages(t: torch.Tensor) -> int:
    """Drop the resident pages of t's bytes from this process when they are a read-only file mapping (a GGUF
    tensor read in place); bytes released, 0 when t is anything else (anonymous memory would read back as zeros)."""
    n = t.numel() * t.element_size()
    if n < (1 << 20) or not t.is_contiguous() or t.device.type != "cpu":
        return 0
    if _file_mapping(t.data_ptr(), n) is None:
        return 0
    return n if _cpu.drop_pages(t.data_ptr(), n) else 0


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
