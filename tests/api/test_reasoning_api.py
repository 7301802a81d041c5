"""reasoning_content end to end, with a scripted model whose next token is a fixed successor of the current one.

A random model never writes `<think>`, so a stand-in with the real config (and so the real pools and tokenizer)
writes a known answer: "<think>Let me think</think>\n\nHello!" then EOS.
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

THINK, END_THINK, IM_END = 151667, 151668, 151645


class SuccessorModel(nn.Module):
    """logits[i] is one-hot at successor[input token i] (EOS when it has none)."""

    def __init__(self, config, successor: dict[int, int]):
        super().__init__()
        self.config = config
        self.successor = successor
        self.dummy = nn.Parameter(torch.zeros(1), requires_grad=False)  # device and dtype for the pools

    def forward(self, batch):
        ids = batch.input_ids[batch.logits_indices].tolist()
        # a margin of 60 nats: with default sampling (temperature 1) a stray token has probability ~1e-21
        logits = torch.full((len(ids), self.config.vocab_size), -30.0)
        for row, t in enumerate(ids):
            logits[row, self.successor.get(t, IM_END)] = 30.0
        return logits


@pytest.fixture(scope="module")
def server(tiny):
    config, tok = tiny[0].config, tiny[1]
    let, me, think, nn_, hello, bang = (tok.encode(s)[0] for s in ("Let", " me", " think", "\n\n", "Hello", "!"))
    newline = tok.encode("\n")[0]
    chain = {newline: THINK, THINK: let, let: me, me: think, think: END_THINK, END_THINK: nn_, nn_: hello,
             hello: bang, bang: IM_END}
    engine = Engine(SuccessorModel(config, chain), tok, EngineConfig(max_batch_size=4))
    srv = BackgroundServer(engine, tok, "scripted").start()
    yield srv
    srv.stop()


MESSAGES = [{"role": "user", "content": "hi"}]


def test_reasoning_content_is_split_from_content(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=20)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Let me think"
    assert msg.content == "Hello!" and r.choices[0].finish_reason == "stop"


def test_reasoning_streams_as_its_own_deltas(server):
    body = {"messages": MESSAGES, "max_tokens": 20, "stream": True}
    deltas = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"])
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == ("Let me think", "Hello!")
    kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning before any content


def test_thinking_off_skips_the_reasoning(server):
    body = {"messages": MESSAGES, "max_tokens": 20, "chat_template_kwargs": {"enable_thinking": False}}
    msg = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
    assert msg["content"] == "Hello!" and msg["reasoning_content"] is None


def test_completions_return_the_raw_text(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "\n", "max_tokens": 20}, timeout=30).json()
    assert r["choices"][0]["text"] == "<think>Let me think</think>\n\nHello!"
