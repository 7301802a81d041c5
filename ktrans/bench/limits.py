"""`ktrans bench limits`: the machine's own ceilings that the full-size targets are stated against.

- `cpu_read_gbs`: a streaming read of a fresh 4 GiB buffer by the CPU pool (all its threads), best of 3 — the
  ceiling of CPU expert decode (each token reads its routed experts' bytes once);
- `h2d_pinned_gbs` / `d2h_pinned_gbs`: copies of 1 GiB between pinned host memory and each GPU, median of 5;
- `hbm_gbs`: a 4 GiB device-to-device copy, counted as bytes read plus bytes written, median of 5.
Every figure is measured, none is a datasheet number.
"""
from __future__ import annotations

import json
import statistics
import time

import torch


def _median_s(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first is a warm-up


def gpu_limits(device: torch.device, host_bytes: int = 1 << 30, hbm_bytes: int = 4 << 30) -> dict[str, float]:
    host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(host_bytes, dtype=torch.uint8, device=device)

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)

    out = {"h2d_pinned_gbs": host_bytes / _median_s(h2d) / 1e9, "d2h_pinned_gbs": host_bytes / _median_s(d2h) / 1e9}
    del dev, host
    a = torch.empty(hbm_bytes, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)

    def d2d():
        b.copy_(a)
        torch.cuda.synchronize(device)

    out["hbm_gbs"] = 2 * hbm_bytes / _median_s(d2d) / 1e9
    return out


def measure(threads: int | None = None) -> dict:
    from ktrans.kernels import cpu

    pool = cpu.get_pool(threads)
    out: dict = {"cpu_threads": pool.size, "cpu_read_gbs": cpu.read_bandwidth(4 << 30, 3, pool)}
    out["gpus"] = {}
    for i in range(torch.cuda.device_count()):
        d = torch.device("cuda", i)
        out["gpus"][str(d)] = {"name": torch.cuda.get_device_name(d), **gpu_limits(d)}
    return out


def main(args) -> int:
    out = measure(args.threads)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"CPU read: {out['cpu_read_gbs']:.1f} GB/s ({out['cpu_threads']} threads)")
        for d, g in out["gpus"].items():
            print(f"{d} {g['name']}: H2D pinned {g['h2d_pinned_gbs']:.1f} GB/s, D2H pinned {g['d2h_pinned_gbs']:.1f} "
                  f"GB/s, HBM copy {g['hbm_gbs']:.0f} GB/s")
    return 0
