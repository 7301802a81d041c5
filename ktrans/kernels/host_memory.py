"""Host memory of the CPU kernels' process: transparent huge pages for expert weights, and resident set size.

Huge pages: a decode step's scattered expert rows miss the TLB far less often in 2 MiB pages than in the 4 KiB pages
of a GGUF file's mmap, so CPUMoE copies (or repacks) its matrices into buffers advised before first touch.

Once copied, the source pages of the file's mapping are let go (`release_file_pages`): the experts are then resident
once, in the copy, instead of twice (the copy plus the mapped file pages the copy read). A later read of the source
(a streaming prefill op reading the same blocks) faults them back in from the file.

Registration for DMA (`register_for_dma`): split prefill copies experts to the GPU straight from the CPU experts'
buffers, which cudaHostRegister pins in place for the copy engine (no second, pinned host copy); the registration
is undone when the tensor is freed, before its pages can go to another buffer.
"""
from __future__ import annotations

import logging
import os
import weakref

import torch

from ktrans import _cpu

log = logging.getLogger(__name__)

_HUGEPAGE_MIN_BYTES = 4 << 20
_CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


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


def host_hugepages() -> int | None:
    """Bytes of this process's anonymous memory backed by transparent huge pages now (AnonHugePages of
    /proc/self/smaps_rollup; None where there is none). hugepage_buffer's advice can take and the kernel still back
    a buffer with 4 KiB pages when it finds no free 2 MiB ones (memory fragmented by a large process just ended):
    this says what the experts actually got."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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


_REGISTERED: dict[int, int] = {}  # host address -> bytes this process registered (unregistered when freed)


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call we handled (else the next kernel launch's check would
    report it): through the process's own libcudart where it can be opened, else by letting torch's launch check
    report it once."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def register_for_dma(t: torch.Tensor) -> bool:
    """Pin a host tensor's pages in place for DMA (cudaHostRegister), until the tensor is freed; False where it
    cannot be (copies are then staged by the driver, far slower; split prefill's experts report it)."""
    if not torch.cuda.is_available():
        return False
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if ptr in _REGISTERED or t.is_pinned():
        return True
    rt = torch.cuda.cudart()
    err = None
    # read-only pages (a GGUF file's mapping) take only the read-only flag
    for flags in (0, _CUDA_HOST_REGISTER_READ_ONLY):
        err = rt.cudaHostRegister(ptr, nbytes, flags)
        if int(err) == 0:
            _REGISTERED[ptr] = nbytes
            weakref.finalize(t, _unregister, ptr)  # before the pages go back: a later buffer may reuse them
            return True
        _clear_cuda_error()
    log.warning("cudaHostRegister of %.1f MiB failed (%s): copies from it will be staged by the driver",
                nbytes / 2**20, err)
    return False


def _unregister(ptr: int) -> None:
    if _REGISTERED.pop(ptr, None) is not None:
        try:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:  # interpreter shutdown: the driver lets go of the process's pages anyway
            pass


def numa_nodes(root: str = "/sys/devices/system/node") -> list[dict]:
    """The host's NUMA nodes: each one's id, CPUs (those this process may use among them) and memory in GiB, from
    sysfs; [] where sysfs has no node directory. Where there are two or more, the CPU experts' pinned workers span
    nodes and read the weights from whichever node the loader's pages landed on."""
    import glob
    import re

    allowed = os.sched_getaffinity(0)
    out = []
    for d in sorted(glob.glob(os.path.join(root, "node[0-9]*")), key=lambda p: int(os.path.basename(p)[4:])):
        try:
            cpus = _cpulist(open(os.path.join(d, "cpulist")).read())
            mem = re.search(r"MemTotal:\s+(\d+) kB", open(os.path.join(d, "meminfo")).read())
        except OSError:
            continue
        out.append({"node": int(os.path.basename(d)[4:]), "cpus": sorted(cpus & allowed),
                    "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None})
    return out


def _cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus

