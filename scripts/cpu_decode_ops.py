"""The torch ops of the CPU placement's decode step, flat (ktrans.engine.cpu_decode) and through the module forward,
in one process: profiler events a step, and every aten op with an input of at least 32,768 elements (torch's
grain size: what may run on its OpenMP threads beside the pool's workers).
    python3 scripts/cpu_decode_ops.py GGUF [--rules R] [--cpu_infer N] [--steps 5]
"""
from __future__ import annotations

import argparse
import collections
import math
import os

os.environ["KTRANS_CPU_DECODE"] = "1"  # the flat step is opt-in; this script switches between the two itself
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from ktrans.api.server import ServeOptions, load  # noqa: E402
from ktrans.engine.engine import Engine, EngineConfig  # noqa: E402
from ktrans.engine.sampler import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--rules", default="ktrans/optimize_rules/Qwen3Next-cpu.yaml")
    ap.add_argument("--cpu_infer", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    model, tokenizer = load(ServeOptions(gguf_path=a.gguf, optimize_config_path=a.rules, cpu_infer=a.cpu_infer),
                            show_progress=False)[:2]
    n = 4 * a.steps + 32
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1, chunk_size=512, cache_lens=n + 64,
                                                   max_new_tokens=n, max_model_len=n + 32))
    flat = engine.runner.cpu_decode
    if flat is None:
        raise SystemExit("this model's decode does not take the flat step (see ktrans.engine.cpu_decode)")
    engine.submit(list(range(1, 17)), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    for _ in range(8):
        engine.poll()
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
