"""Fuzzing every endpoint with hypothesis: random JSON bodies and strings (lone surrogates, control characters,
huge numbers, NaN and Infinity, deep nesting, wrong types, empty prompts), whole or as one field of a valid body.

Every answer is 2xx, or 4xx in OpenAI's error shape; afterwards a greedy request gives the same output as before
and every KV page and state slot is free. Derandomized with a bounded number of examples, so a run is the same
every time and takes seconds.
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ktrans.engine.engine import Engine, EngineConfig, wait_idle
from ktrans.api.server import BackgroundServer

from .conftest import pools_full

GREEDY = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0}
POSTS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
GETS = ["/v1/models", "/health", "/metrics", "/tokenizer_info"]
BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = ["model", "messages", "prompt", "tokens", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "stream", "stream_options", "logprobs",
          "top_logprobs", "echo", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
          "tools", "tool_choice", "parallel_tool_calls", "response_format", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "structured_outputs", "chat_template_kwargs", "add_generation_prompt",
          "add_special_tokens", "suffix", "skip_special_tokens"]
NASTY = ["", "\ud800", "a\udfffb", "\x00", "\x1b[31m\x07", "\u202e", "<|im_end|>", "<think>", "</tool_call>",
         "{{ raise_exception('x') }}", "\uffff", "\U0010ffff", "x" * 3000]
NUMBERS = [0, -1, 1, 2**31, 2**63, -(2**64), 10**30, 1e308, -1e-308, float("nan"), float("inf"), float("-inf"), 0.5]

text = st.one_of(st.sampled_from(NASTY), st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF,
                                                                exclude_categories=()), max_size=40))
number = st.one_of(st.sampled_from(NUMBERS), st.integers(-(2**70), 2**70), st.floats(allow_nan=True,
                                                                                       allow_infinity=True))
leaf = st.one_of(st.none(), st.booleans(), number, text)
value = st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                  st.dictionaries(st.sampled_from(FIELDS + ["role", "content",
                                                                                            "type", "json_schema",
                                                                                            "schema", "function",
                                                                                            "name"]) | text,
                                                                  kids, max_size=4)), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                           "content": st.one_of(text, value)}), max_size=3)


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def encode(obj) -> bytes:
    # allow_nan: NaN and Infinity go on the wire as JSON's common extension (Python, JavaScript clients send them)
    return json.dumps(obj, allow_nan=True, ensure_ascii=True).encode()


@st.composite
def request(draw) -> tuple[str, str, bytes]:
    """(method, path, body bytes): a random value, a valid body with random fields, or raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return "GET", draw(st.sampled_from(GETS)), b""
    path = draw(st.sampled_from(POSTS))
    kind = draw(st.sampled_from(["value", "fields", "fields", "fields", "messages", "raw", "deep"]))
    if kind == "value":
        return "POST", path, encode(draw(value))
    if kind == "raw":
        return "POST", path, draw(st.binary(max_size=64))
    if kind == "deep":
        return "POST", path, deep(draw(st.sampled_from([10, 1000, 100_000]))).encode()
    body = dict(BASES[path])
    if kind == "messages":
        body["messages"] = draw(messages)
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        body[name] = draw(value)
    return "POST", path, encode(body)


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    # short outputs and a small context, so a random valid request is quick whatever max_tokens it asks
    engine = Engine(model, tok, EngineConfig(max_batch_size=4, cache_lens=2048, max_model_len=96, max_new_tokens=4))
    s = BackgroundServer(engine, tok, "tiny").start()
    yield s
    s.stop()


def send(client: httpx.Client, method: str, path: str, body: bytes) -> httpx.Response:
    if method == "GET":
        return client.get(path)
    with client.stream("POST", path, content=body, headers={"Content-Type": "application/json"}) as r:
        r.read()  # streams too: every event, to the end
        return r


def check(r: httpx.Response, path: str, body: bytes) -> None:
    where = f"{path} {body[:300]!r}"
    assert r.status_code < 300 or 400 <= r.status_code < 500, f"{r.status_code} {r.text[:300]} for {where}"
    if r.status_code >= 400:
        err = r.json()
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, where
        assert isinstance(err["error"]["message"], str) and err["error"]["code"] == r.status_code, where


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # the repr of a 200 kB body
def test_fuzz_every_endpoint(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        before = client.post("/v1/chat/completions", json=GREEDY).json()["choices"][0]["message"]["content"]
        statuses: dict[int, int] = {}

        @settings(max_examples=250, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(request())
        def one(req):
            r = send(client, *req)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            check(r, req[1], req[2])

        one()
        assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20, statuses  # both kinds are exercised
        assert wait_idle(server.engine) and pools_full(server.engine)
        after = client.post("/v1/chat/completions", json=GREEDY).json()["choices"][0]["message"]["content"]
        assert after == before
        assert pools_full(server.engine)
