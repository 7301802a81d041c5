"""Where a batch-1 decode step's host time goes (diagnostics for the launch and sync counts of doc/benchmarks.md).

Usage: python3 scripts/profile_decode.py --gguf_path FILE --optimize_config_path RULES [--steps 8] [--prompt_len 64]
Loads the model as `ktrans serve` does, prefills one prompt through the engine, then runs `--steps` decode steps
under torch.profiler (CPU and CUDA) and cProfile, and prints one JSON line: per-step wall time, device operations
(kernels, copies, memsets), CUDA runtime calls by name (launches, memcpys, synchronisations), the aten ops the host
issued most, and cProfile's top Python functions by own time.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import time

import torch

from ktrans.api.server import ServeOptions, load
from ktrans.engine.engine import Engine, EngineConfig
from ktrans.engine.sampler import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf_path", required=True)
    ap.add_argument("--optimize_config_path", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=64)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # the CPU placement profiles too
    model, tok, _, _ = load(ServeOptions(gguf_path=args.gguf_path, optimize_config_path=args.optimize_config_path),
                            show_progress=False)
    engine = Engine(model, tok, EngineConfig(max_batch_size=4, cache_lens=4096))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 3 + 8, ignore_eos=True)
    stream = engine.submit(list(range(100, 100 + args.prompt_len)), params)
    for _ in range(4):  # prefill and warm-up decode steps
        engine.poll()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.poll()
    sync()
    wall = (time.perf_counter() - t0) / args.steps

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(args.steps):
            engine.poll()
        sync()
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    runtime = collections.Counter(e.name for e in events if e.name.startswith("cuda"))
    aten = [e for e in events if e.name.startswith("aten::") and e.device_type == torch.autograd.DeviceType.CPU
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    top_aten = collections.Counter(e.name for e in aten).most_common(25)

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        engine.poll()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    engine.abort(stream.request_id)
    engine.poll()
    n = args.steps
    print(json.dumps({
        "layers": model.config.num_hidden_layers, "step_ms": wall * 1e3,
        "device_ops_per_step": len(device) / n, "host_aten_ops_per_step": len(aten) / n,
        "runtime_calls_per_step": {k: v / n for k, v in runtime.most_common(12)},
        "memcpy_per_step": {k: v / n for k, v in collections.Counter(
            e.name for e in device if "Memcpy" in e.name or "Memset" in e.name).items()},
        "top_aten_per_step": {k: v / n for k, v in top_aten},
    }))
    print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
