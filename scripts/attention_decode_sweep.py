"""Where the paged attention decode's time goes at batch 1 (ktrans.kernels.triton.attention.paged_decode), on the
GPU: for each context length, the whole call, the merge alone (over the same plan's scratch) and, once, the floor of
the timing itself (a graph of one one-element fill), each by CUDA-graph replay with a cold L2
(ktrans.bench.kernels.time_cuda), beside the KV bytes' time at the HBM bandwidth measured in the same run. A
length's time minus the floor, against its bytes, separates a fixed cost from the stream's rate. Planner settings
(programs per SM, shortest split) are swept as given; with --configs, the split kernel's launch shapes too (keys a
step, warps, pipelining stages), each forced in place of the autotuner's pick (printed first).

    python3 scripts/attention_decode_sweep.py [--lens 2048,8192,32768,131072] [--per_sm 2,4] [--min_split 128,256]
                                             [--configs all | 64,4,3/32,4,4]
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from ktrans.bench.kernels import _l2_bytes, hbm_gb_per_s, time_cuda
from ktrans.bench.kernels_attention import PAGE, _paged_cache, real_config
from ktrans.kernels.triton import attention as tri


class _Forced:
    """Stands in for the split kernel's autotuner: one launch shape, as `_decode_tuned[grid](...)` is called."""

    def __init__(self, block_n: int, warps: int, stages: int):
        self.meta = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)

    def __getitem__(self, grid):
        return lambda *args, **kw: tri._decode_split_kernel[grid](*args, **kw, **self.meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="2048,8192,32768,131072")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--per_sm", default="2,4")
    ap.add_argument("--min_split", default="128,256")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--configs", default="", help="BLOCK_N,warps,stages/...; all: 16-64 keys, 2-8 warps, 2-5 stages")
    args = ap.parse_args()
    tuned = tri._decode_tuned
    if args.configs == "all":
        configs = [(n, w, st) for n in (16, 32, 64) for w in (2, 4, 8) for st in (2, 3, 4, 5)]
    else:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split("/") if c]
    dev = torch.device("cuda")
    c = real_config()
    hbm = hbm_gb_per_s(dev)
    flush = torch.empty(2 * _l2_bytes(dev), dtype=torch.uint8, device=dev)
    one = torch.zeros(1, device=dev)
    floor = statistics.median(time_cuda(lambda: one.fill_(1.0), dev, reps=args.reps, flush=flush)) * 1e3
    print(f"HBM {hbm:.0f} GB/s; timing floor (one one-element fill, graph replay) {floor:.2f} us")
    for length in (int(v) for v in args.lens.split(",")):
        k, v, tables, lens = _paged_cache(args.batch, length, dev)
        q = torch.randn(args.batch, c.num_attention_heads, c.head_dim, dtype=k.dtype, device=dev)
        out = torch.empty_like(q)
        kv_bytes = 2 * args.batch * length * c.num_key_value_heads * c.head_dim * k.element_size()
        ideal = kv_bytes / hbm / 1e3
        for per_sm, min_split in itertools.product(*([int(v) for v in a.split(",")] for a in (
                args.per_sm, args.min_split))):
            tri.PROGRAMS_PER_SM, tri.MIN_SPLIT_TOKENS = per_sm, min_split
            tri._decode_tuned = tuned
            plan = tri.plan_decode(args.batch, c.num_key_value_heads, length, dev)
            whole = statistics.median(time_cuda(
                lambda: tri.paged_decode(q, k, v, lens, tables, PAGE, c.head_dim ** -0.5, plan, out=out), dev,
                reps=args.reps, flush=flush)) * 1e3
            part, lse = tri._scratch(args.batch, c.num_attention_heads, plan.num_splits, tri._block_d(c.head_dim),
                                     dev)
            merge = statistics.median(time_cuda(
                lambda: tri._merge(part, lse, out, lens, plan, tri._block_d(c.head_dim)), dev, reps=args.reps,
                flush=flush)) * 1e3
            print(f"L={length} per_sm={per_sm} min_split={min_split}: {plan.num_splits} splits of "
                  f"{plan.split_tokens}; whole {whole:.2f} us ({ideal / whole:.3f} of HBM; less the floor "
                  f"{ideal / max(whole - floor, 1e-3):.3f}), merge alone {merge:.2f} us; the bytes at HBM rate "
                  f"{ideal:.2f} us")
            picked = {key: str(cfg) for key, cfg in tuned.cache.items()}
            print(f"  the autotuner's picks: {picked}")
            for n, w, st in configs:
                tri._decode_tuned = _Forced(n, w, st)
                try:
                    t = statistics.median(time_cuda(
                        lambda: tri.paged_decode(q, k, v, lens, tables, PAGE, c.head_dim ** -0.5, plan, out=out),
                        dev, reps=args.reps, flush=flush)) * 1e3
                    print(f"  BLOCK_N={n} warps={w} stages={st}: whole {t:.2f} us ({ideal / t:.3f} of HBM)")
                except Exception as exc:  # noqa: BLE001  (a shape that does not fit its shared memory)
                    print(f"  BLOCK_N={n} warps={w} stages={st}: {type(exc).__name__}")
            tri._decode_tuned = tuned
        del k, v


if __name__ == "__main__":
    main()
