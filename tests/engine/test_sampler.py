"""The batched sampler against a straightforward per-row reference: filtered distributions, penalties, greedy,
seeds that ignore the batch, sampled frequencies, no per-row work, and (on CUDA) no copy back but the token ids."""
from __future__ import annotations

import collections
import dataclasses
import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ktrans.engine.sampler import SamplingParams, apply_penalties, filtered_logits, sample, token_logprob, top_logprobs

V = 1001  # odd, not a power of two

MIXES = {
    "plain": dict(temperature=1.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.3, top_k=17),
    "top_k_over_vocab": dict(top_k=5000),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(min_p=0.05),
    "all_filters": dict(temperature=0.6, top_k=40, top_p=0.8, min_p=0.02),
    "repetition": dict(repetition_penalty=1.3),
    "presence_frequency": dict(presence_penalty=0.7, frequency_penalty=-0.4, top_p=0.95),
    "penalties_and_filters": dict(temperature=0.9, top_k=100, top_p=0.7, min_p=0.01, repetition_penalty=0.8,
                                  presence_penalty=-1.0, frequency_penalty=1.5),
    "greedy": dict(temperature=0.0),
    "greedy_penalized": dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=2.0),
}


# ---- the reference: one row at a time, as the sampler was written before it was batched --------------------
def ref_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]):
    if not p.has_penalties:
        return logits
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.unique(torch.tensor(output_ids, dtype=torch.int64), return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def ref_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= p.top_p  # the smallest prefix reaching top_p, at least one token
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def ref_probs(row: torch.Tensor, p: SamplingParams, history) -> torch.Tensor:
    row = ref_penalties(row, p, *history) if history is not None else row
    if p.greedy:
        return torch.nn.functional.one_hot(row.argmax(), row.numel()).float()
    return torch.softmax(ref_filter(row, p), dim=-1)


def random_history(rnd: random.Random, vocab: int = V):
    prompt = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 30))]
    output = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 20))]
    output += output[: len(output) // 2]  # repeats, so the counts are not all 1
    return prompt, output


def mixed_batch(n: int, seed: int = 0, names: list[str] | None = None):
    """n rows cycling through the mixes (all by default), with histories and seeds."""
    rnd = random.Random(seed)
    names = names or list(MIXES)
    params = [SamplingParams(seed=1000 + i, **MIXES[names[i % len(names)]]) for i in range(n)]
    histories = [random_history(rnd) for _ in range(n)]
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3
    return logits, params, histories


# ---- the distributions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MIXES))
def test_filtered_distribution_matches_the_reference(name):
    rnd = random.Random(1)
    logits = torch.randn(6, V) * 3
    params = [SamplingParams(**MIXES[name]) for _ in range(6)]
    histories = [random_history(rnd) for _ in range(6)]
    got = torch.softmax(filtered_logits(logits, params, histories), dim=-1)
    for i in range(6):
        want = ref_probs(logits[i], params[i], histories[i])
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)
        assert torch.equal(got[i] > 0, want > 0)  # the same tokens survive the filters


NO_TOP_P = [name for name, mix in MIXES.items() if "top_p" not in mix]  # no sort: one topk for the top-k rows
ALL_TOP_K = ["top_k", "all_filters", "penalties_and_filters", "greedy"]  # on the CPU: the top-k columns alone
BATCHES = dict(argvalues=[None, NO_TOP_P, ALL_TOP_K], ids=["all_mixes", "no_top_p", "all_top_k"])


@pytest.mark.parametrize("names", **BATCHES)
def test_mixed_batch_matches_the_reference_row_by_row(names):
    logits, params, histories = mixed_batch(40, names=names)
    got = torch.softmax(filtered_logits(logits, params, histories), dim=-1)
    want = torch.stack([ref_probs(logits[i], params[i], histories[i]) for i in range(40)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_top_p_keeps_the_smallest_prefix_and_at_least_one_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]]))
    kept = filtered_logits(logits, [SamplingParams(top_p=0.8), SamplingParams(top_p=0.1)]).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, False, False, False]]


def test_penalties_match_the_reference():
    rnd = random.Random(3)
    logits = torch.randn(12, V) * 3
    params = [SamplingParams(repetition_penalty=rnd.choice([0.5, 1.0, 1.7]), presence_penalty=rnd.uniform(-2, 2),
                             frequency_penalty=rnd.uniform(-2, 2)) for _ in range(12)]
    histories = [random_history(rnd) for _ in range(12)]
    got = filtered_logits(logits, params, histories)  # temperature 1, no filters: the penalized logits
    want = torch.stack([ref_penalties(logits[i], params[i], *histories[i]) for i in range(12)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for i in range(12):  # and the one-row form
        torch.testing.assert_close(apply_penalties(logits[i], params[i], *histories[i]), want[i], atol=1e-6, rtol=0)


def test_penalties_follow_vllm():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, p, prompt_ids=[0], output_ids=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, p, prompt_ids=[2], output_ids=[3, 3, 0])
    assert out.tolist() == pytest.approx([2.0 - 0.75, -2.0, 1.0, 0.5 - 1.0])
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # not in place


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)]) == [0]
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample(logits, [p], [([], [0])]) == [1]


