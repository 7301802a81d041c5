"""The prefix cache over HTTP: usage.prompt_tokens_details.cached_tokens (streamed and not), POST /flush_cache,
the /metrics series and the startup summary's budget line."""
from __future__ import annotations

import httpx
import pytest

from .conftest import make_server, pools_full
from .test_api import sse_events


@pytest.fixture(scope="module")
def server(tiny):
    srv = make_server(tiny, chunk_size=64, max_batch_size=4, prefix_cache_max_snapshots=8)
    yield srv
    srv.stop()


def chat(url: str, messages: list[dict], stream: bool = False) -> dict:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        events = sse_events(url, "/v1/chat/completions", body)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"])
        return {"usage": events[-2]["usage"], "text": text}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return {"usage": r.json()["usage"], "text": r.json()["choices"][0]["message"]["content"]}


def test_cached_tokens_in_usage_streamed_and_not_and_flush(server):
    url = server.url
    assert httpx.post(url + "/flush_cache", timeout=30).json()["flushed"] is True
    messages = [{"role": "system", "content": "You answer in one word. " * 4},
                {"role": "user", "content": "first question"}]
    first = chat(url, messages)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # The template drops an earlier turn's <think> block, so the next turn matches the previous prompt, not the
    # generated reply: it hits the snapshot at that prompt's end. (A reply of our own: random text could merge
    # with the template's newline into other tokens.)
    messages += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "second"}]
    for stream in (False, True):
        again = chat(url, messages, stream=stream)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == first["usage"]["prompt_tokens"], (stream, again["usage"])
    r = httpx.post(url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["snapshots_freed"] > 0
    assert chat(url, messages)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert pools_full(server.engine)


def test_metrics_and_summary(server):
    messages = [{"role": "user", "content": "metrics please " * 5}]
    chat(server.url, messages)
    chat(server.url, messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("ktrans:prefix_cache"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = value
    for name in ("queries_total", "hits_total", "query_requests_total", "hit_requests_total",
                 "evicted_pages_total", "evicted_snapshots_total", "snapshots", "snapshot_bytes", "pages"):
        assert "ktrans:prefix_cache_" + name in values, name
    assert values["ktrans:prefix_cache_hits_total"] > 0
    assert values["ktrans:prefix_cache_queries_total"] >= values["ktrans:prefix_cache_hits_total"]
    assert values["ktrans:prefix_cache_snapshot_bytes"] == values["ktrans:prefix_cache_snapshots"] * \
        server.engine.snapshot_bytes

    from ktrans.api.server import ServeOptions, summary

    text = summary(server.engine, "tiny", ServeOptions())
    assert "8 DeltaNet snapshots (--prefix_cache_max_snapshots)" in text and "states     4 slots" in text
