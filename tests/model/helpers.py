"""Shared helpers for model tests: small random checkpoints and running prompts through ForwardBatch."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from ktrans.model.tiny import write_tiny_model
from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.runtime.pools import KVPool, StatePool
from ktrans.inject import load_model
from ktrans.model.source import ModelSource
from ktrans.engine.cache import CacheManager

# A second shape besides the `small` preset: more key heads, a GQA ratio of 4, a dense MLP layer, attention first,
# head_dim not a power of two, conv kernel 3, top-1 routing without renormalisation.
OTHER_SHAPE = dict(
    hidden_size=96, num_hidden_layers=5,
    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=24, partial_rotary_factor=0.5,
    linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=20, linear_value_head_dim=12,
    linear_conv_kernel_dim=3, num_experts=12, num_experts_per_tok=1, norm_topk_prob=False,
    moe_intermediate_size=40, shared_expert_intermediate_size=56, intermediate_size=80, mlp_only_layers=[2],
    rope_theta=50000.0,
)

SMALL_VOCAB = dict(vocab_size=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_checkpoint(tmp: Path, preset: str = "small", seed: int = 0, **overrides) -> Path:
    return write_tiny_model(tmp, preset, seed, config_overrides={**SMALL_VOCAB, **overrides}, with_tokenizer=False)


def load(path: Path, dtype=torch.float32):
    """The plain model: the default rules (every module on the CPU, reference ops)."""
    model, _ = load_model(ModelSource(model_path=str(path)), dtype, show_progress=False)
    return model


def generate(model, prompt_ids: list[int], max_new_tokens: int, params=None, tokenizer=None, chunk_size: int = 0):
    """`ktrans generate`'s path: a one-request Engine stepped on this thread. Greedy unless params say otherwise;
    the built-in tokenizer unless given (its end-of-text ids lie outside the small test vocabularies)."""
    import dataclasses

    from ktrans.engine.engine import Engine
    from ktrans.engine.sampler import SamplingParams

    params = dataclasses.replace(params or SamplingParams(temperature=0.0), max_tokens=max_new_tokens)
    engine = Engine.for_one_request(model, tokenizer or default_tokenizer(), len(prompt_ids) + max_new_tokens,
                                    chunk_size)
    return engine.generate(prompt_ids, params)[0]


@functools.cache
def default_tokenizer():
    from ktrans.tokenizer.tokenizer import Tokenizer

    return Tokenizer.default()


def prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    """log p(token i+1 | tokens ..i) for each prompt position, from one direct forward (no engine)."""
    logits = run_chunks(model, [prompt_ids])[0][0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()


def pools(model, num_slots: int, tokens_per_seq: int, page_size: int = 8) -> tuple[KVPool, StatePool]:
    pages = num_slots * (-(-tokens_per_seq // page_size))
    kv = KVPool(model.config, pages, page_size, dtype=next(model.parameters()).dtype)
    return kv, StatePool(model.config, num_slots, dtype=next(model.parameters()).dtype)


def run_chunks(model, prompts: list[list[int]], chunk_plans: list[list[int]] | None = None, page_size: int = 8,
               interleave_pages: bool = True):
    """Prefill all prompts together, step by step: in step s, prompt i feeds its s-th chunk (if any).

    Returns per prompt the logits of every token [L, V] and the pools (for state comparisons).
    Pages are handed out round-robin across prompts so block tables are not contiguous.
    """
    longest = max(len(p) for p in prompts)
    kv, states = pools(model, len(prompts), longest, page_size)
    cache = CacheManager.from_pools(kv, states)
    n_pages = [kv.pages_for(len(p)) for p in prompts]
    pages: list[list[int]] = [[] for _ in prompts]
    if interleave_pages:
        for r in range(max(n_pages)):
            for i in range(len(prompts)):
                if r < n_pages[i]:
                    pages[i].append(cache.alloc_pages(1)[0])
    else:
        pages = [cache.alloc_pages(n) for n in n_pages]
    slots = [cache.alloc_slot() for _ in prompts]
    plans = chunk_plans or [[len(p)] for p in prompts]
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(max(len(pl) for pl in plans)):
        chunks, owners = [], []
        for i, (p, plan) in enumerate(zip(prompts, plans)):
            if step < len(plan):
                n = plan[step]
                chunks.append(SeqChunk(p[done[i] : done[i] + n], done[i], slots[i], pages[i], logits="all"))
                owners.append((i, n))
                done[i] += n
        out = model(ForwardBatch.build(chunks, kv, states))
        off = 0
        for i, n in owners:
            logits[i].append(out[off : off + n])
            off += n
    assert done == [len(p) for p in prompts], "chunk plans must cover each prompt exactly"
    return [torch.cat(x) for x in logits], states, slots
