"""The engine: continuous batching over the model, in its own thread.

The API calls submit() (and abort()) from its event loop; the loop thread drains that inbox, runs steps while
there is work, and pushes a RequestOutput per request and step into the request's stream. One step is

    schedule -> build batch -> forward -> sample -> postprocess

and every finished, aborted or failed request gives its KV pages and state slot back through the scheduler.
The engine never touches HTTP; the API never touches tensors.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from ktrans.inject import layer_devices
from ktrans.engine.runner import ModelRunner
from ktrans.runtime.batch import SeqChunk
from ktrans.runtime.pools import KVPool, SplitKVPool, SplitStatePool, StatePool, make_kv_pool, make_state_pool
from ktrans.engine.cache import CacheManager
from ktrans.engine.prefix_cache import PrefixCache, check_snapshot_interval
from ktrans.engine.grammar import GrammarCompiler, GrammarError, grammar_masks
from ktrans.engine.output import RequestOutput, RequestStream, TextStream, collect
from ktrans.engine.request import Request, RequestStatus, TokenLogprob
from ktrans.engine.sampler import SamplingParams, sample, token_logprob, top_logprobs
from ktrans.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)
DEFAULT_CHUNK_SIZE = 512


def default_chunk_size(model) -> int:
    """The step's token budget where --chunk_size is not given: 512, or more where an op of the model asks for longer
    steps (`step_tokens`: split prefill pays one pass over each layer's experts per step, so a 4096-token step
    prefills ~10x faster than 512-token ones; doc/benchmarks.md, 2026-12-02)."""
    return max([DEFAULT_CHUNK_SIZE, *(int(getattr(m, "step_tokens", 0)) for m in model.modules())])


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16  # running requests, and DeltaNet state slots
    chunk_size: int = DEFAULT_CHUNK_SIZE  # token budget of one step (decode tokens + prefill chunks)
    page_size: int = 16  # tokens per KV page
    cache_lens: int = 32768  # KV cache size in tokens, over all requests
    max_model_len: int | None = None  # prompt + output; None: the model's, within the cache
    max_new_tokens: int = 1024  # default max_tokens
    max_queued_requests: int = 1024  # waiting requests beyond this are refused (EngineOverloaded)
    use_cuda_graph: bool | None = None  # decode steps replay CUDA graphs; None: where the model's batches are on a GPU
    enable_prefix_cache: bool = True  # reuse KV pages and DeltaNet snapshots of shared prefixes
    prefix_cache_max_snapshots: int = 32  # DeltaNet state slots the prefix cache keeps, beyond max_batch_size
    prefix_cache_snapshot_interval: int = 0  # also snapshot every this many prompt tokens inside a chunk (0: off)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "chunk_size", "page_size", "cache_lens", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max_model_len must be positive, got {self.max_model_len}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.enable_prefix_cache and self.prefix_cache_max_snapshots <= 0:
            raise ValueError(f"--prefix_cache_max_snapshots must be positive with the prefix cache on, got "
                             f"{self.prefix_cache_max_snapshots} (or turn it off: --no-enable_prefix_cache)")
        check_snapshot_interval(self.prefix_cache_snapshot_interval, self.page_size)  # before the model loads

    @property
    def num_snapshot_slots(self) -> int:
        return self.prefix_cache_max_snapshots if self.enable_prefix_cache else 0


class InvalidRequest(ValueError):
    """The request cannot be served as asked (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (HTTP 503)."""


@dataclass(eq=False)
class _Tracked:
    req: Request
    stream: RequestStream
    text: TextStream
    sent_prompt_logprobs: bool = False


def make_pools(model, num_pages: int, page_size: int, num_slots: int
               ) -> tuple[KVPool | SplitKVPool, StatePool | SplitStatePool]:
    """KV pages and DeltaNet state slots in the model's float dtype, each layer's on the device where its attention
    or DeltaNet runs (under rules these need not be the device of the model's first parameter): one pool per
    device when the rules split the layers over several, sharing page and slot ids."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    layers = layer_devices(model)
    kv = make_kv_pool(model.config, num_pages, page_size, dtype, layers)
    return kv, make_state_pool(model.config, num_slots, dtype, layers)


def batch_device(model) -> torch.device:
    """Where the runner builds a step's batch: the first GPU the layers' pools are on (copies go to the others), else
    the device of the model's first parameter."""
    gpus = [d for d in layer_devices(model).values() if d.type == "cuda"]
    return min(gpus, key=lambda d: d.index or 0) if gpus else next(model.parameters()).device


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), metrics=None):
        self.model = model
        self.model_config = mc = model.config
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        num_pages = -(-config.cache_lens // config.page_size)
        snaps = config.num_snapshot_slots  # state slots past the requests' ones, for the prefix cache's snapshots
        self.kv, self.states = make_pools(model, num_pages, config.page_size, config.max_batch_size + snaps)
        # Batches are built where the pools are (attention and DeltaNet run there): on a GPU under the serve rules
        # even when the embedding sits on the CPU, which then reads the batch's pinned host twin.
        self.device = batch_device(model)
        self.cache = CacheManager.from_pools(self.kv, self.states, snaps)  # who holds which page and slot
        self.prefix_cache = (PrefixCache(self.cache, config.prefix_cache_snapshot_interval)
                             if config.enable_prefix_cache else None)
        self.scheduler = Scheduler(SchedulerConfig(config.max_batch_size, config.chunk_size, config.page_size),
                                   self.cache, self.prefix_cache)
        capacity = num_pages * config.page_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(f"--max_model_len {config.max_model_len} is more than the KV cache holds ({capacity} "
                             f"tokens, --cache_lens): raise --cache_lens or lower --max_model_len")
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, capacity)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(mc.eos_token_id)
        self.grammars = GrammarCompiler(tokenizer, mc.vocab_size)  # structured outputs (the API compiles ahead)
        self.runner = ModelRunner(model, self.kv, self.states, max_num_seqs=config.max_batch_size,
                                  max_num_tokens=config.chunk_size, max_pages_per_seq=-(-capacity // config.page_size),
                                  device=self.device, cuda_graph=(self.device.type == "cuda"
                                                                  if config.use_cuda_graph is None
                                                                  else config.use_cuda_graph))
        self._tracked: dict[str, _Tracked] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.last_step_tokens = 0  # tokens the last step computed (decode rows plus prefill chunks)

    # ---- API side (any thread) ----------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream. Raises InvalidRequest or EngineOverloaded."""
        req = self.make_request(prompt_ids, params, request_id)
        if len(self.scheduler.waiting) + self._inbox.qsize() >= self.config.max_queued_requests:
            raise EngineOverloaded(f"the server is overloaded: {self.config.max_queued_requests} requests are "
                                   f"already waiting; retry later")
        return self._queue(req, params, loop)

    def _queue(self, req: Request, params: SamplingParams,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        stream = RequestStream(req.request_id, loop)
        text = TextStream(self.tokenizer, params.stop)
        self._inbox.put(("add", _Tracked(req, stream, text)))
        self._wake.set()
        return stream

    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty: give at least one token", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
        n, limit = len(prompt_ids), self.max_model_len
        if params.max_tokens is None:
            max_tokens = min(self.config.max_new_tokens, limit - n)
            if max_tokens <= 0:
                raise InvalidRequest(f"This model's maximum context length is {limit} tokens. However, your prompt "
                                     f"is {n} tokens, which leaves no room for the completion.", "messages")
        else:
            max_tokens = params.max_tokens
            if n + max_tokens > limit:
                raise InvalidRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                                     f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
                                     f"Please reduce the prompt or max_tokens.", "max_tokens")
        params = dataclasses.replace(params, max_tokens=max_tokens, _generator=None)  # its own RNG
        try:  # each request its own grammar state; compiled once per constraint
            grammar = self.grammars.state(params.structured) if params.structured is not None else None
        except GrammarError as e:
            raise InvalidRequest(str(e), e.param) from None
        return Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, max_tokens, grammar=grammar)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        s = self.scheduler
        out = {"num_running": len(s.running), "num_waiting": len(s.waiting) + self._inbox.qsize(),
               "num_preemptions": s.num_preemptions, **self.cache.stats()}
        if (pc := self.prefix_cache) is not None:
            out.update({f"prefix_cache_{k}": v for k, v in dataclasses.asdict(pc.stats).items()},
                       prefix_cache_snapshots=pc.num_snapshots, prefix_cache_pages=pc.num_pages,
                       prefix_cache_snapshot_bytes=pc.num_snapshots * self.snapshot_bytes)
        return out

    @property
    def snapshot_bytes(self) -> int:
        """Memory of one DeltaNet state snapshot (one slot of the state pool)."""
        return self.states.nbytes // (self.states.num_slots + 1)

    def flush_cache(self, timeout: float = 30.0) -> dict:
        """Drop what the prefix cache holds that no running request uses (POST /flush_cache); returns what was
        freed. From any thread: with the loop thread running it is done there, between steps."""
        if self._thread is None or not self._thread.is_alive():
            return self._flush_cache()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("flush", done))
        self._wake.set()
        return done.result(timeout)

    def _flush_cache(self) -> dict:
        if self.prefix_cache is None:
            return {"pages_freed": 0, "snapshots_freed": 0}
        return self.prefix_cache.flush()

    # ---- the loop thread ----------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, name="ktrans-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop:
            try:
                if not self.poll():
                    self._wake.wait(0.5)
                    self._wake.clear()
            except Exception as e:  # a failed step fails its requests, never the engine
                log.exception("engine step failed")
                for r in list(self.scheduler.running):
                    if (t := self._tracked.get(r.request_id)) is not None:
                        self._end(t, RequestStatus.FINISHED_ERROR, error=f"internal error in the engine step: {e}")

    def poll(self) -> bool:
        """Take in what was submitted or aborted, then run one step if there is work; False when idle. The loop
        thread calls it; a benchmark that times steps one by one calls it from its own thread instead of start()."""
        self._drain_inbox()
        if not self.scheduler.has_work():
            return False
        self.step()
        return True

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._tracked[item.req.request_id] = item
                try:
                    self.scheduler.add(item.req)
                except ValueError as e:  # make_request checked the length already; this is a safety net
                    self._end(item, RequestStatus.FINISHED_ERROR, error=str(e))
            elif kind == "flush":
                item.set_result(self._flush_cache())
            elif (t := self._tracked.get(item)) is not None:
                self._end(t, RequestStatus.FINISHED_ABORTED)

    @classmethod
    def for_one_request(cls, model, tokenizer, num_tokens: int, chunk_size: int = 0) -> "Engine":
        """An engine sized for one request of `num_tokens` (prompt + output) tokens, for generate(): a prefill
        chunk of `chunk_size` tokens per step (0: the whole prompt in one)."""
        return cls(model, tokenizer, EngineConfig(max_batch_size=1, chunk_size=chunk_size or num_tokens,
                                                  cache_lens=num_tokens, max_model_len=num_tokens,
                                                  enable_prefix_cache=False))

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[RequestOutput, dict[str, float]]:
        """One request run to its end on the caller's thread, through this engine's own steps (`ktrans generate`,
        tests): submit, then poll() until idle. Not beside the loop thread. Returns the joined output and timings
        (prefill: until the first token; decode: after it). Raises InvalidRequest as submit does."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("Engine.generate steps the engine itself; it cannot run beside start()'s thread")
        stream = self.submit(prompt_ids, params)
        t0 = time.monotonic()  # the clock Request stamps its tokens with
        self._drain_inbox()
        tracked = self._tracked.get(stream.request_id)
        while self.poll():
            pass
        out, end = collect(stream), time.monotonic()
        first = (tracked.req.first_token_time if tracked is not None else None) or end
        prefill_s, decode_s = first - t0, end - first
        n_dec = max(len(out.token_ids) - 1, 0)
        return out, {"prefill_s": prefill_s, "decode_s": decode_s,
                     "prefill_tokens_per_s": len(prompt_ids) / max(prefill_s, 1e-9),
                     "decode_tokens_per_s": n_dec / decode_s if n_dec and decode_s > 0 else 0.0}

    def warm_up(self) -> dict:
        """Throw-away requests through the engine's own steps before it serves (ktrans.engine.warmup.warm_up)."""
        from ktrans.engine.warmup import warm_up
        return warm_up(self)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> None:
        sched = self.scheduler.schedule()  # 1. which requests, how many tokens each (may preempt)
        if not sched.chunks:
            return
        self.last_step_tokens = sum(c.num_tokens for c in sched.chunks)
        # 2. batch into the runner's buffers, 3. plan and forward
        logits = self.runner.step([SeqChunk(c.token_ids, c.start, c.request.slot, c.request.pages, c.logits, c.emit)
                                   for c in sched.chunks])
        self.runner.wait_end()
        rows = self._rows_per_chunk(sched.chunks, logits)
        tokens = self._sample(sched.chunks, rows)  # 4. sample
        self.runner.check()  # what the step's stream work reported, now that its results are read
        for c in sched.chunks:  # 5. postprocess: stop checks, text, outputs, memory back for finished ones
            self._postprocess(c, rows[id(c)], tokens.get(id(c)))
        self.num_steps += 1
        if self.metrics is not None:
            self.metrics.on_step(sched, len(tokens))

    def _sample(self, chunks: list[ScheduledChunk], rows: dict[int, torch.Tensor]) -> dict[int, int]:
        """A token for every chunk that completes its request's tokens, unless max_tokens is already reached."""
        due = [c for c in chunks if c.completes and c.request.num_output_tokens < c.request.max_tokens]
        if not due:
            return {}
        reqs = [c.request for c in due]
        histories = [(r.prompt_ids, r.output_ids) if r.params.has_penalties else None for r in reqs]
        logits = _gathered([rows[id(c)][-1:] for c in due])
        masks = grammar_masks([r.grammar for r in reqs], logits.shape[-1], pin=logits.is_cuda)  # structured outputs
        tokens = sample(logits, [r.params for r in reqs], histories,
                        [r.num_output_tokens for r in reqs], masks)  # the seeded noise's counter: the output index
        for r, t in zip(reqs, tokens):
            if r.grammar is not None:
                r.grammar.accept(t)
        return {id(c): t for c, t in zip(due, tokens)}

    def _rows_per_chunk(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> dict[int, torch.Tensor]:
        rows, offset = {}, 0
        for c in chunks:
            n = {"all": c.num_tokens, "last": 1, "none": 0}[c.logits]
            rows[id(c)] = logits[offset : offset + n]
            offset += n
        return rows

    def _postprocess(self, chunk: ScheduledChunk, rows: torch.Tensor, token: int | None) -> None:
        req = chunk.request
        t = self._tracked[req.request_id]
        self.scheduler.advance(chunk)
        if chunk.logits == "all":
            self._score_prompt(req, chunk, rows)
        if not chunk.completes:
            return
        out = RequestOutput(req.request_id)
        if token is None:  # max_tokens reached before sampling: only max_tokens=0 (prompt scoring) gets here
            return self._end(t, RequestStatus.FINISHED_LENGTH)
        if req.params.wants_logprobs:
            last = rows[-1:]
            top = top_logprobs(last, req.params.logprobs)[0] if req.params.logprobs else {}
            out.logprobs = [TokenLogprob(token, token_logprob(last, [token])[0], top)]
        if self.metrics is not None:
            self.metrics.on_token(req)
        req.append_token(token)
        out.token_ids = [token]
        status = None
        if token in req.params.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in self.eos_token_ids and not req.params.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
        else:
            out.text = t.text.add(token)
            if t.text.stopped_by is not None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, t.text.stopped_by
            elif req.grammar is not None and req.grammar.done:  # the structured output is complete
                status = RequestStatus.FINISHED_STOPPED
            elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
        if status is None:
            self._publish(t, out)
        else:
            self._end(t, status, out)

    def _score_prompt(self, req: Request, chunk: ScheduledChunk, rows: torch.Tensor) -> None:
        """Logits at position p score prompt token p + 1; keep those not scored yet."""
        first = len(req.prompt_logprobs)  # the next position to score
        end = min(chunk.start + chunk.num_tokens, req.num_prompt_tokens - 1)
        if end <= first:
            return
        r = rows[first - chunk.start : end - chunk.start]
        targets = req.prompt_ids[first + 1 : end + 1]
        k = req.params.prompt_logprobs
        tops = top_logprobs(r, k) if k else [{} for _ in targets]
        for tok, lp, top in zip(targets, token_logprob(r, targets), tops):
            req.prompt_logprobs.append(TokenLogprob(tok, lp, top))

    def _publish(self, t: _Tracked, out: RequestOutput) -> None:
        req = t.req
        if req.params.prompt_logprobs is not None and not t.sent_prompt_logprobs:
            out.prompt_logprobs, t.sent_prompt_logprobs = list(req.prompt_logprobs), True
        out.num_prompt_tokens, out.num_output_tokens = req.num_prompt_tokens, req.num_output_tokens
        out.num_cached_tokens = req.num_cached_tokens
        t.stream.put(out)

    def _end(self, t: _Tracked, status: RequestStatus, out: RequestOutput | None = None, error: str | None = None):
        """Finish a request: pages and slot back, and its last output (with whatever text was held back)."""
        req = t.req
        self.scheduler.finish(req, status)
        self._tracked.pop(req.request_id, None)
        out = out or RequestOutput(req.request_id)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            out.text += t.text.finish()
        out.finished, out.finish_reason, out.stop_reason, out.error = True, status.value, req.stop_reason, error
        if self.metrics is not None:
            self.metrics.on_finish(req)
        self._publish(t, out)


def wait_idle(engine: Engine, timeout: float = 30.0) -> bool:
    """Until the engine has nothing queued or running (tests)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and not engine._tracked:
            return True
        time.sleep(0.01)
    return False


def _gathered(picked: list[torch.Tensor]) -> torch.Tensor:
    """Rows [1, V] of one step's logits as one [N, V]: a view where they lie one after the other (a decode step, the
    common case; a copy of the 600 KB rows cost ~0.3 ms a token on the CPU), else a copy. The sampler does not
    write into its input."""
    first = picked[0]
    step = first.stride(0) * first.element_size()
    if all(p.shape == first.shape and p.stride() == first.stride() and p.data_ptr() == first.data_ptr() + i * step
           for i, p in enumerate(picked)):
        return first.as_strided((len(picked), first.shape[1]), first.stride())
    return torch.cat(picked)

