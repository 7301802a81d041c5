"""Structured outputs end to end: response_format, vLLM's guided_* and structured_outputs fields, tool_choice
"required" / a named function, and the grammar starting after `</think>` on a thinking prompt.

The embedded model has random weights, so without the grammar its text is noise: every JSON answer that parses
and matches a bounded schema (enums, fixed keys) below is the grammar's work.
"""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from ktrans.api.server import BackgroundServer
from ktrans.engine.engine import Engine, EngineConfig

from .test_reasoning_api import SuccessorModel


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "size": {"enum": [1, 2, 3]}},
          "required": ["color", "ok", "size"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Pick a color."}]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}} for n in ("get_weather", "get_time")]


def matches(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"color", "ok", "size"} and obj["color"] in ("red", "green", "blue")
            and isinstance(obj["ok"], bool) and obj["size"] in (1, 2, 3))


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    s = BackgroundServer(Engine(model, tok, EngineConfig(max_batch_size=4, cache_lens=4096)), tok, "tiny").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_json_schema_holds_for_a_random_model(client, server):
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed, n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
        for c in r.choices:
            assert c.finish_reason == "stop", c
            assert matches(json.loads(c.message.content)), c.message.content


def test_without_the_grammar_the_random_model_is_noise(client):
    """The check above can fail: the same request without response_format is not JSON."""
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content or "")


def test_streamed_json_schema(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert matches(json.loads(text)), text


def test_json_object_starts_an_object(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_vllm_json_fields_on_completions(client, field):
    extra = {"guided_json": SCHEMA} if field == "guided_json" else {"structured_outputs": {"json": SCHEMA}}
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=40, temperature=1.0, seed=5,
                                  extra_body=extra)
    assert matches(json.loads(r.choices[0].text)), r.choices[0].text


def test_choice_and_regex(client):
    for extra in ({"guided_choice": ["alpha", "beta", "gamma"]}, {"structured_outputs": {"choice": ["alpha", "beta"]}}):
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=1.0, seed=1, n=4,
                                      extra_body=extra)
        allowed = next(iter(extra.values()))
        allowed = allowed["choice"] if isinstance(allowed, dict) else allowed
        assert all(c.text in allowed and c.finish_reason == "stop" for c in r.choices), r.choices
    for extra in ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, {"structured_outputs": {"regex": r"(yes|no)!"}}):
        pattern = next(iter(extra.values()))
        pattern = pattern["regex"] if isinstance(pattern, dict) else pattern
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=1.0, seed=2,
                                      extra_body=extra)
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


def test_lark_grammar(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_grammar": 'start: "x" ("+" "x"){2}'})
    assert r.choices[0].text == "x+x+x"


def test_tool_choice_required_and_named(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=0,
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0].function
    assert call.name in ("get_weather", "get_time") and json.loads(call.arguments)["unit"] in ("c", "f")
    for name in ("get_weather", "get_time"):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                                           parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls
        assert [t.function.name for t in calls] == [name] and set(json.loads(calls[0].function.arguments)) == {"unit"}


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),  # the second one given
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_grammar": "start: ((("}, "guided_grammar"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.0"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == 400


# ---- thinking: the grammar starts after </think> -------------------------------------------------------------
END_THINK = 151668


class ThinkingTemplate:
    """The tokenizer, with a template that opens `<think>` after the generation prompt (as Thinking models do)."""

    def __init__(self, tok):
        self._tok = tok

    def apply_chat_template(self, *a, **kw):
        text = self._tok.apply_chat_template(*a, **{**kw, "enable_thinking": True})
        return text + "<think>\n" if kw.get("enable_thinking", True) else text

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def thinking(tiny):
    config, tok = tiny[0].config, tiny[1]
    newline, a, b = tok.encode("\n")[0], tok.encode("Hmm")[0], tok.encode(" ok")[0]
    # "<think>\n" ends the prompt; the model writes "Hmm ok</think>" and then wants to stop
    engine = Engine(SuccessorModel(config, {newline: a, a: b, b: END_THINK}), tok, EngineConfig(max_batch_size=2))
    s = BackgroundServer(engine, ThinkingTemplate(tok), "think").start()
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    s.stop()


def test_grammar_starts_after_think(thinking):
    r = thinking.chat.completions.create(
        model="think", messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Hmm ok"
    assert matches(json.loads(msg.content)), msg.content


def test_without_an_open_think_the_grammar_starts_at_once(thinking):
    r = thinking.chat.completions.create(
        model="think", messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
    msg = r.choices[0].message
    assert not msg.model_extra.get("reasoning_content") and matches(json.loads(msg.content)), msg


def test_properties_come_in_the_schemas_order(client):
    schema = {"type": "object", "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=20, temperature=0,
                                  extra_body={"guided_json": schema})
    assert r.choices[0].text == '{"zeta":1,"alpha":2}'