def test_greedy_rows_are_the_argmax_in_any_mix():
    logits, params, histories = mixed_batch(36)
    tokens = sample(logits, params, histories)
    for i, p in enumerate(params):
        if p.greedy:
            want = ref_penalties(logits[i], p, *histories[i]).argmax()
            assert tokens[i] == int(want)
    plain = [SamplingParams(temperature=0.0)] * 36
    assert sample(logits, plain) == logits.argmax(dim=-1).tolist()


def test_sampled_tokens_survive_the_filters():
    logits, params, histories = mixed_batch(60, seed=5)
    allowed = filtered_logits(logits, params, histories).isfinite()
    for step in range(5):
        tokens = sample(logits, params, histories, [step] * 60)
        assert all(allowed[i, t] for i, t in enumerate(tokens))


# ---- seeds ------------------------------------------------------------------------------------------------
def test_a_seeded_request_ignores_the_batch_and_its_order():
    logits, params, histories = mixed_batch(24, seed=7)
    mine = SamplingParams(seed=4242, temperature=0.9, top_k=200, top_p=0.95, presence_penalty=0.3)
    row, hist = torch.randn(1, V) * 3, random_history(random.Random(9))
    alone = [sample(row, [mine], [hist], [step])[0] for step in range(8)]
    assert len(set(alone)) > 1  # the counter moves the draw
    rnd = random.Random(11)
    for trial in range(4):
        order = list(range(24))
        rnd.shuffle(order)
        k = rnd.randrange(25)
        order = order[:k] + [-1] + order[k:]  # -1: mine
        batch = torch.cat([row if i < 0 else logits[i : i + 1] for i in order])
        ps = [mine if i < 0 else params[i] for i in order]
        hs = [hist if i < 0 else histories[i] for i in order]
        for step in range(8):
            steps = [step if i < 0 else rnd.randrange(50) for i in order]
            assert sample(batch, ps, hs, steps)[k] == alone[step]


def test_seeded_sampling_ignores_the_rest_of_the_batch():
    """Without a counter, each params object counts its own draws, as the generator it replaces did."""
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], [SamplingParams(seed=7)])[0]
    together = sample(logits, [SamplingParams(seed=None), SamplingParams(seed=7), SamplingParams(seed=3)])
    assert together[1] == alone
    p, q = SamplingParams(seed=11), SamplingParams(seed=11)
    seq_alone = [sample(logits[1:2], [p])[0] for _ in range(6)]
    seq_mixed = [sample(logits, [SamplingParams(), q, SamplingParams()])[1] for _ in range(6)]
    assert seq_alone == seq_mixed and len(set(seq_alone)) > 1


def test_unseeded_params_draw_their_own_seed_once():
    a = SamplingParams(temperature=1.0)
    assert a.sampling_seed == a.sampling_seed
    b = dataclasses.replace(a)  # the engine's copy for a new request: a new seed
    assert b.sampling_seed != a.sampling_seed
    assert SamplingParams(seed=5).sampling_seed == 5
    assert SamplingParams() == SamplingParams()  # the drawn seed is not part of equality
    logits = torch.zeros(1, V)
    draws = {sample(logits, [SamplingParams()], None, [0])[0] for _ in range(20)}
    assert len(draws) > 10  # unseeded requests differ


