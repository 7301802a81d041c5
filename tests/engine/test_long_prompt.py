"""A long prompt on the embedded default under the CPU rules: prefilled in --chunk_size chunks, then decoded, in a KV
cache sized for it; the pools the engine allocates are what `ktrans rules show` predicts for the same flags
(ktrans.inject.report), and the greedy tokens equal those of a one-pass prefill (fp32, the tiny model, as the other
chunking tests require). The full-size 128k run is a device benchmark (scripts/device_split_prefill.sh LENS=131072)."""
from __future__ import annotations

import torch

from ktrans.config import RULES_DIR
from ktrans.engine.engine import Engine, EngineConfig
from ktrans.engine.sampler import SamplingParams
from ktrans.inject.report import placement_report
from ktrans.inject.rules import load_rules

PROMPT, NEW, CHUNK = 6000, 4, 512  # 12 chunks, the last one partial; pages of 16 end mid-page


def test_long_prompt_prefills_in_chunks_decodes_and_uses_the_predicted_memory(tiny, reference):
    model, tok = tiny
    vocab = min(model.config.vocab_size, tok.vocab_size)
    prompt = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(11)).tolist()
    config = EngineConfig(max_batch_size=2, chunk_size=CHUNK, page_size=16, cache_lens=PROMPT + NEW,
                          prefix_cache_max_snapshots=3)
    engine = Engine(model, tok, config)
    out, _ = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert out.token_ids == reference(prompt, NEW)
    assert engine.num_steps == -(-PROMPT // CHUNK) + NEW - 1  # 12 prefill steps, then a decode step per further token

    report = placement_report(model.config, load_rules(RULES_DIR / "Qwen3Next-cpu.yaml"), cache_lens=PROMPT + NEW,
                              max_batch_size=2, weight_dtype="f32", kv_dtype="f32", default_device="cpu",
                              page_size=16, snapshot_slots=3)
    assert report.memory["cpu"]["kv"] == engine.kv.nbytes
    assert report.memory["cpu"]["state"] == engine.states.nbytes
    assert engine.cache.num_used_pages == -(-(PROMPT + NEW) // 16)  # the prefix cache keeps the finished sequence
    engine.flush_cache()
    assert engine.cache.all_free
