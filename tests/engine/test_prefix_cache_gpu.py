"""The prefix cache on the GPU placements (needs CUDA; skipped without it): the embedded default under the GPU
rules and under the serve rules (experts on the CPU), float32. A mid-page hit, a chat's next turn and concurrent
hits decode as without the cache, the pools live on the GPU, and every page and slot comes back."""
from __future__ import annotations

import pytest
import torch

from ktrans.api.server import ServeOptions, load
from ktrans.config import RULES_DIR
from ktrans.engine.engine import Engine, EngineConfig
from ktrans.engine.sampler import SamplingParams

from .conftest import pools_full
from .test_prefix_cache_engine import run, words

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["Qwen3Next-gpu.yaml", "Qwen3Next-serve.yaml"])
def placed(request):
    threads = torch.get_num_threads()
    model, tok, _, _ = load(ServeOptions(optimize_config_path=str(RULES_DIR / request.param), dtype="float32"),
                            show_progress=False)
    torch.set_num_threads(threads)
    return model, tok


def test_hits_on_the_gpu_decode_as_without_the_cache(placed):
    model, tok = placed

    def reference(p: list[int], n: int) -> list[int]:
        e = Engine.for_one_request(model, tok, len(p) + n)
        return e.generate(p, SamplingParams(temperature=0.0, max_tokens=n))[0].token_ids

    e = Engine(model, tok, EngineConfig(page_size=16, chunk_size=32, max_batch_size=4))
    assert e.states.ssm[0].is_cuda and e.kv.k[0].is_cuda
    shared = words(tok, "shared", 7)  # 14 tokens: ends mid-page
    first = shared + words(tok, "alpha", 2)
    out1 = run(e, [first], 5)[0]
    follow = first + out1.token_ids + words(tok, "beta", 3)
    branches = [shared + words(tok, f"gamma{i}", 2) for i in range(3)]
    outs = run(e, [follow], 5) + run(e, branches, 5)
    for p, o in zip([first, follow, *branches], [out1, *outs]):
        assert o.token_ids == reference(p, 5)
    assert outs[0].num_cached_tokens == len(first) + 4 and outs[0].num_cached_tokens % 16  # a mid-page hit
    assert e.prefix_cache.stats.hits >= 1
    assert pools_full(e)
