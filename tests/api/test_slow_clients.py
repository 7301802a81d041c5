"""A slow or huge client delays nobody: while one client trickles a body in, or submits a prompt that takes
seconds to tokenize, /health and a short chat request still complete, before the big one does.

The check is the order of completion, not a latency bound (a loaded CI box may be slow, never out of order); the
latencies are printed (`pytest -s`) and recorded in doc/benchmarks.md.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from ktrans.engine.engine import Engine, EngineConfig
from ktrans.api.server import BackgroundServer

SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
HUGE_WORDS = 400_000  # 2.4 MB of text, about 1.5 s of tokenization on a 2-core box


class Signalling:
    """The tokenizer, setting `big` when it starts encoding a text over 1 MB (so the others start only once the
    server is at the slow part)."""

    def __init__(self, tok):
        self._tok, self.big = tok, threading.Event()

    def encode(self, text, *a, **kw):
        if len(text) > 1_000_000:
            self.big.set()
        return self._tok.encode(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    signalling = Signalling(tok)
    s = BackgroundServer(Engine(model, tok, EngineConfig(max_batch_size=4, cache_lens=4096)), signalling,
                         "tiny").start()
    s.signalling = signalling
    yield s
    s.stop()


def others_meanwhile(url: str, started: threading.Event, big_done: threading.Event) -> dict[str, float]:
    """Once the big request is under way: /health and a short chat, each timed; they must end before it does."""
    assert started.wait(30)
    out = {}
    with httpx.Client(base_url=url, timeout=60) as c:
        t0 = time.monotonic()
        assert c.get("/health").status_code == 200
        out["health_s"] = time.monotonic() - t0
        assert not big_done.is_set(), "/health waited for the big request"
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json=SHORT)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        out["short_chat_s"] = time.monotonic() - t0
        assert not big_done.is_set(), "the short request waited for the big request"
    return out


def big_beside_others(url: str, started: threading.Event, after=lambda: None, **post) -> tuple[dict, dict]:
    """POST the big request from a thread and, once `started`, the others; (their latencies, the big result).
    `after` runs when the others are done (or failed), before waiting for the big request."""
    big_done, result = threading.Event(), {}

    def big():
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", timeout=120, **post)
        result["status"], result["big_s"], result["body"] = r.status_code, time.monotonic() - t0, r.text
        big_done.set()

    t = threading.Thread(target=big)
    t.start()
    try:
        lat = others_meanwhile(url, started, big_done)
    finally:
        after()
        t.join(120)
    assert big_done.is_set()
    return lat, result


def test_slow_sender_delays_nobody(server):
    started, others_done = threading.Event(), threading.Event()

    def trickle():
        yield b'{"messages": [{"role": "user", "content": "'
        deadline = time.monotonic() + 20  # a blocked server would see the body end here, then serve the others
        sent = 0
        while not others_done.is_set() and time.monotonic() < deadline:
            yield b"a " * 4096
            sent += 1
            if sent == 5:
                started.set()
            time.sleep(0.05)
        yield b'"}], "max_tokens": 1}'

    lat, result = big_beside_others(server.url, started, others_done.set, content=trickle(),
                                    headers={"Content-Type": "application/json"})
    assert result["status"] in (200, 400)
    print(f"\nslow sender: health {lat['health_s'] * 1e3:.1f} ms, short chat {lat['short_chat_s'] * 1e3:.1f} ms "
          f"while the body was still arriving; the slow request took {result['big_s']:.2f} s")


def test_huge_prompt_delays_nobody(server):
    started = server.signalling.big
    started.clear()
    body = {"messages": [{"role": "user", "content": "hello world " * (HUGE_WORDS // 2)}], "max_tokens": 1}
    lat, result = big_beside_others(server.url, started, json=body)
    # it is refused, but only once it is tokenized: its length is not known before
    assert result["status"] == 400 and "maximum context length" in result["body"]
    print(f"\nhuge prompt ({len(body['messages'][0]['content']) / 1e6:.1f} MB): health {lat['health_s'] * 1e3:.1f} ms, "
          f"short chat {lat['short_chat_s'] * 1e3:.1f} ms while it was tokenized; it took {result['big_s']:.2f} s "
          f"to its 400")
