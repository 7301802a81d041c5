"""End to end: real uvicorn on a loopback port, driven by the `openai` client and raw httpx SSE."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
import time

import httpx
import openai
import pytest

from ktrans import cli
from ktrans.api.chat_client import chat

from .conftest import make_server, pools_full

PROMPTS = ["Hi", "The capital of France is", "Count: one two three four five six seven",
           "A longer prompt " * 6, "x", "def f(a, b):\n    return", "Lorem ipsum dolor sit amet, " * 3,
           "Tokens, tokens and more tokens to prefill in several chunks. " * 2]


@pytest.fixture(scope="module")
def server(tiny):
    srv = make_server(tiny, chunk_size=64, max_batch_size=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def sse_events(url: str, path: str, body: dict) -> list:
    """The data lines of an SSE response, JSON-decoded ('[DONE]' kept as a string)."""
    events = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            else:
                assert line == "", f"unexpected SSE line {line!r}"
    return events


def wait_pools_full(engine, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pools_full(engine) and engine.stats()["num_waiting"] == 0:
            return True
        time.sleep(0.02)
    return False


# ---- greedy parity with `ktrans generate` -------------------------------------------------------------


def test_greedy_alone_equals_ktrans_generate(client, capsys):
    assert cli.main(["generate", "--prompt", PROMPTS[1], "--max_new_tokens", "12", "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    got = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert got.choices[0].text == want["text"]
    assert got.usage.completion_tokens == len(want["output_ids"])
    assert got.usage.prompt_tokens == len(want["prompt_ids"])


async def _concurrent(url: str, tok, reference, n_tokens: int = 10):
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    lengths = [4 + 2 * i for i in range(len(PROMPTS))]  # different output lengths too
    calls = [aclient.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0)
             for p, n in zip(PROMPTS, lengths)]
    results = await asyncio.gather(*calls)
    for p, n, r in zip(PROMPTS, lengths, results):
        want = reference(tok.encode(p), n)
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True), p
        assert r.usage.completion_tokens == len(want)
    await aclient.close()


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_greedy_concurrent_equals_generate(tiny, reference, chunk_size):
    _, tok = tiny
    srv = make_server(tiny, chunk_size=chunk_size, max_batch_size=8)
    try:
        asyncio.run(_concurrent(srv.url, tok, reference))
        assert wait_pools_full(srv.engine)
    finally:
        srv.stop()


def test_preemption_under_tiny_cache_completes_every_request(tiny, reference):
    _, tok = tiny
    srv = make_server(tiny, chunk_size=32, max_batch_size=8, cache_lens=48, page_size=4)
    # Hold the engine until every request is in its inbox, then put them in PROMPTS' order: admitted together in
    # that order they outgrow the 12 pages and preempt. Left to the HTTP arrival time, an early request could finish
    # before a late one came (it did, in 1 of 8 runs); left to the arrival order, 25 of 1500 random orders of the
    # eight requests preempt nothing (a scheduler simulation; it failed 1 of 5 runs of the suite). This order
    # preempts 3 times, every time.
    engine, gate = srv.engine, threading.Event()
    step = engine.poll
    engine.poll = lambda: gate.wait() and step()
    order = {tuple(tok.encode(p)): i for i, p in enumerate(PROMPTS)}

    def release():
        while engine._inbox.qsize() < len(PROMPTS):
            time.sleep(0.005)
        items = [engine._inbox.get() for _ in PROMPTS]  # ("add", tracked request); the engine waits on the gate
        for item in sorted(items, key=lambda kv: order[tuple(kv[1].req.prompt_ids)]):
            engine._inbox.put(item)
        gate.set()

    threading.Thread(target=release, daemon=True).start()
    try:
        asyncio.run(_concurrent(srv.url, tok, reference))
        assert srv.engine.scheduler.num_preemptions > 0
        assert wait_pools_full(srv.engine)
        metrics = httpx.get(srv.url + "/metrics").text
        assert "ktrans:num_preemptions_total" in metrics
    finally:
        srv.stop()


# ---- streaming shape ------------------------------------------------------------------------------------


def test_chat_stream_shape(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(server.url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    first, *middle, finish, usage, _ = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(e["choices"][0]["delta"]) <= {"content", "reasoning_content"} for e in middle)
    assert all(e["choices"][0]["finish_reason"] is None for e in middle)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 6
    assert len({e["id"] for e in events[:-1]}) == 1
    plain = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}).json()
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in middle) == plain["choices"][0]["message"][
        "content"]


def test_completion_stream_without_usage(server):
    events = sse_events(server.url, "/v1/completions", {"prompt": "abc", "max_tokens": 4, "stream": True})
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_openai_client_streams(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=5, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5


# ---- sampling features ------------------------------------------------------------------------------------


def test_stop_string_across_tokens(server, client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=0)
    pieces = full.choices[0].logprobs.tokens
    text = full.choices[0].text
    i = next(k for k in range(1, len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 1
             and "\ufffd" not in pieces[k] + pieces[k + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:1]  # starts inside token i, ends inside token i + 1
    cut = text.index(stop)
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == text[:cut] and got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop
    events = sse_events(server.url, "/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0,
                                                        "stop": stop, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:cut]


def test_seeded_sampling_reproducible_under_concurrency(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 42}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            alone = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            noise = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 15, "temperature": 1.0})
                     for p in PROMPTS]
            together = await asyncio.gather(c.post("/v1/completions", json=body), *noise)
            return alone, together[0].json()["choices"][0]["text"]

    alone, together = asyncio.run(run())
    assert alone == together


def test_chat_logprobs(client, tiny, reference):
    _, tok = tiny
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the top one
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_echo_with_prompt_logprobs(client, tiny):
    model, tok = tiny
    from ..model.helpers import prompt_logprobs

    ids = tok.encode("Score this prompt please")
    direct = prompt_logprobs(model, ids)  # one forward, no engine
    for max_tokens in (0, 1):  # 0: what loglikelihood evaluations send, scoring only
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0, echo=True,
                                      logprobs=1)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for k, tid in enumerate(ids[1:], start=1):
            assert lp.token_logprobs[k] == pytest.approx(direct[k - 1], abs=1e-4)
        assert r.choices[0].text.startswith(tok.decode(ids))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_token_id_prompts_and_several_prompts(client, tiny, reference):
    _, tok = tiny
    a, b = tok.encode("first prompt"), tok.encode("second one here")
    r = client.completions.create(model="tiny", prompt=[a, b], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, (a, b)):
        assert c.text == tok.decode(reference(p, 4), skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(a) + len(b)


# ---- resources ------------------------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_pages_and_slot(server):
    body = {"prompt": "go on and on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        assert server.engine.stats()["num_running"] == 1
    assert wait_pools_full(server.engine)


def test_disconnect_while_waiting_for_a_whole_response(server):
    body = {"prompt": "long one", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    assert wait_pools_full(server.engine)


# ---- small endpoints ------------------------------------------------------------------------------------


def test_models_health_tokenize_metrics(server, client, tiny):
    _, tok = tiny
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert ids == tok.encode("hello world")
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "hello world"
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat_ids["count"] == len(chat_ids["tokens"]) > 3
    text = httpx.get(server.url + "/metrics").text
    for name in ("ktrans:num_requests_running", "ktrans:num_requests_waiting", "ktrans:kv_cache_usage_perc",
                 "ktrans:state_slot_usage_perc", "ktrans:prompt_tokens_total", "ktrans:generation_tokens_total",
                 "ktrans:time_to_first_token_seconds_bucket", "ktrans:inter_token_latency_seconds_bucket",
                 "ktrans:e2e_request_latency_seconds_bucket"):
        assert name in text, name


def test_startup_summary(server):
    from ktrans.config import RULES_DIR
    from ktrans.inject import load_model
    from ktrans.api.server import ServeOptions, summary
    from ktrans.model.source import ModelSource

    _, injection = load_model(ModelSource(), rules=RULES_DIR / "Qwen3Next-cpu.yaml", show_progress=False)
    text = summary(server.engine, "tiny", ServeOptions(), injection, "Qwen3Next-cpu.yaml")
    for words in ("placement  rules Qwen3Next-cpu.yaml", "KQwen3NextAttention", "prefill cpu", "KV cache",
                  "pages of 16", "states     8 slots", "--chunk_size 64"):
        assert words in text, words


def test_thinking_off_gives_plain_content(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    assert r.choices[0].message.content


def test_chat_client(server):
    out = io.StringIO()
    stdin = io.StringIO("hello there\n/think off\nand again\n/exit\n")
    assert chat(server.url, max_tokens=3, temperature=0.0, stdin=stdin, out=out) == 0
    assert out.getvalue().count("[answer]") == 2 and "(thinking off)" in out.getvalue()


def test_bench_serve(server, capsys):
    assert cli.main(["bench", "serve", "--url", server.url, "--concurrency", "1,2", "--prompt_len", "8",
                     "--gen_len", "3", "--num_prompts", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    assert [r["concurrency"] for r in res] == [1, 2]
    for r in res:
        assert r["completed"] == 2 and r["failed"] == 0 and r["total_output_tokens"] == 6
        assert 0 < r["median_ttft_ms"] and r["p99_itl_ms"] >= r["median_itl_ms"] > 0
    with contextlib.redirect_stdout(io.StringIO()) as text:
        from ktrans.bench.serve import report, table

        print(report(res[0]), table(res))
    assert "Mean TTFT (ms):" in text.getvalue() and "Output token throughput" in text.getvalue()


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(server, tiny):
    """What lm-eval's tokenizer_backend=remote reads: eos_token (its check for the endpoint), bos/pad tokens and
    the chat template it renders itself, which must give what the server's /tokenize renders."""
    import jinja2

    _, tok = tiny
    r = httpx.get(server.url + "/tokenizer_info")
    assert r.status_code == 200
    info = r.json()
    assert info["eos_token"] == "<|im_end|>" and tok.token_to_id(info["eos_token"]) in tok.eos_token_ids
    assert info["tokenizer_class"] and "bos_token" in info and info["pad_token"] == tok.pad_token
    assert str(tok.token_to_id("<think>")) in info["added_tokens_decoder"]
    messages = [{"role": "user", "content": "x"}]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(messages=messages,
                                                                               add_generation_prompt=True)
    served = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert tok.encode(rendered) == served
