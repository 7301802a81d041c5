"""Programmatic dependent launch (PDL) for the decode step's kernels (Hopper and newer; on by default, `KTRANS_PDL=0`
opts out). Measured on the H200 (doc/benchmarks.md, sessions 18 and 19): all on the GPU, batch 1, 194.4 and 198.5
against 189.8 and 188.8 tok/s; under the serve rules the GPU's share of a token 3.19-3.23 against 3.53 ms.

A decode step is ~900 small dependent kernels in one CUDA graph; between two of them the GPU idles for the next
kernel's launch (~1-2 us on an H200: the all-GPU batch-1 token's ~1.4 ms "host" share, doc/benchmarks.md). With PDL a
kernel is launched with programmatic stream serialization: its programs may start while its predecessor's last ones
still run, and wait for the predecessor's completion (and its memory) at their top (`griddepcontrol.wait`); each
kernel also lets its successor launch as soon as all its own programs have started (`launch_dependents`). Nothing a
kernel of the step writes is read, and nothing is written, before the wait, so the order of every such access is
the plain stream order's; only the launch work overlaps. (A wait also covers the kernels before the predecessor: the
predecessor finished only after its own wait.) A kernel launched without PDL (a torch op) simply runs after its
predecessor, as before. The one exception is deliberate: the GEMVs (`quant_gemv.row_dot`, `dense_gemv`) load their
first weights before the wait, so that their latency passes while the predecessor runs. Their weights must be
resident: written before the last synchronisation, never by a kernel just before (`dense_gemv` launches a copy it
makes without PDL; `_SharedFused` synchronises after stacking its gate). The MoE kernels wait first: the experts'
planes are written by kernels when they are streamed.

Each kernel of the decode path takes `PDL: tl.constexpr` and calls `enter(PDL)` first; its launch passes
`**launch()`: `PDL=True, launch_pdl=True` where PDL is on and the current CUDA device supports it (compute capability
9+, not Triton's interpreter), else `PDL=False`.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton import interpreting

PDL = {"on": os.environ.get("KTRANS_PDL", "1") == "1"}


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the predecessor's completion, then let the successor launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch() -> dict:
    """The launch keywords of a decode-path kernel on the current device (see the module's docstring)."""
    if PDL["on"] and not interpreting() and torch.cuda.is_available() and _supported(torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
