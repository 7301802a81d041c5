"""Tool calls in Qwen3's (Hermes) format, over streamed content deltas, as vLLM's `--tool-call-parser hermes`.

Qwen3 writes each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` after any plain text.
The parser passes plain text through as content and turns each complete block into an OpenAI tool call
(`{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}`). A block whose JSON does not
parse (or has no name), or one never closed, stays in the content as text. Content is trimmed: leading and
trailing whitespace is held back until text follows, so streamed content equals the non-streamed one.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from ktrans.engine.grammar import GrammarError
from ktrans.engine.output import held_suffix

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def _call(block: str) -> dict | None:
    """The OpenAI tool call for the JSON inside one block, or None when it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


class ToolCallParser:
    def __init__(self) -> None:
        self._buf = ""  # text not yet decided on: a possible partial tag, or a block not yet closed
        self._inside = False
        self._space = ""  # whitespace held back until more content follows it
        self._started = False  # some content has been sent (so leading whitespace is over)
        self.calls: list[dict] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """Take a content delta; return (content delta, the tool calls it completed, each with its `index`)."""
        text, self._buf = self._buf + delta, ""
        content, new = "", []
        while text:
            if not self._inside:
                i = text.find(TOOL_START)
                if i >= 0:
                    content += text[:i]
                    text, self._inside = text[i:], True
                    continue
                keep = 0 if final else held_suffix(text, (TOOL_START,))
                content += text[: len(text) - keep]
                self._buf = text[len(text) - keep:]
                break
            j = text.find(TOOL_END)
            if j < 0:
                if final:
                    content += text  # never closed: it stays text
                else:
                    self._buf = text
                break
            block, text, self._inside = text[: j + len(TOOL_END)], text[j + len(TOOL_END):], False
            call = _call(block[len(TOOL_START): -len(TOOL_END)].strip())
            if call is None:
                content += block
            else:
                new.append({"index": len(self.calls), **call})
                self.calls.append(call)
        return self._trim(content, final), new

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("", final=True)

    def _trim(self, content: str, final: bool) -> str:
        if not self._started:
            content = content.lstrip()
            if not content:
                return ""
            self._started = True
        content = self._space + content
        body = content.rstrip()
        self._space = "" if final else content[len(body):]
        return body


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Whole-text version: (content, stripped, or None when empty; the tool calls)."""
    p = ToolCallParser()
    c1, _ = p.feed(text)
    c2, _ = p.finish()
    return (c1 + c2) or None, p.calls


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """A Lark grammar whose sentences are Hermes tool-call blocks calling `name` (or any of the tools when None),
    one block, or several separated by newlines when `parallel`. ValueError (naming tool_choice or tools) when
    the tools do not allow it."""
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GrammarError(f"tools[{i}] is not {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                               f"tools.{i}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, (dict, bool)):
            raise GrammarError(f"tools[{i}].function.parameters is not a JSON schema", f"tools.{i}")
        functions[fn["name"]] = params
    if not functions:
        raise GrammarError("tool_choice \"required\" or a named function needs tools", "tool_choice")
    if name is not None and name not in functions:
        raise GrammarError(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    chosen = {name: functions[name]} if name is not None else functions
    # name first, then the arguments, written compactly (see engine/grammar.py's JSON_OPTIONS)
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                         "required": ["name", "arguments"], "additionalProperties": False}
                        for n, p in chosen.items()],
              "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}
    start = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {start}\n"
            f'call: {TOOL_START} "\\n" body "\\n" {TOOL_END}\n'
            f"body: %json {json.dumps(schema)}\n")
