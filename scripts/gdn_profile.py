"""Where the chunked gated delta rule's time goes, kernel by kernel, on the GPU: one 80B DeltaNet layer's prefill
(HK 16, HV 32, d 128, bf16) by ktrans's Triton launches (chunk_gated_delta_rule_varlen, its defaults) and by fla-core's
chunk_gated_delta_rule on the same inputs where it imports, each called --reps times under torch.profiler after
warm-up calls (autotuning and compiles outside the profile); printed per kernel: launches a call and device
microseconds a call. Eager launches with a warm L2, so the sums sit below scripts/gdn_sweep.py's cold-L2 graph
timings; what matters is the split between the kernels.

    python3 scripts/gdn_profile.py [--t 8192,32768] [--reps 5]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ktrans.bench.kernels_gdn import _fla_peer, _prefill_inputs, _shape
from ktrans.kernels.triton import gated_delta as gd


def kernel_times(fn, reps: int) -> list[tuple[str, float, float]]:
    """(kernel, launches a call, device us a call) for `reps` calls of fn, the largest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us, n = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us[ev.name] += ev.time_range.elapsed_us()
            n[ev.name] += 1
    return sorted(((k, n[k] / reps, us[k] / reps) for k in us), key=lambda r: -r[2])


def report(title: str, rows: list[tuple[str, float, float]]) -> None:
    print(f"{title}: {sum(r[2] for r in rows):.1f} us a call", flush=True)
    for name, launches, us in rows:
        print(f"  {us:9.1f} us  x{launches:g}  {name[:100]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", default="8192,32768")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sh = _shape(dev)
    for t in (int(s) for s in args.t.split(",")):
        q, k, v, a, b, A_log, dt_bias, pool = _prefill_inputs(t, sh, dev)
        plan = gd.plan_chunks([(0, t, 0, False)], dev, [0])
        out = torch.empty(t, sh.hv, sh.d, dtype=torch.bfloat16, device=dev)
        report(f"T={t} ktrans", kernel_times(
            lambda: gd.chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan, out=out), args.reps))
        peer = _fla_peer(q, k, v, a, b, A_log, dt_bias, pool)
        if peer is None:
            print(f"T={t} fla-core: not importable")
        else:
            report(f"T={t} fla-core", kernel_times(peer, args.reps))


if __name__ == "__main__":
    main()
