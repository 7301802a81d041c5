"""What programmatic dependent launch (PDL) saves between small kernels in a CUDA graph, on this GPU: a chain of N
dependent one-row kernels (each reads the last one's output, as a decode step's kernels do) captured once with
plain launches and once with `launch_pdl=True` (each kernel waits for its predecessor at its top, then lets its
successor launch), replayed; prints the microseconds a kernel for both and checks that the results are equal.

    python3 scripts/pdl_probe.py [--kernels 400] [--reps 20] [--width 2048]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(x_ptr, y_ptr, W: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0) * 256 + tl.arange(0, 256)
    x = tl.load(x_ptr + i, mask=i < W, other=0.0)
    tl.store(y_ptr + i, x * 0.5 + 1.0, mask=i < W)


def chain(bufs, n: int, width: int, pdl: bool) -> None:
    extra = {"launch_pdl": True} if pdl else {}
    for j in range(n):
        _step_kernel[(triton.cdiv(width, 256),)](bufs[j % 2], bufs[(j + 1) % 2], W=width, PDL=pdl, **extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=400)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--width", type=int, default=2048)
    args = ap.parse_args()
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    out = {}
    for pdl in (False, True, False, True):
        bufs = [torch.ones(args.width, device="cuda"), torch.empty(args.width, device="cuda")]
        chain(bufs, 4, args.width, pdl)  # compile outside the capture
        bufs[0].fill_(1.0)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(bufs, args.kernels, args.width, pdl)
        times = []
        for _ in range(args.reps):
            bufs[0].fill_(1.0)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / args.kernels)
        out[pdl] = bufs[args.kernels % 2].clone()
        print(f"pdl={int(pdl)}: {statistics.median(times):.2f} us a kernel (median of {args.reps} replays of "
              f"{args.kernels} kernels)", flush=True)
    print("same results:", torch.equal(out[False], out[True]))


if __name__ == "__main__":
    main()
