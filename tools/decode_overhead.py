"""Where a 1-token MoE call's wall time goes (diagnostics): Python wrapper, C++ submit, the pool's work, the tail.

Usage: python3 tools/decode_overhead.py [--threads N]  -> one JSON line of medians in microseconds:
  forward_us   CPUMoE.forward as the model calls it
  raw_us       the pybind submit + pool.wait alone (no Python wrapper)
  submit_us    the pybind submit call alone (routing, buffers, activation quantization, posting the job)
  work_end_us  from posting the job to the end of its last task (the pool trace)
  empty_us     submit + wait of a call whose every expert id is -1 (no work: the fixed cost of a job)
"""
import argparse
import json
import statistics
import time

import torch

from ktrans.bench.moe import SHAPES, _routings, random_experts
from ktrans.kernels import cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    shape = SHAPES["qwen3-next"]
    gen = torch.Generator().manual_seed(0)
    E, H, I = shape.n_experts, shape.hidden, shape.intermediate
    pool = cpu.make_pool(args.threads or cpu.default_threads())
    moe = cpu.CPUMoE(random_experts("Q4_K", E, I, H, gen), random_experts("Q4_K", E, I, H, gen),
                     random_experts("Q4_K", E, H, I, gen), n_experts=E, hidden=H, intermediate=I,
                     types=("Q4_K",) * 3, pool=pool)
    x = torch.randn(1, H, generator=gen)
    out = torch.empty(1, H)
    routes = _routings(shape, 1, args.iters, gen)
    routes2 = _routings(shape, 1, args.iters, gen)  # the raw calls get their own experts, also cold
    for ids, w in routes[:20]:
        moe(x, ids, w)
    res = {"forward_us": [], "raw_us": [], "submit_us": [], "work_end_us": [], "empty_us": []}
    raw = moe._moe
    none = torch.full((1, shape.top_k), -1, dtype=torch.int64)
    pool.set_trace(True)
    for (ids, w), (ids2, w2) in zip(routes, routes2):
        t0 = time.perf_counter()
        moe(x, ids, w)
        t1 = time.perf_counter()
        res["forward_us"].append((t1 - t0) * 1e6)
        tr = [r for r in pool.last_trace() if r[2] > 0]
        res["work_end_us"].append(max(r[1] for r in tr) / 1e3)
        t0 = time.perf_counter()
        ticket = raw.submit(x.data_ptr(), 1, H, ids2.data_ptr(), w2.data_ptr(), shape.top_k, out.data_ptr(), H)
        t1 = time.perf_counter()
        pool.wait(ticket)
        t2 = time.perf_counter()
        res["submit_us"].append((t1 - t0) * 1e6)
        res["raw_us"].append((t2 - t0) * 1e6)
        t0 = time.perf_counter()
        pool.wait(raw.submit(x.data_ptr(), 1, H, none.data_ptr(), w.data_ptr(), shape.top_k, out.data_ptr(), H))
        res["empty_us"].append((time.perf_counter() - t0) * 1e6)
    pool.set_trace(False)
    print(json.dumps({k: round(statistics.median(v), 1) for k, v in res.items()} | {"threads": pool.size}))


if __name__ == "__main__":
    main()
