"""The CPU placement's decode step, flat (ktrans.engine.cpu_decode) against the module forward, in one process.

One request decodes on an Engine; rounds of STEPS steps alternate between the two paths (runner.cpu_decode
toggled), so both see the same memory, cache and KV length. Prints per round the wall ms a step and the ms outside
the CPU pool's jobs ("host"), and their medians.
    python3 scripts/cpu_decode_ab.py GGUF [--rules R] [--rounds 6] [--steps 20] [--cpu_infer N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["KTRANS_CPU_DECODE"] = "1"  # the flat step is opt-in; this script toggles it per round itself
from ktrans.api.server import ServeOptions, load  # noqa: E402
from ktrans.engine.engine import Engine, EngineConfig  # noqa: E402
from ktrans.engine.runner import caller_cpu  # noqa: E402
from ktrans.engine.sampler import SamplingParams  # noqa: E402
from ktrans.kernels import cpu  # noqa: E402


def decoding_engine(gguf: str, rules: str, cpu_infer: int | None, tokens: int):
    """(engine, its flat step) for one request decoding `tokens` tokens on the GGUF under the rules, past its
    prefill and a few decode steps. Shared with scripts/cpu_decode_ops.py."""
    model, tokenizer = load(ServeOptions(gguf_path=gguf, optimize_config_path=rules, cpu_infer=cpu_infer),
                            show_progress=False)[:2]
    engine = Engine(model, tokenizer, EngineConfig(max_batch_size=1, chunk_size=512, cache_lens=tokens + 64,
                                                   max_new_tokens=tokens, max_model_len=tokens + 32))
    flat = engine.runner.cpu_decode
    if flat is None:
        raise SystemExit("this model's decode does not take the flat step (see ktrans.engine.cpu_decode)")
    engine.submit(list(range(1, 17)), SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    for _ in range(10):
        engine.poll()
    return engine, flat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--rules", default="ktrans/optimize_rules/Qwen3Next-cpu.yaml")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu_infer", type=int, default=None, help="CPU threads (default: ktrans serve's, cores - 1)")
    a = ap.parse_args()
    engine, flat = decoding_engine(a.gguf, a.rules, a.cpu_infer, a.rounds * a.steps * 6 + 32)
    pool = cpu.get_pool()
    # "_1t": torch's own ops on one thread during decode steps (runner.decode_threads; by default torch keeps its
    # --cpu_infer threads, whose OpenMP team shares the cores with the pool's pinned, polling workers)
    # "_pin": the caller thread pinned, during decode steps, to the core the pool leaves it (runner.decode_cpu)
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in ("flat", "module", "flat_1t", "module_1t",
                                                                  "flat_pin", "module_pin")}
    own = caller_cpu()
    for _ in range(a.rounds):
        for kind in res:
            engine.runner.cpu_decode = flat if kind.startswith("flat") else None
            engine.runner.decode_threads = 1 if kind.endswith("_1t") else None  # None: torch's --cpu_infer threads
            engine.runner.decode_cpu = own if kind.endswith("_pin") else None
            b0, t0 = pool.busy()[1], time.perf_counter()
            for _ in range(a.steps):
                engine.poll()
            wall = (time.perf_counter() - t0) / a.steps
            res[kind].append((1e3 * wall, 1e3 * (wall - (pool.busy()[1] - b0) / 1e9 / a.steps)))
    for kind, v in res.items():
        print(f"{kind:10s} wall ms {[round(w, 1) for w, _ in v]} median {statistics.median(w for w, _ in v):.2f} | "
              f"host ms {[round(h, 2) for _, h in v]} median {statistics.median(h for _, h in v):.2f}")


if __name__ == "__main__":
    main()
