"""`ktrans chat`: a terminal chat with a running `ktrans serve` (or any OpenAI-compatible server).

Streams each answer as it comes; the model's thinking (reasoning_content) is shown apart from the answer, dimmed
on a terminal. Commands: /think on|off, /reset, /exit. Ctrl-C stops the current answer (the server aborts it).
"""
from __future__ import annotations

import json
import sys
from typing import TextIO

import httpx

HELP = "commands: /think on|off (thinking mode), /reset (forget the conversation), /exit"
DIM, RESET = "\033[2m", "\033[0m"


class ChatError(RuntimeError):
    pass


def stream_chat(client: httpx.Client, url: str, body: dict):
    """Yield ("reasoning" | "content", text) from a streaming chat completion."""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text
            raise ChatError(f"HTTP {r.status_code}: {msg}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ChatError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                for kind in ("reasoning_content", "content"):
                    if delta.get(kind):
                        yield ("reasoning" if kind == "reasoning_content" else "content"), delta[kind]


def chat(url: str, model: str | None = None, api_key: str | None = None, think: bool = True,
         temperature: float | None = None, max_tokens: int | None = None, system: str | None = None,
         stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tty = out.isatty() and stdin.isatty()
    with httpx.Client(headers=headers, timeout=httpx.Timeout(10.0, read=None)) as client:
        try:
            models = client.get(f"{url}/v1/models")
        except httpx.HTTPError as e:
            raise ChatError(f"cannot reach {url} ({e}); start a server with `ktrans serve`") from None
        if models.status_code != 200:
            raise ChatError(f"{url}/v1/models answered HTTP {models.status_code}: {models.text[:200]}")
        model = model or models.json()["data"][0]["id"]
        if tty:
            print(f"chatting with {model} at {url}; {HELP}", file=out)
        history: list[dict] = [{"role": "system", "content": system}] if system else []
        while True:
            if tty:
                print("> ", end="", file=out, flush=True)
            line = stdin.readline()
            if not line:
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                history = history[:1] if system else []
                print("(conversation reset)", file=out)
                continue
            if text.startswith("/think"):
                think = text.split()[-1] != "off"
                print(f"(thinking {'on' if think else 'off'})", file=out)
                continue
            if text.startswith("/"):
                print(HELP, file=out)
                continue
            history.append({"role": "user", "content": text})
            body = {"model": model, "messages": history, "stream": True,
                    "chat_template_kwargs": {"enable_thinking": think}}
            if temperature is not None:
                body["temperature"] = temperature
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            answer, shown = "", None
            try:
                for kind, delta in stream_chat(client, url, body):
                    if kind != shown:
                        if shown is not None:
                            print(RESET if tty else "", file=out)
                        label = "thinking" if kind == "reasoning" else "answer"
                        print((DIM if tty and kind == "reasoning" else "") + f"[{label}] ", end="", file=out)
                        shown = kind
                    print(delta, end="", file=out, flush=True)
                    if kind == "content":
                        answer += delta
            except KeyboardInterrupt:
                print("\n(stopped)", file=out)
            except ChatError as e:
                print(f"\nerror: {e}", file=out)
                history.pop()
                continue
            print(RESET if tty else "", file=out, flush=True)
            history.append({"role": "assistant", "content": answer})
