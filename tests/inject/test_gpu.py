"""GPU placements (need CUDA; skipped without it): Qwen3Next-gpu.yaml, Qwen3Next-serve.yaml and a custom split
give the logits of the plain fp32 CPU model, through prefill, chunked prefill and decode batches."""
from __future__ import annotations

import pytest
import torch

from ktrans.config import RULES_DIR
from ktrans.inject import RuleError, pool_devices
from ktrans.operators.experts import EXPERT_OPS
from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.runtime.pools import KVPool, StatePool
from ktrans.engine.cache import CacheManager

from ..model.helpers import load, make_checkpoint
from .helpers import injected, rules

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = 2e-5  # fp32 on two devices: summation orders differ, TF32 is off


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return make_checkpoint(tmp_path_factory.mktemp("gpu"), "small", seed=11)


@pytest.fixture(scope="module")
def plain(ckpt):
    return load(ckpt)


def serve_text() -> str:
    text = (RULES_DIR / "Qwen3Next-serve.yaml").read_text()
    if not EXPERT_OPS.built("KExpertsCPU"):  # the C++ experts are another issue's; the placement is what is tested
        text = text.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsTorch"')
    return text


# The doc/rules.md example: experts of the first half of the layers on the GPU, the rest on the CPU.
SPLIT = serve_text().replace(r'''- match:
    name: "^model\\.layers\\..*\\.mlp\\.experts$"''', r'''- match:
    name: "^model\\.layers\\.[0-3]\\.mlp\\.experts$"
  replace:
    class: KTransformersExperts
    kwargs: {prefill_device: "cuda", generate_device: "cuda", prefill_op: KExpertsTorch, generate_op: KExpertsTorch}
  recursive: False
- match:
    name: "^model\\.layers\\..*\\.mlp\\.experts$"''')


def run(model, prompts, conts, plans=None, page_size=8):
    """Prefill (in chunks per plan), then decode the continuation ids in pure decode batches; pools where
    pool_devices says. Logits of every token per prompt, on the CPU."""
    kv_dev, st_dev = pool_devices(model)
    total = max(len(p) + len(c) for p, c in zip(prompts, conts))
    kv = KVPool(model.config, len(prompts) * -(-total // page_size), page_size, torch.float32, kv_dev)
    states = StatePool(model.config, len(prompts), torch.float32, st_dev)
    cache = CacheManager.from_pools(kv, states)
    pages = [cache.alloc_pages(kv.pages_for(total)) for _ in prompts]
    slots = [cache.alloc_slot() for _ in prompts]
    plans = plans or [[len(p)] for p in prompts]
    done, out = [0] * len(prompts), [[] for _ in prompts]
    for step in range(max(map(len, plans))):
        chunks, owners = [], []
        for i, (p, plan) in enumerate(zip(prompts, plans)):
            if step < len(plan):
                chunks.append(SeqChunk(p[done[i]:done[i] + plan[step]], done[i], slots[i], pages[i], logits="all"))
                owners.append((i, plan[step]))
                done[i] += plan[step]
        logits, off = model(ForwardBatch.build(chunks, kv, states)).cpu(), 0
        for i, n in owners:
            out[i].append(logits[off:off + n])
            off += n
    for step in range(len(conts[0])):
        chunks = [SeqChunk([c[step]], len(p) + step, slots[i], pages[i])
                  for i, (p, c) in enumerate(zip(prompts, conts))]
        batch = ForwardBatch.build(chunks, kv, states)
        assert batch.is_decode
        logits = model(batch).cpu()
        for i in range(len(prompts)):
            out[i].append(logits[i:i + 1])
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("which", ["gpu", "serve", "split"])
def test_gpu_placements_match_the_cpu_model(ckpt, plain, which):
    text = {"gpu": (RULES_DIR / "Qwen3Next-gpu.yaml").read_text(), "serve": serve_text(), "split": SPLIT}[which]
    model, inj = injected(ckpt, rules(text, which))
    assert torch.device("cuda:0") in inj.devices()
    prompts = [[(7 * i + 3) % 512 for i in range(n)] for n in (5, 19, 40)]
    conts = [[(11 * i + j) % 512 for i in range(4)] for j in range(3)]
    for plans in (None, [[2, 3], [1, 7, 11], [16, 24]]):
        # The same schedule on the plain CPU model: only the device differs.
        for got, want in zip(run(model, prompts, conts, plans), run(plain, prompts, conts, plans)):
            assert got.shape == want.shape
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < TOL, f"{which}: relative error {err:.2e}"
    if which == "serve":
        experts = model.model.layers[0].mlp.experts
        assert experts.impl["generate"].device == torch.device("cpu") and experts.impl["prefill"].streaming
        # the shipped serve rules keep the embedding on the GPU (0.6 GB at 80B), so a decode step is one graph
        assert model.model.embed_tokens.devices["generate"].type == "cuda"
    if which == "split":
        assert model.model.layers[0].mlp.experts.devices["generate"].type == "cuda"
        assert model.model.layers[7].mlp.experts.devices["generate"].type == "cpu"


def test_pools_on_the_wrong_device_are_named(ckpt):
    model, _ = injected(ckpt, rules((RULES_DIR / "Qwen3Next-gpu.yaml").read_text()))
    kv, states = KVPool(model.config, 4, 8), StatePool(model.config, 1)  # on the CPU: wrong for these rules
    with pytest.raises(RuntimeError, match="runs on cuda:0 but its .* is on cpu"):
        model(ForwardBatch.build([SeqChunk([1, 2, 3], 0, 0, [0])], kv, states))


def test_missing_gpu_index_is_an_error(ckpt):
    n = torch.cuda.device_count()
    text = (RULES_DIR / "Qwen3Next-gpu.yaml").read_text().replace('"cuda"', f'"cuda:{n}"')
    with pytest.raises(RuleError, match=f"'cuda:{n}' does not exist: this machine has {n} CUDA device"):
        injected(ckpt, rules(text))
