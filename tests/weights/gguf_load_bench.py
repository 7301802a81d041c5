"""Load time and peak RSS of a ~1 GB GGUF (doc/benchmarks.md). Not a test: run it by hand.

    python tests/weights/gguf_load_bench.py --dir /tmp/ktrans-gguf-bench

It writes two random-weight Qwen3-Next GGUFs of about 1 GB (BF16 and Q8_0; skipped when already there), then
measures each way of loading in a fresh subprocess: wall time, and peak resident set (VmHWM from
/proc/self/status, which counts the mapped file pages the process touched as well as its private memory).

  plain   load_model(--gguf_path, dtype=bfloat16): the plain torch model, every tensor materialized (experts
          dequantized into the ModuleList); BF16 tensors stay zero-copy views of the mapped file.
  baseline  python with torch and ktrans imported, nothing loaded (subtract it to see what loading costs).
  raw     what the rules engine's CPU experts do: GGUFSource.get for every non-expert parameter (bf16) and
          get_raw_experts for every layer, with every expert byte read once (so the whole file is paged in).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# ~1 GB each: 8 layers (6 DeltaNet + 2 attention), hidden 1024, vocab 65536, moe_intermediate 512
BASE = dict(vocab_size=65536, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
            head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
            linear_value_head_dim=128, moe_intermediate_size=512, shared_expert_intermediate_size=1024,
            intermediate_size=1024, num_experts_per_tok=4, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FILES = {"bf16": dict(BASE, num_experts=24), "q8_0": dict(BASE, num_experts=60)}


def make(path: Path, quant: str) -> None:
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config, random_state_dict
    from ktrans.weights.gguf_writer import write_gguf

    cfg = ModelConfig.from_hf_dict({**preset_config("tiny"), **FILES[quant]})
    write_gguf(path, cfg, random_state_dict(cfg, 0), quant)


MEASURE = r"""
import sys, time, torch
mode, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if mode == "baseline":  # the interpreter, torch and ktrans imported, nothing loaded
    from ktrans.weights.gguf_source import GGUFSource
    from ktrans.inject import load_model
elif mode == "plain":
    from ktrans.inject import load_model
    from ktrans.model.source import ModelSource
    model, _ = load_model(ModelSource(gguf_path=path), torch.bfloat16, show_progress=False)
else:
    from ktrans.weights.gguf_source import GGUFSource
    from ktrans.model.source import build_model
    src = GGUFSource(path)
    kept, checksum = [], 0
    for name, p in build_model(src.config).named_parameters():
        if ".mlp.experts." not in name:
            kept.append(src.get(name, torch.bfloat16))
    for layer in range(src.config.num_hidden_layers):
        for kind in ("gate", "up", "down"):
            raw = src.get_raw_experts(layer, kind)
            kept.append(raw)
            pages = raw.data.reshape(-1)[::4096] if raw.data.is_contiguous() else raw.data[..., ::4096]
            checksum += int(pages.sum(dtype=torch.int64))  # one byte of every page: the whole tensor is paged in
load_s = time.perf_counter() - t0
status = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("VmHWM", "VmRSS")))
kb = lambda k: int(status[k].split()[0])
print({"load_s": load_s, "hwm_mib": kb("VmHWM") / 1024, "rss_mib": kb("VmRSS") / 1024})
"""


def measure(mode: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, mode, str(path)], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[2]).stdout
    return eval(out.strip().splitlines()[-1])  # a dict literal we printed ourselves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/ktrans-gguf-bench")
    ap.add_argument("--repeat", type=int, default=2, help="runs per row; the last (warm page cache) is reported")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    base = measure("baseline", Path("-"))
    print(json.dumps({"mode": "baseline", "peak_rss_mib": round(base["hwm_mib"])}))
    for quant in FILES:
        path = d / f"bench-{quant}.gguf"
        if not path.exists():
            t = time.perf_counter()
            make(path, quant)
            print(f"wrote {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        size = path.stat().st_size / 2**20
        for mode in ("plain", "raw"):
            r = [measure(mode, path) for _ in range(args.repeat)][-1]
            rows.append({"file": path.name, "size_mib": round(size), "mode": mode, "load_s": round(r["load_s"], 2),
                         "peak_rss_mib": round(r["hwm_mib"]), "peak_over_size": round(r["hwm_mib"] / size, 2)})
            print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
