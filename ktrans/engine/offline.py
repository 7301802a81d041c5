"""Offline generation for one prompt (`ktrans generate`): prefill (optionally chunked), then decode steps.

It drives the model through the same ForwardBatch and pools the engine uses, with one sequence, so what it
prints is what the server must reproduce for the same prompt and sampling parameters.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.engine.engine import make_pools
from ktrans.engine.sampler import SamplingParams, sample, token_logprob, top_logprobs


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: str = "length"
    timings: dict[str, float] = field(default_factory=dict)


def generate(model, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
             stop_token_ids: set[int] | None = None, echo: bool = False, chunk_size: int = 0,
             page_size: int = 16) -> GenerationResult:
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"--max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    total = len(prompt_ids) + max_new_tokens
    kv, states = make_pools(model, -(-total // page_size), page_size, num_slots=1)
    pages = kv.allocator.alloc(kv.pages_for(total))
    slot = states.alloc()
    res = GenerationResult(prompt_ids=list(prompt_ids))
    stop = stop_token_ids or set()

    t0 = time.perf_counter()
    step = chunk_size if chunk_size > 0 else len(prompt_ids)
    all_prompt_logits = []
    logits = None
    for start in range(0, len(prompt_ids), step):
        chunk = prompt_ids[start : start + step]
        last = start + step >= len(prompt_ids)
        mode = "all" if echo else ("last" if last else "none")
        batch = ForwardBatch.build([SeqChunk(chunk, start, slot, pages, logits=mode)], kv, states, device=device)
        logits = model(batch)
        if echo:
            all_prompt_logits.append(logits)
    if echo:
        full = torch.cat(all_prompt_logits)
        # the logits at position i predict token i + 1: score each prompt token after the first
        res.prompt_logprobs = _score(full[:-1], prompt_ids[1:], params.logprobs)
        logits = full[-1:]
    t1 = time.perf_counter()

    pos = len(prompt_ids)
    for _ in range(max_new_tokens):
        token = sample(logits, [params])[0]
        if params.logprobs:
            res.logprobs.append(_score(logits, [token], params.logprobs)[0])
        res.output_ids.append(token)
        if token in stop:
            res.finish_reason = "stop"
            break
        if len(res.output_ids) == max_new_tokens:
            break
        batch = ForwardBatch.build([SeqChunk([token], pos, slot, pages)], kv, states, device=device)
        logits = model(batch)
        pos += 1
    t2 = time.perf_counter()
    n_dec = max(len(res.output_ids) - 1, 0)
    res.timings = {
        "prefill_s": t1 - t0, "decode_s": t2 - t1,
        "prefill_tokens_per_s": len(prompt_ids) / max(t1 - t0, 1e-9),
        "decode_tokens_per_s": n_dec / (t2 - t1) if n_dec and t2 > t1 else 0.0,
    }
    return res


def _score(logits: torch.Tensor, tokens: list[int], k: int) -> list[dict[int, float]]:
    """Per position: the chosen token's logprob plus the top-k alternatives (as /v1/completions reports them)."""
    chosen = token_logprob(logits, tokens)
    tops = top_logprobs(logits, k) if k > 0 else [{} for _ in tokens]
    out = []
    for t, lp, top in zip(tokens, chosen, tops):
        d = dict(top)
        d[t] = lp
        out.append(d)
    return out
