"""The process-wide side of the C++ CPU kernels: the kernel path this CPU runs, and the thread pool the ops run on.

isa_info and best_path say which path isa="auto" takes (KTRANS_CPU_ISA overrides it); get_pool is the one
process pool (KTRANS_CPU_INFER sizes it, KTRANS_CPU_SPIN_US sets how long idle workers poll), make_pool a separate
one, and read_bandwidth / stream_bandwidth the read ceilings measured on a pool. None of it needs a CPUMoEConfig, so
ktrans.kernels.cpu (the tuning, the ISA report, the ops) builds on this module and re-exports its names; the process
pool itself (_default_pool) lives here only.
"""
from __future__ import annotations

import os

from ktrans import _cpu  # ImportError here means the package was installed without its build

# ---------------------------------------------------------------------------------------------------------
# kernel path (ktrans doctor)

def isa_info() -> dict[str, bool]:
    return dict(_cpu.isa_info())


def best_path(info: dict[str, bool] | None = None) -> tuple[str, str]:
    """The kernel path the dispatcher really uses for isa="auto" (honouring KTRANS_CPU_ISA), and why."""
    i = info or isa_info()
    status = _cpu.path_status()
    env = os.environ.get("KTRANS_CPU_ISA", "")
    try:
        path = _cpu.select_path("auto")
    except ValueError as e:
        return "error", str(e)
    if env:
        return path, f"forced by KTRANS_CPU_ISA={env}"
    if path == "avx512":
        why = "AVX-512 with VNNI (int8 dot products vpdpbusd / vpdpwssd)"
        if i["amx_denied"]:
            why += "; AMX present but the kernel denied tile permission"
        return path, why
    if path == "avx2":
        return path, f"AVX2 + FMA (AVX-512 path unavailable: {status['avx512']})"
    return path, f"portable C++ (AVX2 path unavailable: {status['avx2']})"


# ---------------------------------------------------------------------------------------------------------
# thread pool

_default_pool: _cpu.ThreadPool | None = None


def default_threads() -> int:
    """KTRANS_CPU_INFER, else the cores this process may run on."""
    env = os.environ.get("KTRANS_CPU_INFER")
    if env:
        return max(1, int(env))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def spin_us() -> int:
    """How long the process pool's idle workers poll for the next job before sleeping: KTRANS_CPU_SPIN_US, else
    DEFAULT_SPIN_US (STREAM_SPIN_US once the experts run on a GPU stream: `stream_spin_us`)."""
    return _spin_env(DEFAULT_SPIN_US)


def stream_spin_us() -> int:
    """The polling window while a GPU stream drives the experts: KTRANS_CPU_SPIN_US, else STREAM_SPIN_US."""
    return _spin_env(STREAM_SPIN_US)


def _spin_env(default: int) -> int:
    env = os.environ.get("KTRANS_CPU_SPIN_US")
    return max(0, int(env)) if env else default


# The caller's own work between jobs (the CPU-only placement's dense layers, in torch's threads) needs the cores, so
# idle workers poll briefly.
DEFAULT_SPIN_US = 200
# A GPU stream drives the experts: a job per MoE layer with the GPU's ~250 us share of the layer between, the CPU
# otherwise idle. Measured at full size on the H200 machine (doc/benchmarks.md, "How long the CPU experts' workers
# poll"): with 200 us the workers slept between most layers and each job waited for their wake-ups, 63.6 ms of
# experts a token; with 20 ms they never sleep during decode, 8.3-10.2 ms. Idle, they sleep 20 ms after the last job.
STREAM_SPIN_US = 20_000


def get_pool(n_threads: int | None = None) -> _cpu.ThreadPool:
    """The process-wide pool (created on first use); a different n_threads replaces it (--cpu_infer). n_threads
    counts the caller, which joins the work in wait(): see make_pool."""
    global _default_pool
    want = n_threads or (_default_pool.size if _default_pool else default_threads())
    if _default_pool is None or _default_pool.size != want:
        _default_pool = _cpu.ThreadPool(want, True, spin_us())
    return _default_pool


def core_siblings(cpu: int) -> list[int]:
    """The CPUs sharing a core with `cpu`, itself included ([cpu] where /sys does not say): more than one is SMT, and
    a pool's worker pinned to the caller's sibling would share its core (the pool pins those last)."""
    return list(_cpu.core_siblings(cpu))


def make_pool(n_threads: int, pin: bool = True, spin_us: int = 200) -> _cpu.ThreadPool:
    """A separate pool (tests, benchmarks): n_threads - 1 workers plus the thread that calls wait(), which works
    instead of sleeping. Workers are pinned (to all CPUs but the first) and idle ones poll for spin_us microseconds
    before sleeping, both only when the process may use at least n_threads CPUs."""
    return _cpu.ThreadPool(n_threads, pin, spin_us)


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 3, pool: _cpu.ThreadPool | None = None,
                   isa: str = "auto") -> float:
    """Best GB/s of a multi-threaded streaming read over a fresh buffer of nbytes (make it >> last-level cache)."""
    return _cpu.read_bandwidth(pool or get_pool(), int(nbytes), reps, isa)


def stream_bandwidth(tensors, reps: int = 3, pool: _cpu.ThreadPool | None = None, isa: str = "auto") -> float:
    """Best GB/s of the same streaming read over existing contiguous CPU tensors (say, the expert weights, so the
    bandwidth is that of the very pages a kernel reads): their total bytes over the summed times."""
    pool = pool or get_pool()
    total, seconds = 0, 0.0
    for t in tensors:
        n = t.numel() * t.element_size()
        gbs = _cpu.stream_bandwidth(pool, t.data_ptr(), n, reps, isa)
        total, seconds = total + n, seconds + n / (gbs * 1e9)
    return total / seconds / 1e9
