"""Engine.warm_up: throw-away requests through an engine's own steps before it serves, so users do not pay the first
time of each kind of step (Triton compiles and autotunings, CUDA-graph captures, split prefill's rates)."""
from __future__ import annotations

import time

import torch

from ktrans.engine.graphs import batch_buckets
from ktrans.engine.runner import operator_ops
from ktrans.engine.output import RequestStream
from ktrans.engine.request import RequestStatus
from ktrans.engine.sampler import SamplingParams


def warm_up(engine) -> dict:  # the ktrans.engine.engine.Engine (not imported: no import circle)
    """Throw-away requests through the engine's own steps, before it serves (`ktrans serve`, bench e2e): a
    whole-step prompt (several filling a step where --max_model_len is shorter); beside one decoding request an
    odd-length chunk, a whole-step one and a 257-token prompt; the odd chunk beside two decoding (where the batch
    holds three); decode at batch 1, 2 and each larger graph
    bucket, and those rows beside a short prompt and a step-filling one where a slot is left. Users then do not
    pay what each kind of step costs the first time: Triton compiles per token-count class and per one-or-more
    sequences, autotunings per size class, graph captures, split prefill's rates.
    Nothing of it stays (prefix cache flushed, counters reset, no metrics). On the caller's thread, before
    start(). Returns the time and steps taken."""
    if engine._thread is not None and engine._thread.is_alive():
        raise RuntimeError("Engine.warm_up steps the engine itself: call it before start()")
    t0, steps0 = time.perf_counter(), engine.num_steps
    metrics, engine.metrics = engine.metrics, None
    gen = torch.Generator().manual_seed(0)
    vocab, limit = engine.model_config.vocab_size, engine.max_model_len
    ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    made: list[str] = []

    def submit(n: int, max_tokens: int) -> RequestStream:  # past --max_queued_requests: these are not users'
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        req = engine.make_request(ids(n), params, f"warmup-{len(made)}")
        made.append(req.request_id)
        return engine._queue(req, params)

    def first_token(n: int, max_tokens: int) -> None:
        stream = submit(n, max_tokens)
        while not stream.drain() and engine.poll():  # its prefill and first token
            pass

    ps, pages = engine.config.page_size, -(-engine.config.cache_lens // engine.config.page_size) - 1
    try:
        if limit >= 3:
            first_token(min(engine.config.chunk_size, limit - 2), 2)  # one whole step
            while engine.poll():
                pass
            # where one prompt cannot fill a step (--max_model_len under --chunk_size), a step filled by several:
            # ops switch kernels with the step's tokens, not its prompts' (the split prefill's GPU share from
            # gpu_prefill_min_tokens on: bench e2e's 16 prompts of 256 tokens compiled its kernels in their first
            # step at full size, session 22, the warm-up's prompts being shorter than the 512 tokens it starts at)
            per = limit - 2
            if per < engine.config.chunk_size and engine.config.max_batch_size > 1:
                n = min(engine.config.max_batch_size, -(-engine.config.chunk_size // per), pages // -(-limit // ps))
                if n > 1:
                    for _ in range(n):
                        submit(per, 2)
                    while engine.poll():
                        pass
        if limit >= 18:
            first_token(5, 12)  # it decodes from now on
            # beside its decodes: an odd token count, a whole chunk (a multiple of 16, several sequences), a
            # prompt in attention's middle autotune class (65..512: attention.tune_class) that decodes too; two
            # decode rows beside a chunk (Triton specializes an integer argument equal to 1)
            n = max(1, min(engine.config.chunk_size - 1, limit - 2))
            odd = n - 1 - (n % 2)
            for m in (odd, n):
                if m >= 1:
                    first_token(m, 2)
            first_token(min(257, n, limit - 12), 12)
            if engine.config.max_batch_size >= 3 and odd >= 1:
                first_token(odd, 2)
            while engine.poll():
                pass
        # decode at each larger CUDA-graph bucket, then those rows beside a short prompt and beside a whole step's
        # prompt where a slot is left (Triton's tiles, the MoE's and the DeltaNet decode's value blocks change with
        # the decode rows; the prefill kernels' compiles with the step's token-count class and its sequences: at full
        # size four rows beside a 4,092-token chunk compiled four kernels inside a measured step, session 13)
        for b in [b for b in batch_buckets(engine.config.max_batch_size) if b > 2] if limit >= 24 else []:
            beside = [21] if b < engine.config.max_batch_size else []
            whole = engine.config.chunk_size - b
            if beside and 21 < whole <= limit - 2 and -(-(whole + 2) // ps) + b * -(-8 // ps) <= pages:
                beside.append(whole)
            for n in beside or [0]:
                streams = [submit(4, 4) for _ in range(min(b, (pages - -(-(max(n, 21) + 2) // ps)) // -(-8 // ps)))]
                while streams and engine.poll():  # their prompts, then their first tokens
                    streams = [s for s in streams if not s.drain()]
                if n:
                    submit(n, 2)
                while engine.poll():
                    pass
    except BaseException:
        engine._drain_inbox()
        for rid in made:  # a step failed: the warm-up's requests give their pages and slots back
            if (t := engine._tracked.get(rid)) is not None:
                engine._end(t, RequestStatus.FINISHED_ABORTED)
        engine.num_steps = steps0
        raise
    finally:
        engine.metrics = metrics
    # what long contexts meet first: the attention decode's autotune classes of long splits, once per device (the
    # autotuner's cache is the kernel's, not a layer's: every other layer would only replay the timed launches)
    pretuned = set()
    for op in operator_ops(engine.model, "pretune"):
        if op.device not in pretuned:
            pretuned.add(op.device)
            op.pretune(engine.kv)
    if engine.runner.graphs is not None:
        engine.runner.graphs.num_replays = 0  # the graphs it captured stay; replays count the users' steps
    engine._flush_cache()
    if engine.prefix_cache is not None:
        engine.prefix_cache.stats = type(engine.prefix_cache.stats)()
    engine.scheduler.num_preemptions = 0
    steps, engine.num_steps = engine.num_steps - steps0, steps0
    return {"seconds": time.perf_counter() - t0, "steps": steps}
