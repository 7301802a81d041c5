"""The OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics,
/tokenize, /detokenize, /tokenizer_info, and POST /flush_cache (drop the prefix cache, as SGLang's).

Handlers turn a request into prompt ids and SamplingParams, submit one engine request per choice, and read the
engine's per-request streams: as server-sent events (role chunk, deltas, finish chunk, usage chunk, [DONE]) or
joined into one response. A client that goes away aborts its engine requests. Errors use OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from typing import AsyncIterator, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ktrans.api import formatting as fmt
from ktrans.engine.engine import Engine, EngineOverloaded, InvalidRequest, RequestStream
from ktrans.engine.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from ktrans.engine.output import RequestOutput
from ktrans.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   error_body)
from ktrans.api.reasoning import THINK_END, THINK_START, ReasoningParser
from ktrans.engine.grammar import GrammarError
from ktrans.engine.sampler import SamplingParams
from ktrans.api.tools import ToolCallParser

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64  # JSON schemas and tool parameters nest a few levels; Python's json recursion limit is ~1000
_TOO_DEEP = object()
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate, paired or not
M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code=None, param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def bad_request(e: Exception, param: str | None = None) -> APIError:
    return APIError(400, str(e), "invalid_request_error", 400, getattr(e, "param", None) or param)


class OpenAIServer:
    def __init__(self, engine: Engine, tokenizer, model_name: str, api_key: str | None = None,
                 metrics: EngineMetrics | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES):
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.metrics = metrics
        self.max_request_body_bytes = max_request_body_bytes
        self.created = int(time.time())  # the model's `created` in /v1/models; responses use the request's time

    # ---- app ----------------------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        app = FastAPI(title="ktrans", docs_url=None, redoc_url=None)
        app.add_exception_handler(APIError, self._api_error)
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        app.api_route("/health", methods=["GET", "HEAD"])(self.health)
        app.api_route("/metrics", methods=["GET", "HEAD"])(self.prometheus)
        v1 = APIRouter(dependencies=[Depends(self.check_api_key)])
        v1.get("/v1/models")(self.models)
        v1.post("/v1/chat/completions")(self.chat_completions)
        v1.post("/v1/completions")(self.completions)
        v1.post("/tokenize")(self.tokenize)
        v1.post("/detokenize")(self.detokenize)
        v1.post("/flush_cache")(self.flush_cache)
        v1.get("/tokenizer_info")(self.tokenizer_info)
        app.include_router(v1)
        return app

    async def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {self.api_key}" and request.headers.get("x-api-key") != self.api_key:
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           "invalid_request_error", "model_not_found", "model")

    # ---- errors -------------------------------------------------------------------------------------
    async def _api_error(self, request: Request, e: APIError) -> JSONResponse:
        code = e.status if e.code is None else e.code
        return JSONResponse(error_body(e.message, e.type, code, e.param), status_code=e.status)

    # ---- request bodies -----------------------------------------------------------------------------
    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_request_body_bytes} "
                             f"bytes")

    async def _read_body(self, request: Request) -> bytes:
        """The raw body, refused with a 413 once it passes the limit: from Content-Length before reading, and
        while reading (a chunked body, or one longer than it said)."""
        limit = self.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    raise self._too_large()
            except ValueError:
                raise APIError(400, f"invalid Content-Length header {declared!r}") from None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    async def _body(self, request: Request, model: type[M]) -> M:
        """The request body read (within the size limit) and parsed and validated off the event loop."""
        raw = await self._read_body(request)
        return await run_in_threadpool(_parse_body, raw, model)

    async def _validation_error(self, request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        parts, param = [], None
        for err in errs[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
                continue
            param = param or ".".join(loc) or None
            parts.append(f"{'.'.join(loc) or 'body'}: {err['msg']}")
        return JSONResponse(error_body("; ".join(parts) or "invalid request", "invalid_request_error", 400, param),
                            status_code=400)

    async def _http_error(self, request: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), type_, e.status_code), status_code=e.status_code)

    async def _internal_error(self, request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {e}", "server_error", 500), status_code=500)

    # ---- small endpoints ----------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        alive = self.engine._thread is not None and self.engine._thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    async def prometheus(self, request: Request) -> Response:
        if self.metrics is None:
            raise APIError(404, "metrics are off", code=404)
        if request.method == "HEAD":
            return Response(media_type=CONTENT_TYPE_LATEST)
        return Response(self.metrics.render(self.engine.stats()), media_type=CONTENT_TYPE_LATEST)

    async def flush_cache(self) -> dict:
        """Drop every cached prefix no running request uses (a benchmark's cold start, new weights' semantics)."""
        freed = await run_in_threadpool(self.engine.flush_cache)
        return {"flushed": self.engine.prefix_cache is not None, **freed}

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "ktrans", "root": self.model_name,
                                            "max_model_len": self.engine.max_model_len}]}

    async def tokenize(self, request: Request) -> dict:
        body = await self._body(request, TokenizeRequest)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")

        def work() -> list[int]:
            if body.messages is not None:
                text = self._render_chat(body.messages, body.add_generation_prompt, None, body.chat_template_kwargs)
            else:
                text = body.prompt
            return self.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

        ids = await run_in_threadpool(work)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        body = await self._body(request, DetokenizeRequest)
        self.check_model(body.model)
        vocab = self.engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await run_in_threadpool(self.tokenizer.decode, body.tokens)}

    async def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info: the tokenizer's configuration as tokenizer_config.json holds it, with
        tokenizer_class and chat_template (lm-eval's remote tokenizer reads eos_token and chat_template)."""
        info = await run_in_threadpool(self.tokenizer.tokenizer_config)
        for path_field in ("vocab_file", "merges_file", "tokenizer_file"):  # as vLLM: no server file paths
            info.pop(path_field, None)
        info.setdefault("model_max_length", self.engine.max_model_len)
        return info

    # ---- chat ---------------------------------------------------------------------------------------
    def _render_chat(self, messages, add_generation_prompt, tools, template_kwargs) -> str:
        try:
            chat = [m.for_template() for m in messages]
            return self.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tools=tools,
                                                      **(template_kwargs or {}))
        except ValueError as e:  # ChatTemplateError is a ValueError
            raise bad_request(e, "messages") from None

    def _sampling_params(self, body):
        """The request's model checked and its sampling fields as SamplingParams (a 400 naming the field if bad)."""
        self.check_model(body.model)
        try:
            return body.to_sampling_params()
        except ValueError as e:
            raise bad_request(e) from None

    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        text = self._render_chat(body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs)
        return text, self.tokenizer.encode(text)

    async def _compile_grammar(self, params: SamplingParams, starts_in_reasoning: bool = False) -> SamplingParams:
        """The structured output constraint compiled off the event loop (a 400 naming the field when it does not
        compile), so submit() finds it in the cache. After a prompt that opened `<think>`, it starts after
        `</think>`: the reasoning is free."""
        spec = params.structured
        if spec is None:
            return params
        if starts_in_reasoning:
            spec = dataclasses.replace(spec, start_after=THINK_END)
            params = dataclasses.replace(params, structured=spec, _generator=None)
        try:
            await run_in_threadpool(self.engine.grammars.compile, spec)
        except GrammarError as e:
            raise bad_request(e) from None
        return params

    async def chat_completions(self, request: Request):
        created = int(time.time())
        body = await self._body(request, ChatCompletionRequest)
        params = self._sampling_params(body)
        text, prompt_ids = await run_in_threadpool(self._chat_prompt, body)
        thinking = body.enable_thinking
        starts_in = thinking and text.rstrip().endswith(THINK_START)  # a thinking template opened it already
        params = await self._compile_grammar(params, starts_in)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self._submit([prompt_ids] * body.n, params, rid)
        parsers = [ReasoningParser(starts_in) if thinking else None for _ in streams]
        if body.stream:
            gen = self._chat_events(rid, body, streams, parsers, len(prompt_ids))
            return StreamingResponse(gen, media_type="text/event-stream")
        results = await self._until_done_or_gone(request, self._collect(streams))
        if results is None:
            return Response(status_code=499)
        return await run_in_threadpool(fmt.chat_response, rid, created, self.model_name, results, parsers,
                                       body.logprobs, self.tokenizer, body.parse_tools)

    async def _chat_events(self, rid, body: ChatCompletionRequest, streams, parsers,
                           num_prompt_tokens: int) -> AsyncIterator[str]:
        usage = fmt.Usage(len(streams), body.n, [num_prompt_tokens] * len(streams))
        chunk = fmt.ChunkMaker(rid, "chat.completion.chunk", self.model_name,
                               usage if body.continuous_usage_stats else None)
        tools = [ToolCallParser() if body.parse_tools else None for _ in streams]
        try:
            for i in range(len(streams)):
                yield chunk.choice(i, delta={"role": "assistant", "content": ""})
            async for i, out in _merge(streams):
                usage.add(i, out)
                if out.error:
                    yield fmt.sse(error_body(out.error, "server_error", 500))
                    continue
                reasoning, content = parsers[i].feed(out.text) if parsers[i] else ("", out.text)
                if out.finished and parsers[i]:
                    r2, c2 = parsers[i].finish()
                    reasoning, content = reasoning + r2, content + c2
                calls: list[dict] = []
                if tools[i]:
                    content, calls = tools[i].feed(content, final=out.finished)
                delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
                lp = fmt.chat_logprobs(out.logprobs, self.tokenizer) if body.logprobs and out.logprobs else None
                if delta or lp:
                    yield chunk.choice(i, delta=delta, logprobs=lp)
                for call in calls:  # one delta per call, when its block closes
                    yield chunk.choice(i, delta={"tool_calls": [call]})
                if out.finished:
                    reason = fmt.tool_finish_reason(out.finish_reason, bool(tools[i] and tools[i].calls))
                    yield chunk.choice(i, delta={}, finish_reason=reason, stop_reason=out.stop_reason)
            if body.include_usage:
                yield chunk.usage(usage.as_dict())
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished(streams)

    # ---- completions --------------------------------------------------------------------------------
    async def completions(self, request: Request):
        created = int(time.time())
        body = await self._body(request, CompletionRequest)
        params = await self._compile_grammar(self._sampling_params(body))
        prompts = await run_in_threadpool(
            lambda: [p if isinstance(p, list) else self.tokenizer.encode(p) for p in body.prompts()])
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompt_ids = [p for p in prompts for _ in range(body.n)]
        streams = self._submit(prompt_ids, params, rid)
        if body.stream:
            return StreamingResponse(self._completion_events(rid, body, streams, prompt_ids),
                                     media_type="text/event-stream")
        results = await self._until_done_or_gone(request, self._collect(streams))
        if results is None:
            return Response(status_code=499)
        return await run_in_threadpool(fmt.completion_response, rid, created, self.model_name, results, prompt_ids,
                                       body, self.tokenizer)

    async def _completion_events(self, rid, body: CompletionRequest, streams, prompt_ids) -> AsyncIterator[str]:
        usage = fmt.Usage(len(streams), body.n, [len(p) for p in prompt_ids])
        chunk = fmt.ChunkMaker(rid, "text_completion", self.model_name,
                               usage if body.continuous_usage_stats else None)
        offsets = [fmt.TextOffsets() for _ in streams]
        echoed = [not body.echo] * len(streams)
        want_lp = body.logprobs is not None
        try:
            async for i, out in _merge(streams):
                usage.add(i, out)
                if out.error:
                    yield fmt.sse(error_body(out.error, "server_error", 500))
                    continue
                if not echoed[i]:  # the prompt goes first, with its scores (they come with the first output)
                    echoed[i] = True
                    text = self.tokenizer.decode(prompt_ids[i])
                    lp = (fmt.completion_logprobs(fmt.prompt_entries(prompt_ids[i], out.prompt_logprobs or []),
                                                  self.tokenizer, offsets[i]) if want_lp else None)
                    yield chunk.choice(i, text=text, logprobs=lp)
                lp = (fmt.completion_logprobs(out.logprobs, self.tokenizer, offsets[i])
                      if want_lp and out.logprobs else None)
                if out.text or lp:
                    yield chunk.choice(i, text=out.text, logprobs=lp)
                if out.finished:
                    yield chunk.choice(i, text="", finish_reason=out.finish_reason, stop_reason=out.stop_reason)
            if body.include_usage:
                yield chunk.usage(usage.as_dict())
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished(streams)

    # ---- engine plumbing ----------------------------------------------------------------------------
    def _submit(self, prompts: list[list[int]], params: SamplingParams, rid: str) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                p = params if params.seed is None else _with_seed(params, params.seed + i)
                streams.append(self.engine.submit(ids, p, f"{rid}-{i}", loop))
        except InvalidRequest as e:
            self._abort_unfinished(streams)
            raise bad_request(e) from None
        except EngineOverloaded as e:
            self._abort_unfinished(streams)
            raise APIError(503, str(e), "server_error", "overloaded") from None
        return streams

    def _abort_unfinished(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def _collect(self, streams: list[RequestStream]) -> list[list[RequestOutput]]:
        results: list[list[RequestOutput]] = [[] for _ in streams]
        try:
            async for i, out in _merge(streams):
                results[i].append(out)
        finally:
            self._abort_unfinished(streams)
        errors = [o.error for r in results for o in r if o.error]
        if errors:
            raise APIError(500, errors[0], "server_error", 500)
        return results

    async def _until_done_or_gone(self, request: Request, work):
        """Run `work`; if the client disconnects first, cancel it (which aborts its requests) and return None."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None


def _parse_body(raw: bytes, model: type[M]) -> M:
    """JSON-decode and validate a body (run in a worker thread). Errors come out as FastAPI's would, and text
    with a lone surrogate (\\ud800 in the JSON, not valid Unicode, which the tokenizer cannot take) is a 400
    naming the field."""
    try:
        obj = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        msg, pos = (e.msg, e.pos) if isinstance(e, json.JSONDecodeError) else (str(e), 0)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": msg}}]) from None
    except RecursionError:  # nested past the decoder's own limit
        obj = _TOO_DEEP
    if obj is _TOO_DEEP or _too_deep(obj):
        # deeper than any request needs; the recursive steps after this (validation, templates) stay safe
        raise APIError(400, f"the request body nests JSON arrays and objects more than {MAX_JSON_DEPTH} deep")
    if _SURROGATE_ESCAPE.search(raw):
        path = _lone_surrogate(obj)
        if path is not None:
            field = ".".join(str(x).encode("utf-8", "backslashreplace").decode() for x in path) or "body"
            raise APIError(400, f"{field}: the text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                f"escape), which is not valid Unicode", param=field)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def _too_deep(obj, limit: int | None = None) -> bool:
    """Whether a decoded JSON value nests lists and dicts deeper than `limit` (iterative: no recursion here)."""
    limit = MAX_JSON_DEPTH if limit is None else limit
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (list, dict)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


def _lone_surrogate(obj, path: tuple = ()) -> tuple | None:
    """The path of the first string (or key) in a decoded JSON value that is not valid Unicode, or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            found = _lone_surrogate(k, path + (k,))
            if found is None:
                found = _lone_surrogate(v, path + (k,))
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _lone_surrogate(v, path + (i,))
            if found is not None:
                return found
    return None


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed, _generator=None)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        async for out in s:
            await q.put((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, out = await q.get()
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
