"""Split Qwen3's `<think>...</think>` reasoning from the answer, over streamed text deltas.

Reasoning is what comes between `<think>` and `</think>`; the answer is the rest, with the blank lines after
`</think>` dropped. Thinking models whose chat template already opened `<think>` in the prompt start inside the
reasoning (`starts_in_reasoning`). A tag split over several deltas is held back until it is complete.
"""
from __future__ import annotations

from ktrans.engine.output import held_suffix

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool = False):
        self._state = "reasoning" if starts_in_reasoning else "start"  # start -> reasoning -> content
        self._buf = ""
        self._strip_newlines = False
        self.saw_reasoning = starts_in_reasoning

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Take a text delta; return (reasoning delta, content delta)."""
        text, self._buf = self._buf + delta, ""
        reasoning = content = ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    text, self._state, self.saw_reasoning = stripped[len(THINK_START):], "reasoning", True
                    continue
                if not final and (not stripped or THINK_START.startswith(stripped)):
                    self._buf = text  # could still become <think>
                    break
                self._state = "content"
            elif self._state == "reasoning":
                i = text.find(THINK_END)
                if i >= 0:
                    reasoning += text[:i]
                    text, self._state, self._strip_newlines = text[i + len(THINK_END):], "content", True
                    continue
                keep = 0 if final else held_suffix(text, (THINK_END,))
                reasoning += text[: len(text) - keep]
                self._buf = text[len(text) - keep:]
                break
            else:
                if self._strip_newlines:
                    text = text.lstrip("\n")
                    if not text:
                        break
                    self._strip_newlines = False
                content += text
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Whole-text version: (reasoning or None when there was none, content)."""
    p = ReasoningParser(starts_in_reasoning)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.saw_reasoning else None), c1 + c2
