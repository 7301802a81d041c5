"""vLLM's per-phase request histograms and iteration tokens on /metrics, consistent with each other."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import make_server


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("le")}


def test_phase_histograms(tiny):
    srv = make_server(tiny, chunk_size=8, max_batch_size=2)
    try:
        for n in (5, 3):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "one two three four five six seven eight "
                                                                        "nine ten eleven", "max_tokens": n,
                                                              "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
        m = _samples(httpx.get(srv.url + "/metrics").text)
    finally:
        srv.stop()
    P = "ktrans:request_"
    for phase in ("queue", "prefill", "decode", "inference"):
        assert m[f"{P}{phase}_time_seconds_count"] == 2, phase
        assert m[f"{P}{phase}_time_seconds_sum"] >= 0, phase
    assert abs(m[f"{P}inference_time_seconds_sum"] - m[f"{P}prefill_time_seconds_sum"]
               - m[f"{P}decode_time_seconds_sum"]) < 1e-6
    # each step computes at most --chunk_size tokens; the prompts need > 1 step each at 8 tokens a step
    steps = m["ktrans:iteration_tokens_total_count"]
    assert steps >= 2 + 5 + 3 - 2 and m["ktrans:iteration_tokens_total_sum"] <= 8 * steps
    assert m["ktrans:iteration_tokens_total_sum"] == m["ktrans:prompt_tokens_total"] + 5 + 3 - 2