# ---- frequencies ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "all_filters", "penalties_and_filters", "min_p"])
def test_sampled_frequencies_match_the_filtered_distribution(name):
    """40,000 draws of one row (one batch of 40,000 counter values): every frequency within 5 standard errors
    plus 1e-3 of its probability, and a chi-square over the kept tokens below a bound that a correct sampler
    exceeds with probability < 1e-6. The seeds are fixed, so the test is deterministic."""
    vocab, n = 257, 40_000
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)) * 2
    hist = random_history(random.Random(4), vocab)
    p = SamplingParams(seed=123, **MIXES[name])
    probs = torch.softmax(filtered_logits(row, [p], [hist]), dim=-1)[0].double()
    tokens = sample(row.expand(n, vocab), [p] * n, [hist] * n, list(range(n)))
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / n
    assert (freq[probs == 0] == 0).all()
    tol = 5 * (probs * (1 - probs) / n).sqrt() + 1e-3
    assert ((freq - probs).abs() <= tol).all(), (freq - probs).abs().max()
    kept = probs > 0
    expected = probs[kept] * n
    chi2 = float((((freq[kept] * n) - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    assert chi2 < df + 7 * (2 * df) ** 0.5 + 25, (chi2, df)


def test_draws_of_different_seeds_and_steps_are_independent():
    """Pairs (draw at step s, draw at step s + 1) of a uniform distribution over 8 tokens are uniform over 64."""
    n = 32_000
    logits = torch.zeros(n, 8)
    p = [SamplingParams(seed=s) for s in range(n)]
    a = torch.tensor(sample(logits, p, None, [0] * n))
    b = torch.tensor(sample(logits, p, None, [1] * n))
    pairs = torch.bincount(a * 8 + b, minlength=64).double()
    chi2 = float(((pairs - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 63 + 7 * (2 * 63) ** 0.5, chi2


# ---- structure --------------------------------------------------------------------------------------------
class CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("names", **BATCHES)
def test_no_per_row_work(names):
    """The torch calls a step makes do not grow with the number of rows, for the same mixes of parameters: at
    most one topk and one sort, one copy back (tolist), whatever N is."""
    counts = []
    for n in (24, 8 * 24):
        logits, params, histories = mixed_batch(n, names=names)
        with CountCalls() as mode:
            sample(logits, params, histories, list(range(n)))
        counts.append(mode.calls)
    assert counts[0] == counts[1]
    assert counts[0]["tolist"] == 1 and counts[0]["multinomial"] == 0
    assert (counts[0]["sort"], counts[0]["topk"]) == ((1, 1) if names is None else (0, 1))


def test_top_k_ties_are_kept_on_the_narrow_path():
    """Every sampled row has a top-k, but ties at the k-th value reach past the widest k: the full path runs."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0], [2.0, 1.0, 0.5, 0.0, 0.0, 0.0]])
    params = [SamplingParams(top_k=3), SamplingParams(top_k=2, top_p=0.99)]
    kept = filtered_logits(logits, params).isfinite()
    assert kept.tolist() == [[True] * 5 + [False], [True, True, False, False, False, False]]
    for i in range(2):
        assert torch.equal(kept[i], ref_probs(logits[i], params[i], None) > 0)


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(5, V)
    logp = torch.log_softmax(logits, dim=-1)
    tokens = [3, 1000, 0, 77, 500]
    assert token_logprob(logits, tokens) == pytest.approx([float(logp[i, t]) for i, t in enumerate(tokens)])
    tops = top_logprobs(logits, 3)
    for i, top in enumerate(tops):
        vals, ids = logp[i].topk(3)
        assert list(top) == ids.tolist() and list(top.values()) == pytest.approx(vals.tolist())


# ---- CUDA ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_on_cuda_only_the_token_ids_come_back():
    """The whole mix at full vocabulary on the GPU: the same tokens as on the CPU for greedy rows, draws that pass
    the filters, seeds that ignore the batch, and one device-to-host copy per step (the N token ids)."""
    from torch.profiler import ProfilerActivity, profile

    vocab, n = 151_936, 48
    rnd = random.Random(0)
    names = list(MIXES)
    params = [SamplingParams(seed=i, **MIXES[names[i % len(names)]]) for i in range(n)]
    histories = [random_history(rnd, vocab) for _ in range(n)]
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3).cuda()
    steps = list(range(n))
    tokens = sample(logits, params, histories, steps)  # warm up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        again = sample(logits, params, histories, steps)
        torch.cuda.synchronize()
    assert again == tokens
    names_ = [e.name for e in prof.events()]
    dtoh = [x for x in names_ if "Memcpy DtoH" in x or "Memcpy D2H" in x]
    assert len(dtoh) == 1, dtoh
    cpu = sample(logits.cpu(), params, histories, steps)
    assert [c for c, p in zip(cpu, params) if p.greedy] == [t for t, p in zip(tokens, params) if p.greedy]
    allowed = filtered_logits(logits, params, histories).isfinite()
    assert allowed.cpu()[torch.arange(n), torch.tensor(tokens)].all()
    probs = torch.softmax(filtered_logits(logits, params, histories), dim=-1).cpu()
    ref = torch.stack([ref_probs(logits[i].cpu(), params[i], histories[i]) for i in range(n)])
    # CUDA rounds otherwise than the CPU, so a token on a filter's edge may go the other way: total variation
    tv = (probs - ref).abs().sum(dim=-1) / 2
    assert tv.max() < 1e-3, tv.max()
    one = sample(logits[5:6], [params[5]], [histories[5]], [steps[5]])
    assert one == [tokens[5]]


def test_greedy_on_the_cpu_is_torchs_argmax():
    # The CPU's greedy rows take numpy's argmax (torch's is ~25x slower there): the same first maximum on ties, and
    # a NaN counted as the maximum, as torch.argmax does; other dtypes keep torch's.
    logits = torch.randn(5, 1001, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 900] = 50.0  # a tie: the first
    logits[2, 13] = float("nan")
    logits[3, :] = -float("inf")
    logits[3, 500] = 0.0
    greedy = [SamplingParams(temperature=0.0)] * 5
    assert sample(logits, greedy) == logits.argmax(dim=-1).tolist() == [int(logits[0].argmax()), 7, 13, 500,
                                                                        int(logits[4].argmax())]
    assert sample(logits.bfloat16(), greedy) == logits.bfloat16().argmax(dim=-1).tolist()
