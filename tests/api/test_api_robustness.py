"""Robustness of the HTTP layer: invalid Unicode, body size limits, work off the event loop, `created`, HEAD
/metrics, no empty `tool_calls`, integer error codes everywhere, continuous usage stats in streams."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ktrans.api.app import DEFAULT_MAX_REQUEST_BODY_BYTES
from ktrans.engine.engine import Engine, EngineConfig
from ktrans.api.server import BackgroundServer

from .test_api_errors import assert_error

LIMIT = 4096
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
JSON = {"Content-Type": "application/json"}


class ThreadRecorder:
    """The tokenizer, recording the thread of every encode / chat template call."""

    def __init__(self, tok):
        self._tok, self.threads = tok, []

    def encode(self, *a, **kw):
        self.threads.append(threading.get_ident())
        return self._tok.encode(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.threads.append(threading.get_ident())
        return self._tok.apply_chat_template(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def srv(tiny):
    """The API with a small body limit and a tokenizer that records the threads it is called on."""
    model, tok = tiny
    recorder = ThreadRecorder(tok)
    s = BackgroundServer(Engine(model, tok, EngineConfig(max_batch_size=4, cache_lens=4096)), recorder, "tiny",
                         max_request_body_bytes=LIMIT).start()
    s.tokenizer = recorder
    yield s
    s.stop()


def post(srv, path, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, timeout=30, **kw)


def events(srv, path: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", srv.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


# ---- 1. lone surrogates ----------------------------------------------------------------------------------
SURROGATE_CASES = {
    "chat content": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                     "messages.0.content"),
    "chat content part": ("/v1/chat/completions",
                          '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
                          "messages.0.content.0.text"),
    "completion prompt": ("/v1/completions", '{"prompt": "x\\ud800", "max_tokens": 2}', "prompt"),
    "completion prompt list": ("/v1/completions", '{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "prompt.1"),
    "tokenize prompt": ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    "tokenize messages": ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
                          "messages.0.content"),
    "a key": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "x\\ud800": 1}', None),
}


@pytest.mark.parametrize("case", list(SURROGATE_CASES))
def test_lone_surrogate_is_400_naming_the_field(srv, case):
    path, raw, field = SURROGATE_CASES[case]
    err = assert_error(post(srv, path, content=raw.encode(), headers=JSON), 400, "surrogate")
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    if field is not None:
        assert err["param"] == field and err["message"].startswith(field + ":")
    assert post(srv, "/v1/chat/completions", json=CHAT).status_code == 200


def test_a_surrogate_pair_is_fine(srv):
    r = post(srv, "/tokenize", content=b'{"prompt": "smile \\ud83d\\ude00"}', headers=JSON)
    assert r.status_code == 200
    assert srv.tokenizer._tok.decode(r.json()["tokens"]) == "smile \U0001F600"


# ---- 2. body size limit, work off the event loop ---------------------------------------------------------
def test_default_body_limit_is_16_mib():
    assert DEFAULT_MAX_REQUEST_BODY_BYTES == 16 * 1024 * 1024


def test_body_over_the_limit_by_content_length_is_413(srv):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (2 * LIMIT)}]}).encode()
    err = assert_error(post(srv, "/v1/chat/completions", content=body, headers=JSON), 413, str(LIMIT))
    assert err["code"] == 413
    assert_error(post(srv, "/tokenize", content=json.dumps({"prompt": "y" * LIMIT}).encode(), headers=JSON), 413)
    assert post(srv, "/v1/chat/completions", json=CHAT).status_code == 200


def test_chunked_body_over_the_limit_is_413(srv):
    def chunks():  # no Content-Length: sent with Transfer-Encoding: chunked
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"z" * 1024
        yield b'", "max_tokens": 2}'

    err = assert_error(post(srv, "/v1/completions", content=chunks(), headers=JSON), 413, "larger than")
    assert err["code"] == 413

    def small():
        yield b'{"prompt": "hello", '
        yield b'"max_tokens": 2}'

    assert post(srv, "/v1/completions", content=small(), headers=JSON).status_code == 200


def test_templating_and_tokenization_run_off_the_event_loop(srv):
    srv.tokenizer.threads.clear()
    assert post(srv, "/v1/chat/completions", json=CHAT).status_code == 200
    assert post(srv, "/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
    assert post(srv, "/tokenize", json={"messages": CHAT["messages"]}).status_code == 200
    assert len(srv.tokenizer.threads) >= 5  # chat: template + encode; completion: encode; tokenize: both
    assert srv._thread.ident not in srv.tokenizer.threads


def test_malformed_and_invalid_bodies_still_400(srv):
    assert_error(post(srv, "/v1/chat/completions", content=b'{"messages": [}', headers=JSON), 400, "JSON")
    assert_error(post(srv, "/v1/chat/completions", content=b"\xff\xfe{", headers=JSON), 400)
    assert_error(post(srv, "/v1/chat/completions", content=b"", headers=JSON), 400)
    err = assert_error(post(srv, "/v1/chat/completions", json={**CHAT, "temperature": "hot"}), 400, "temperature")
    assert err["param"] == "temperature"


# ---- 3. created is the request's time --------------------------------------------------------------------
def test_created_is_the_request_time(srv, monkeypatch):
    monkeypatch.setattr(srv.api, "created", 1)  # as if the server had started long ago
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "a", "max_tokens": 2})):
        before = int(time.time())
        created = post(srv, path, json=body).json()["created"]
        assert before <= created <= int(time.time())


# ---- 4. HEAD /metrics ------------------------------------------------------------------------------------
def test_head_metrics_is_200_without_body(srv):
    r = httpx.head(srv.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.content == b""
    assert httpx.head(srv.url + "/health", timeout=30).status_code == 200
    assert "ktrans:" in httpx.get(srv.url + "/metrics", timeout=30).text


# ---- 5. no empty tool_calls ------------------------------------------------------------------------------
def test_plain_chat_reply_has_no_tool_calls_key(srv):
    msg = post(srv, "/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["role"] == "assistant"


# ---- 6. integer error codes on /tokenize and /detokenize -------------------------------------------------
def test_tokenize_and_detokenize_errors_have_integer_codes(srv):
    err = assert_error(post(srv, "/tokenize", json={"prompt": "a", "messages": CHAT["messages"]}), 400)
    assert err["code"] == 400
    assert assert_error(post(srv, "/tokenize", json={}), 400)["code"] == 400
    err = assert_error(post(srv, "/detokenize", json={"tokens": [10**9]}), 400, "vocabulary")
    assert err["code"] == 400 and err["param"] == "tokens"
    assert assert_error(post(srv, "/detokenize", json={"tokens": "x"}), 400)["code"] == 400


# ---- 7. continuous usage stats ---------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 4, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Count: one two", "max_tokens": 4, "ignore_eos": True, "temperature": 0}),
])
def test_continuous_usage_stats_on_every_chunk(srv, path, body):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(srv, path, {**body, "stream": True, "stream_options": opts})
    assert chunks and all("usage" in c for c in chunks)
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert prompt > 0 and all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 4
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == []  # the include_usage chunk still comes last

    plain = events(srv, path, {**body, "stream": True})
    assert not any("usage" in c for c in plain)


@pytest.mark.parametrize("depth", [65, 1500])  # the body stays under this server's 4 KiB limit
def test_deep_nesting_is_a_400(srv, depth):
    """Past Python's JSON recursion limit (a RecursionError, once a 500) or past MAX_JSON_DEPTH (64): a 400."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "tools": ' + b"[" * depth + b"]" * depth + b"}"
    for path in ("/v1/chat/completions", "/tokenize"):
        err = assert_error(post(srv, path, content=body, headers=JSON), 400, "deep")
        assert err["code"] == 400
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1]}}}}
    ok = post(srv, "/v1/chat/completions", json={**CHAT, "guided_json": nested})
    assert ok.status_code == 200, ok.text
