"""Run `ktrans bench kernels` cases for Nsight Compute: each named case is set up and warmed (Triton's compiles and
autotuning) with the profiler off, then called once between cudaProfilerStart and cudaProfilerStop, so that
`ncu --profile-from-start off` records just that call's launches, each from a cold L2 (ncu flushes the caches
before every pass).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats python3 scripts/ncu_cases.py 'gemv q4_k deltanet.in_proj_qkvz'

A name matches every case that contains it (as `bench kernels --match` does). Without ncu the script just runs the
calls (a check that the names match).
"""
from __future__ import annotations

import argparse
import sys

import torch

from ktrans.bench.kernels import CASES, load_families


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="substrings of case names")
    ap.add_argument("--warm", type=int, default=3, help="unprofiled calls before the profiled one")
    args = ap.parse_args()
    load_families()
    dev = torch.device("cuda")
    chosen = [c for c in CASES if any(n in c.name for n in args.names)]
    if not chosen:
        print(f"no case matches {args.names}", file=sys.stderr)
        return 2
    cudart = torch.cuda.cudart()
    for c in chosen:
        t = c.setup(dev)
        for _ in range(args.warm):
            t.fn()
        torch.cuda.synchronize()
        print(f"== {c.family}: {c.name} ({t.bytes} bytes)", flush=True)
        cudart.cudaProfilerStart()
        t.fn()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
