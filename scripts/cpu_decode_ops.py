"""The torch ops of the CPU placement's decode step, flat (ktrans.engine.cpu_decode) and through the module forward,
in one process: profiler events a step, and every aten op with an input of at least 32,768 elements (torch's
grain size: what may run on its OpenMP threads beside the pool's workers).
    python3 scripts/cpu_decode_ops.py GGUF [--rules R] [--cpu_infer N] [--steps 5]
"""
from __future__ import annotations

import argparse
import collections
import math

from torch.profiler import ProfilerActivity, profile

from cpu_decode_ab import decoding_engine  # scripts/ is the script's own directory: first on sys.path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--rules", default="ktrans/optimize_rules/Qwen3Next-cpu.yaml")
    ap.add_argument("--cpu_infer", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    engine, flat = decoding_engine(a.gguf, a.rules, a.cpu_infer, 4 * a.steps + 32)
    for mode in ("flat", "module"):
        engine.runner.cpu_decode = flat if mode == "flat" else None
        for _ in range(3):
            engine.poll()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(a.steps):
                engine.poll()
        events, big = 0, collections.Counter()
        for e in prof.events():
            events += 1
            shapes = [s for s in (e.input_shapes or []) if isinstance(s, list) and s]
            if e.name.startswith("aten::") and max((math.prod(s) for s in shapes), default=0) >= 32768:
                big[(e.name, str(shapes)[:80])] += 1
        print(f"== {mode}: {events // a.steps} profiler events a step; aten ops with >= 32768 elements "
              f"({a.steps} steps):")
        for (name, shapes), count in big.most_common(20):
            print(f"  {count:4d} {name} {shapes}")


if __name__ == "__main__":
    main()
