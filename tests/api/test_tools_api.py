"""Tool calls (Qwen3's `<tool_call>` blocks, vLLM's hermes parser) end to end, with a scripted model.

A random model never writes a tool call, so a stand-in with the real config (and so the real pools and tokenizer)
writes a script set by the test: the real token ids of a known text, then EOS.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from torch import nn

from ktrans.engine.engine import Engine, EngineConfig
from ktrans.api.server import BackgroundServer
from ktrans.api.tools import ToolCallParser, parse_tool_calls

TOOL_CALL, END_TOOL_CALL, IM_END = 151657, 151658, 151645


class ScriptedModel(nn.Module):
    """Writes `script` (token ids) after whatever prompt it gets, then EOS. One request at a time."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.script: list[int] = []
        self.prompt_len = 0
        self.dummy = nn.Parameter(torch.zeros(1), requires_grad=False)  # device and dtype for the pools

    def forward(self, batch):
        positions = batch.positions[batch.logits_indices].tolist()
        logits = torch.full((len(positions), self.config.vocab_size), -30.0)
        for row, p in enumerate(positions):
            if not batch.is_decode:  # the prompt's last token: the script starts after it
                self.prompt_len = p + 1
            k = p + 1 - self.prompt_len
            logits[row, self.script[k] if k < len(self.script) else IM_END] = 30.0
        return logits


@pytest.fixture(scope="module")
def setup(tiny):
    config, tok = tiny[0].config, tiny[1]
    model = ScriptedModel(config)
    engine = Engine(model, tok, EngineConfig(max_batch_size=1, chunk_size=4096))
    srv = BackgroundServer(engine, tok, "scripted").start()

    def say(text: str) -> None:
        model.script = tok.encode(text)

    yield srv, tok, say
    srv.stop()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_the_tags_are_single_tokens(setup):
    _, tok, _ = setup
    assert tok.encode(CALL)[0] == TOOL_CALL and tok.encode(CALL)[-1] == END_TOOL_CALL
    assert tok.decode([TOOL_CALL], skip_special_tokens=True) == "<tool_call>"  # ordinary text, not dropped


def test_tool_call_with_the_openai_client(setup):
    srv, _, say = setup
    say(CALL)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def stream(srv, body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    return chunks


def test_streamed_tool_calls(setup):
    srv, _, say = setup
    say("Let me check.\n\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"))
    chunks = stream(srv, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80})
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["index"] for tc in calls] == [0, 1] and all(tc["id"].startswith("call_") for tc in calls)
    assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert not any("<tool_call>" in (d.get("content") or "") for d in deltas)
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_content_before_the_call_and_reasoning(setup):
    srv, _, say = setup
    say("<think>Paris, so call it</think>\n\nOne moment.\n" + CALL)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
    msg = r["message"]
    assert msg["reasoning_content"] == "Paris, so call it" and msg["content"] == "One moment."
    assert [tc["function"]["name"] for tc in msg["tool_calls"]] == ["get_weather"]
    assert r["finish_reason"] == "tool_calls"


def test_malformed_json_stays_text(setup):
    srv, _, say = setup
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    say("Oops " + bad)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Oops " + bad and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    deltas = [c["delta"] for c in stream(srv, body)]
    assert "".join(d.get("content") or "" for d in deltas) == "Oops " + bad
    assert not any("tool_calls" in d for d in deltas)


def test_without_tools_the_raw_text_is_returned(setup):
    srv, _, say = setup
    say("Sure.\n" + CALL)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        body = {"messages": MESSAGES, "max_tokens": 80, **extra}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
        assert r["message"]["content"] == "Sure.\n" + CALL and "tool_calls" not in r["message"]
        assert r["finish_reason"] == "stop"
        assert "".join(c["delta"].get("content") or "" for c in stream(srv, body)) == "Sure.\n" + CALL


def test_tool_choice_forms_are_accepted(setup):
    srv, _, say = setup
    say(CALL)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 60}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "tool_choice": "sometimes"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_multi_turn_with_a_tool_reply_renders(setup):
    srv, _, say = setup
    say("It is sunny in Paris.")
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, max_tokens=60)
    assert r.choices[0].message.content == "It is sunny in Paris." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    text = srv_render(srv, messages)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def srv_render(srv, messages) -> str:
    ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    return httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]


def test_parser_over_one_character_deltas():
    text = "  Hi <tool_c there.\n" + CALL + "\n\n" + CALL.replace("Paris", "Rome") + "\n"
    p = ToolCallParser()
    content, calls = "", []
    for ch in text:
        c, new = p.feed(ch)
        content, calls = content + c, calls + new
    c, new = p.finish()
    content, calls = content + c, calls + new
    whole, whole_calls = parse_tool_calls(text)
    assert content == whole == "Hi <tool_c there."
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert [c["index"] for c in calls] == [0, 1] and len(whole_calls) == 2
    assert parse_tool_calls("<tool_call>\n{\"name\": \"f\"") == ("<tool_call>\n{\"name\": \"f\"", [])  # unclosed
    assert parse_tool_calls("") == (None, [])
