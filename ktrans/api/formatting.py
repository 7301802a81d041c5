"""OpenAI response bodies built from engine outputs: SSE chunks, whole responses, usage and the two logprobs
formats (chat's `content` list and completions' parallel lists with text offsets)."""
from __future__ import annotations

import json
import time

from ktrans.engine.output import RequestOutput
from ktrans.api.reasoning import split_reasoning
from ktrans.engine.request import TokenLogprob
from ktrans.api.tools import parse_tool_calls


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChunkMaker:
    """Streaming chunks of one response: the same id, object and created on every chunk. With `usage` (vLLM's
    stream_options.continuous_usage_stats) every choice chunk carries the token counts so far."""

    def __init__(self, rid: str, obj: str, model: str, usage: "Usage | None" = None):
        self.head = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
        self.running_usage = usage

    def choice(self, index: int, finish_reason: str | None = None, logprobs=None, stop_reason=None, **content) -> str:
        c = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            c["stop_reason"] = stop_reason
        chunk = {**self.head, "choices": [c]}
        if self.running_usage is not None:
            chunk["usage"] = self.running_usage.as_dict()
        return sse(chunk)

    def usage(self, usage: dict) -> str:
        return sse({**self.head, "choices": [], "usage": usage})


class Usage:
    """Token counts over the choices of a response. n choices of one prompt count the prompt once, as OpenAI does."""

    def __init__(self, num_choices: int, choices_per_prompt: int = 1, prompt_tokens: list[int] | None = None):
        self.per_prompt = choices_per_prompt
        self.prompt = list(prompt_tokens) if prompt_tokens is not None else [0] * num_choices
        self.completion = [0] * num_choices
        self.cached = [0] * num_choices  # prompt tokens the prefix cache held, not computed

    def add(self, i: int, out: RequestOutput) -> None:
        self.prompt[i], self.completion[i] = out.num_prompt_tokens, out.num_output_tokens
        self.cached[i] = out.num_cached_tokens

    def as_dict(self) -> dict:
        prompt = sum(self.prompt[:: self.per_prompt])
        completion = sum(self.completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached[:: self.per_prompt])}}


def token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    def one(tid: int, lp: float) -> dict:
        s = token_str(tokenizer, tid)
        return {"token": s, "logprob": max(lp, -9999.0), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top.items()]}
                        for e in entries]}


class TextOffsets:
    """Running character offset of each token in a choice's text (completions' text_offset)."""

    def __init__(self) -> None:
        self.pos = 0

    def next(self, s: str) -> int:
        at, self.pos = self.pos, self.pos + len(s)
        return at


def prompt_entries(prompt_ids: list[int], scores: list[TokenLogprob]) -> list[TokenLogprob | None]:
    """The prompt's tokens with their scores; the first token has none (it is not predicted)."""
    return [TokenLogprob(prompt_ids[0], None)] + list(scores)  # type: ignore[arg-type]


def completion_logprobs(entries: list[TokenLogprob], tokenizer, offsets: TextOffsets) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        s = token_str(tokenizer, e.token_id)
        out["tokens"].append(s)
        out["text_offset"].append(offsets.next(s))
        if e.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(max(e.logprob, -9999.0))
        top = {token_str(tokenizer, t): max(v, -9999.0) for t, v in e.top.items()}
        top.setdefault(s, max(e.logprob, -9999.0))
        out["top_logprobs"].append(top)
    return out


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """A response that stopped after calling tools finishes with "tool_calls" (one cut by max_tokens keeps
    "length")."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def chat_response(rid: str, created: int, model: str, results: list[list[RequestOutput]], parsers, want_logprobs: bool,
                  tokenizer, parse_tools: bool = False) -> dict:
    usage, choices = Usage(len(results), len(results)), []
    for i, outs in enumerate(results):
        for o in outs:
            usage.add(i, o)
        text, last = "".join(o.text for o in outs), outs[-1]
        if parsers[i] is not None:
            reasoning, content = split_reasoning(text, parsers[i].saw_reasoning)
        else:
            reasoning, content = None, text
        calls: list[dict] = []
        if parse_tools:
            content, calls = parse_tool_calls(content)
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if calls:  # no `tool_calls` key on a reply without calls, as OpenAI and vLLM
            message["tool_calls"] = calls
        lps = [e for o in outs for e in (o.logprobs or [])]
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(lps, tokenizer) if want_logprobs else None,
                        "finish_reason": tool_finish_reason(last.finish_reason, bool(calls)),
                        "stop_reason": last.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage.as_dict()}


def completion_response(rid: str, created: int, model: str, results: list[list[RequestOutput]],
                        prompt_ids: list[list[int]], body, tokenizer) -> dict:
    usage, choices = Usage(len(results), body.n), []
    for i, outs in enumerate(results):
        for o in outs:
            usage.add(i, o)
        text, last = "".join(o.text for o in outs), outs[-1]
        entries: list = [e for o in outs for e in (o.logprobs or [])]
        if body.echo:
            text = tokenizer.decode(prompt_ids[i]) + text
            scores = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), [])
            entries = prompt_entries(prompt_ids[i], scores) + entries
        lp = completion_logprobs(entries, tokenizer, TextOffsets()) if body.logprobs is not None else None
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": last.finish_reason,
                        "stop_reason": last.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage.as_dict()}
