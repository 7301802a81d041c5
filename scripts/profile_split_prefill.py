"""Where a split-prefill step's GPU time goes: loads a GGUF under a rule file (KExpertsSplit prefill), warms up, then
runs one prompt under torch.profiler and prints per-kernel device time (count, total, mean) for the repack, MoE and
copy work, with the split op's own event-timed copy/repack totals beside them. Writes the chrome trace to $OUT.

    python3 scripts/profile_split_prefill.py GGUF RULES [--prompt_len 512] [--chunk_size 512]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("rules")
    ap.add_argument("--prompt_len", type=int, default=512)
    ap.add_argument("--chunk_size", type=int, default=512)
    a = ap.parse_args()
    from ktrans.api.server import ServeOptions, load
    from ktrans.bench.e2e import _Bench
    from ktrans.engine.engine import Engine, EngineConfig
    from ktrans.kernels import cpu
    from ktrans.operators import experts_split

    model, tok, _, _ = load(ServeOptions(gguf_path=a.gguf, optimize_config_path=a.rules), show_progress=False)
    engine = Engine(model, tok, EngineConfig(max_batch_size=1, chunk_size=a.chunk_size, cache_lens=a.prompt_len + 64,
                                             max_new_tokens=2, max_model_len=a.prompt_len + 32))
    bench = _Bench(engine, cpu.get_pool(), [torch.device("cuda")], 0)
    for _ in range(3):
        r = bench.run(1, a.prompt_len, 2)
        print(f"warm TTFT {1e3 * r.ttft_s[0]:.0f} ms", flush=True)
    before = experts_split.summary(model)["rates"][0]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        r = bench.run(1, a.prompt_len, 2)
    print(f"profiled TTFT {1e3 * r.ttft_s[0]:.0f} ms")
    after = experts_split.summary(model)["rates"][0]
    print("op events: copy_s %.4f repack_s %.4f experts %d" % (
        after["gpu_copy_s"] - before["gpu_copy_s"], after["gpu_repack_s"] - before["gpu_repack_s"],
        after["copied_experts"] - before["copied_experts"]))
    print("last n_cpu", experts_split.summary(model)["last_n_cpu"])
    print("last cpu ms", experts_split.summary(model)["last_cpu_ms"])
    print("last wall ms", experts_split.summary(model)["last_wall_ms"])
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    for e in rows[:25]:
        print(f"{e.count:6d} {e.device_time_total / 1e3:10.2f} ms {e.device_time_total / max(e.count, 1):10.1f} us  "
              f"{e.key[:90]}")
    out = os.environ.get("OUT")
    if out:
        prof.export_chrome_trace(os.path.join(out, "split_prefill_trace.json"))


if __name__ == "__main__":
    sys.exit(main())
