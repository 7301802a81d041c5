"""Fixtures for the serving tests: the embedded default model (loaded once), engines and servers on it."""
from __future__ import annotations

import pytest
import torch

from ktrans.engine.engine import Engine, EngineConfig
from ktrans.engine.offline import generate
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
    """Greedy offline generation, the oracle for the server: reference(prompt_ids, n) -> output ids."""
    model, tok = tiny
    stop = set(tok.eos_token_ids) | set(model.config.eos_token_id)
    cache: dict = {}

    def ref(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            cache[key] = generate(model, prompt_ids, max_new_tokens, SamplingParams(temperature=0.0),
                                  stop_token_ids=stop).output_ids
        return cache[key]

    return ref


def make_server(tiny, api_key: str | None = None, **engine_kwargs) -> BackgroundServer:
    model, tok = tiny
    return BackgroundServer(Engine(model, tok, EngineConfig(**engine_kwargs)), tok, "tiny", api_key).start()


def pools_full(engine: Engine) -> bool:
    s = engine.stats()
    return s["kv_pages_free"] == s["kv_pages"] and s["slots_free"] == s["slots"] and s["num_running"] == 0
