"""Helpers for op tests: a teacher-forced schedule that runs a model through chunked prefill, a mixed step and
pure decode steps, for comparing two ops of one operator in a whole model."""
from __future__ import annotations

import torch

from ktrans.engine.cache import CacheManager
from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.runtime.pools import KVPool, StatePool


def teacher_forced(model, device, prompts, conts, page_size=8):
    """Logits of each step. Step 1 prefills every prompt's first part; step 2 decodes prompt 0's first continuation
    token beside the rest of the other prompts (a mixed step); then pure decode steps."""
    total = max(len(p) + len(c) for p, c in zip(prompts, conts))
    kv = KVPool(model.config, len(prompts) * -(-total // page_size), page_size, torch.float32, device)
    states = StatePool(model.config, len(prompts) + 2, torch.float32, device)
    cache = CacheManager.from_pools(kv, states)
    pages = [cache.alloc_pages(kv.pages_for(total)) for _ in prompts]
    slots = [cache.alloc_slot() for _ in prompts][::-1]  # slots out of order
    done = [len(prompts[0]), 7, 16]
    out = [model(ForwardBatch.build([SeqChunk(p[:n], 0, s, pg, logits="all")
                                     for p, n, s, pg in zip(prompts, done, slots, pages)], kv, states))]
    mixed = [SeqChunk([conts[0][0]], done[0], slots[0], pages[0])]
    mixed += [SeqChunk(p[n:], n, s, pg, logits="all") for p, n, s, pg in zip(prompts[1:], done[1:], slots[1:],
                                                                             pages[1:])]
    batch = ForwardBatch.build(mixed, kv, states)
    assert not batch.is_decode and batch.decode_seqs == [0]
    out.append(model(batch))
    lens = [len(prompts[0]) + 1, len(prompts[1]), len(prompts[2])]
    for step in range(3):
        chunks = [SeqChunk([c[step + (i == 0)]], n + step, s, pg)
                  for i, (c, n, s, pg) in enumerate(zip(conts, lens, slots, pages))]
        batch = ForwardBatch.build(chunks, kv, states)
        assert batch.is_decode
        out.append(model(batch))
    return out


def compare_teacher_forced(ref_model, model, device, tol: float) -> None:
    """Both models through teacher_forced on the same prompts; each step's logits within max |diff| / max |logit| <
    tol, and the same next token wherever the reference's top-2 margin is wider than twice the tolerance."""
    prompts = [[(7 * i + 3) % 512 for i in range(n)] for n in (5, 19, 40)]
    conts = [[(11 * i + j) % 512 for i in range(4)] for j in range(3)]
    want = teacher_forced(ref_model, device, prompts, conts)
    got = teacher_forced(model, device, prompts, conts)
    for step, (g, w) in enumerate(zip(got, want)):
        err = ((g - w).abs().max() / w.abs().max()).item()
        assert err < tol, f"step {step}: relative error {err:.2e}"
        top2 = w.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * tol * w.abs().max()
        assert sure.any() and torch.equal(g.argmax(-1)[sure], w.argmax(-1)[sure]), f"step {step}"
