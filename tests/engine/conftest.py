"""Fixtures for the serving tests: the embedded default model (loaded once), engines and servers on it."""
from __future__ import annotations

import pytest
import torch

from ktrans.engine.engine import Engine, EngineConfig
from ktrans.engine.sampler import SamplingParams
from ktrans.api.server import BackgroundServer, ServeOptions, load


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the embedded default as `ktrans serve` loads it with no flags (under the CPU rules)."""
    threads = torch.get_num_threads()
    model, tok, _, _ = load(ServeOptions(), show_progress=False)
    torch.set_num_threads(threads)  # load() sets --cpu_infer's default for the process; keep other tests' setting
    return model, tok


@pytest.fixture(scope="session")
def reference(tiny):
    """Greedy generation alone, as `ktrans generate` runs it (a one-request engine, prompt in one pass), the oracle
    for batched, chunked and preempted serving: reference(prompt_ids, n) -> output ids."""
    model, tok = tiny
    cache: dict = {}

    def ref(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            engine = Engine.for_one_request(model, tok, len(prompt_ids) + max_new_tokens)
            out, _ = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
            cache[key] = out.token_ids
        return cache[key]

    return ref


def make_server(tiny, api_key: str | None = None, **engine_kwargs) -> BackgroundServer:
    model, tok = tiny
    return BackgroundServer(Engine(model, tok, EngineConfig(**engine_kwargs)), tok, "tiny", api_key).start()


def pools_full(engine: Engine) -> bool:
    """Every page and slot free once the prefix cache has let go of what it keeps (a flush)."""
    engine.flush_cache()
    s = engine.stats()
    return s["kv_pages_free"] == s["kv_pages"] and s["slots_free"] == s["slots"] and s["num_running"] == 0
