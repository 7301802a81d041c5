"""`ktrans bench moe` (ktrans.bench.moe) runs end to end on a small shape, and `--cpu_share` hands the layer only the
pairs routed to the first experts, as split prefill hands the CPU experts their share; the reference check agrees."""
from __future__ import annotations

import json

import pytest

from ktrans.bench import moe


def test_bench_moe_with_a_cpu_share_routes_only_the_first_experts():
    rows = []
    moe.run("tiny", "q8_0", tokens=(16,), threads=1, reference=True, min_time_s=0.01, emit=rows.append,
            as_json=True, cpu_share=0.25)
    (row,) = [json.loads(r) for r in rows]
    n_experts = moe.SHAPES["tiny"].n_experts
    assert row["cpu_share"] == 0.25 and 0 < row["experts_touched"] <= n_experts // 4
    assert row["ms"] > 0 and row["speedup_vs_ref"] > 0


def test_bench_moe_refuses_an_empty_share():
    with pytest.raises(ValueError, match="--cpu_share"):
        moe.run("tiny", "q8_0", tokens=(4,), cpu_share=0.0)
