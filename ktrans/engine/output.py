"""What the engine sends back per request and step (RequestOutput, and the RequestStream a request's outputs arrive
on), and the text side of it: incremental detokenization with stop strings matched across token boundaries.

A stop string may begin in one token and end several tokens later, so text that could be the start of a stop
string is held back until it either completes one (the request stops and that text, from the stop string on,
is dropped) or stops matching (it is sent).
"""
from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field

from ktrans.engine.request import TokenLogprob


@dataclass
class RequestOutput:
    """One step's news for one request. Text and token ids are deltas; the last one has finished=True."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # once, with the first output, when asked for
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed
    error: str | None = None


def held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of some stop string (and so may become one)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Token ids in, text deltas out, stopping at the first stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self._detok = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
        self.stops = tuple(stops)
        self._pending = ""  # decoded, not yet sent: could still be the start of a stop string
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> str:
        """The text this token lets through. After a stop string matches, stopped_by is set and nothing follows."""
        return self._push(self._detok.add(token_id))

    def finish(self) -> str:
        """The rest, at the end of the request: held text cannot become a stop string any more."""
        text = self._push(self._detok.flush(), final=True)
        return text

    def _push(self, new: str, final: bool = False) -> str:
        if self.stopped_by is not None:
            return ""
        text = self._pending + new
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
            if hits:
                i, s = min(hits)
                self.stopped_by = s
                self._pending = ""
                return text[:i]
        keep = 0 if final else held_suffix(text, self.stops)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


class RequestStream:
    """A request's outputs, in order, ending with one that has finished=True. Iterate with `async for` when made
    with an event loop (the API), or with `for` from a plain thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if loop else queue.SimpleQueue()
        self.finished = False

    def put(self, out: RequestOutput) -> None:  # engine thread
        if self._loop is None:
            self._queue.put(out)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def __aiter__(self):
        while not self.finished:
            out = await self._queue.get()
            self.finished = out.finished
            yield out

    def drain(self) -> list[RequestOutput]:
        """The outputs queued so far, without waiting (a stream made without an event loop)."""
        outs = []
        while not self.finished:
            try:
                out = self._queue.get_nowait()
            except (queue.Empty, asyncio.QueueEmpty):
                break
            self.finished = out.finished
            outs.append(out)
        return outs

    def __iter__(self):
        while not self.finished:
            out = self._queue.get()
            self.finished = out.finished
            yield out


def collect(stream: RequestStream) -> RequestOutput:
    """All of a stream's outputs joined into one (blocking; for tests and offline use)."""
    total = RequestOutput(stream.request_id, logprobs=[])
    for out in stream:
        total.token_ids += out.token_ids
        total.text += out.text
        total.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            total.prompt_logprobs = out.prompt_logprobs
        total.finished, total.finish_reason, total.stop_reason = out.finished, out.finish_reason, out.stop_reason
        total.num_prompt_tokens, total.num_output_tokens, total.error = (out.num_prompt_tokens, out.num_output_tokens,
                                                                         out.error)
        total.num_cached_tokens = out.num_cached_tokens
    return total
