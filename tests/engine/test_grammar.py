"""Grammar masks in the sampler and the grammar state: bitmasks unpacked on the logits' device, no sampled or
greedy token outside a mask whatever the parameters, the `</think>` gate, compile errors and the compile cache."""
from __future__ import annotations

import random

import pytest
import torch

from ktrans.engine.grammar import GrammarCompiler, GrammarError, StructuredOutputs, grammar_masks
from ktrans.engine.sampler import SamplingParams, apply_token_masks, sample

from .test_sampler import MIXES

V = 1001  # not a multiple of 32: the last word of a mask is partly past the vocabulary


def random_masks(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bitmasks [n, ceil(V / 32)] int32, the same as bool [n, V]); each row allows at least one token."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(n, V, generator=g) < 0.05
    allowed[torch.arange(n), torch.randint(V, (n,), generator=g)] = True
    bits = torch.zeros(n, 32 * -(-V // 32), dtype=torch.int64)
    bits[:, :V] = allowed.long()
    words = (bits.view(n, -1, 32) << torch.arange(32)).sum(-1)  # bit j of word w is token 32 w + j
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), allowed


def test_masks_unpack_to_the_allowed_tokens():
    masks, allowed = random_masks(7, 0)
    logits = torch.randn(7, V)
    out = apply_token_masks(logits, masks)
    assert torch.equal(torch.isinf(out), ~allowed) and torch.equal(out[allowed], logits[allowed])


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_no_draw_outside_the_mask(mix):
    rnd = random.Random(1)
    n = 6
    masks, allowed = random_masks(n, rnd.randrange(1000))
    logits = torch.randn(n, V) * 3
    params = [SamplingParams(**MIXES[mix], seed=s) for s in range(n)]
    histories = [([rnd.randrange(V) for _ in range(5)], [rnd.randrange(V) for _ in range(3)]) for _ in range(n)]
    for step in range(5):
        tokens = sample(logits, params, histories, [step] * n, masks)
        assert all(allowed[i, t] for i, t in enumerate(tokens)), (mix, tokens)
    if MIXES[mix].get("temperature") == 0.0 and not params[0].has_penalties:
        assert tokens == logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny[1], tiny[0].config.vocab_size)


def test_state_follows_the_grammar_and_the_think_gate(compiler, tiny):
    tok = tiny[1]
    spec = StructuredOutputs(choice=("yes", "no"), start_after="</think>")
    s = compiler.state(spec)
    assert not s.active and grammar_masks([s, None], compiler.vocab_size) is None  # gated: no mask at all
    for t in tok.encode("anything at all"):
        s.accept(t)
    s.accept(tok.token_to_id("</think>"))
    masks = grammar_masks([None, s], compiler.vocab_size)
    allowed = apply_token_masks(torch.zeros(2, compiler.vocab_size), masks)[1] == 0
    yes, no = tok.encode("yes")[0], tok.encode("no")[0]
    assert allowed[yes] and allowed[no] and not allowed[tok.encode(" maybe")[0]]
    assert grammar_masks([None, s], compiler.vocab_size)[0].eq(-1).all()  # an unconstrained row allows all
    s.accept(yes)
    assert s.done and s.error is None
    other = compiler.state(spec)  # a copy of the compiled matcher: no progress shared
    assert not other.done and compiler.compile(spec) is compiler.compile(spec)


def test_bad_constraints_raise_grammar_errors(compiler):
    with pytest.raises(GrammarError) as e:
        compiler.compile(StructuredOutputs(regex="(", param="guided_regex"))
    assert e.value.param == "guided_regex"
    with pytest.raises(GrammarError):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(GrammarError):
        StructuredOutputs.from_schema("[1, 2]")


@pytest.mark.gpu
def test_masks_on_cuda_copy_in_once_and_only_the_tokens_back():
    """At full vocabulary on the GPU: the masks go in with one host-to-device copy and are unpacked there; the
    only copy back is the token ids; the draws respect the masks as on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    vocab, n = 151_936, 16
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(n, vocab, generator=g) < 0.01
    bits = allowed.view(n, -1, 32).long() << torch.arange(32)
    words = bits.sum(-1)
    masks = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).pin_memory()
    names = sorted(MIXES)
    params = [SamplingParams(seed=i, **MIXES[names[i % len(names)]]) for i in range(n)]
    logits = (torch.randn(n, vocab, generator=g) * 3).cuda()
    tokens = sample(logits, params, None, list(range(n)), masks)  # warm up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        again = sample(logits, params, None, list(range(n)), masks)
        torch.cuda.synchronize()
    assert again == tokens and all(allowed[i, t] for i, t in enumerate(tokens))
    events = [e.name for e in prof.events()]
    assert len([x for x in events if "Memcpy DtoH" in x or "Memcpy D2H" in x]) == 1
    assert torch.equal(apply_token_masks(logits, masks).isinf().cpu(), ~allowed)
