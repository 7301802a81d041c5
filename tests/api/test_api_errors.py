"""Every error case answers with its status and OpenAI's error shape, and the next request is served."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from .conftest import make_server, pools_full

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny):
    # one running request at a time and one waiting, so the queue limit is easy to reach
    srv = make_server(tiny, api_key=KEY, max_batch_size=1, max_queued_requests=1, cache_lens=4096)
    yield srv
    srv.stop()


def post(server, path: str, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(server.url + path, headers=headers, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["type"]
    for w in words:
        assert w in body["error"]["message"]
    return body["error"]


def assert_still_serving(server) -> None:
    r = post(server, "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


BAD_REQUESTS = {
    "max_tokens zero": ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ("/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    "completion max_tokens zero without echo": ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    "temperature negative": ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, "temperature"),
    "top_p zero": ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    "top_p above one": ("/v1/completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
    "unknown role": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    "no messages": ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    "messages wrong type": ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    "temperature wrong type": ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    "max_tokens wrong type": ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    "stop wrong type": ("/v1/completions", {"prompt": "a", "stop": 5}, "stop"),
    "prompt wrong type": ("/v1/completions", {"prompt": {"text": "a"}}, "prompt"),
    "token id outside vocabulary": ("/v1/completions", {"prompt": [1, 2, 10**9]}, "vocabulary"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "logprobs"),
    "too many top_logprobs": ("/v1/completions", {"prompt": "a", "logprobs": 50}, "logprobs"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_invalid_parameters_are_400(server, case):
    path, body, word = BAD_REQUESTS[case]
    err = assert_error(post(server, path, json=body), 400, word)
    assert err["type"] == "invalid_request_error"
    assert_still_serving(server)


def test_malformed_json_is_400(server):
    headers = {**AUTH, "Content-Type": "application/json"}
    assert_error(post(server, "/v1/chat/completions", headers=headers, content=b'{"messages": [}'), 400, "JSON")
    assert_still_serving(server)


def test_context_length_is_400(server):
    err = assert_error(post(server, "/v1/completions", json={"prompt": "a", "max_tokens": 5000}), 400,
                       "maximum context length")
    assert err["param"] == "max_tokens"
    long_prompt = list(range(1000, 5200))  # longer than the 4096-token context on its own
    assert_error(post(server, "/v1/completions", json={"prompt": long_prompt}), 400, "maximum context length")
    assert_still_serving(server)


def test_unknown_model_is_404(server):
    err = assert_error(post(server, "/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404, "gpt-17")
    assert err["code"] == "model_not_found"
    assert_error(post(server, "/v1/nothing-here", json={}), 404)
    assert_still_serving(server)


def test_wrong_api_key_is_401(server):
    assert_error(post(server, "/v1/chat/completions", headers={"Authorization": "Bearer nope"}, json=CHAT), 401)
    assert_error(post(server, "/v1/chat/completions", headers={}, json=CHAT), 401)
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert_still_serving(server)


def test_openai_client_sees_the_errors(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_full_queue_is_503(server):
    long = {"prompt": "busy", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    engine = server.engine
    results: dict = {}
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json=long, timeout=60) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it would close the connection
        next(line for line in lines if line.startswith("data: "))  # it is running now

        def waiting_request():
            results["waiting"] = post(server, "/v1/completions", json={"prompt": "queued", "max_tokens": 2})

        t = threading.Thread(target=waiting_request)
        t.start()
        deadline = time.monotonic() + 10
        while engine.stats()["num_waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["num_waiting"] == 1
        err = assert_error(post(server, "/v1/completions", json={"prompt": "one too many", "max_tokens": 2}), 503,
                           "overloaded")
        assert err["type"] == "server_error"
    t.join(timeout=30)  # closing the stream aborted the long request; the queued one then ran
    assert results["waiting"].status_code == 200
    assert_still_serving(server)
    deadline = time.monotonic() + 10
    while not pools_full(engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pools_full(engine)
