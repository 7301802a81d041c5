"""`ktrans bench prefix-cache` at a small size on the embedded default: the three numbers come out, a hit reuses
the whole shared prefix, and a chat computes less than its prompts add up to."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_prefix_cache_bench_small():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "ktrans.cli", "bench", "prefix-cache", "--prefix_len", "96",
                          "--suffix_len", "8", "--chunk_size", "32", "--repeats", "1", "--turns", "3",
                          "--reply_len", "3", "--json"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    hit = r["hit_vs_miss"]
    assert hit["cached_tokens"] == 96 and hit["hit_ttft_s"] > 0 and hit["miss_ttft_s"] > 0
    miss = r["miss_overhead"]
    assert miss["prompt_len"] == 104 and miss["ttft_off_s"] > 0 and 0 < miss["cache_work_s"] < miss["ttft_on_s"]
    ids, text = r["chat"]
    assert ids["mode"] == "ids" and 0 < ids["computed_tokens"] < ids["prompt_tokens"]
    assert text["mode"] == "text" and text["computed_tokens"] <= text["prompt_tokens"]
