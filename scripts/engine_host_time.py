"""The engine's own host time per step, with the model's forward replaced by a stub (the runner still builds each
step's batch): what scheduling, batching, sampling and output handling cost on the host, apart from the model.

    python3 scripts/engine_host_time.py [--batch 1] [--steps 200]

Runs the embedded default model's engine on the CPU (its tokenizer and vocabulary: sampling over ~150k logits).
"""
from __future__ import annotations

import argparse
import time

import torch

from ktrans.api.server import ServeOptions, load
from ktrans.engine.engine import Engine, EngineConfig
from ktrans.engine.sampler import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    model, tok, _, _ = load(ServeOptions(), show_progress=False)
    engine = Engine(model, tok, EngineConfig(max_batch_size=max(16, args.batch), cache_lens=16384))
    logits = torch.randn(engine.config.chunk_size, model.config.vocab_size)

    def stub(chunks):  # the batch is built as for a real step; the logits are a fixed tensor's rows
        engine.runner.prepare(chunks)
        rows = sum({"last": 1, "all": len(c.token_ids), "none": 0}[c.logits] for c in chunks)
        return logits[:rows]

    engine.runner.step = stub
    for _ in range(args.batch):
        engine.submit(list(range(5, 40)), SamplingParams(temperature=0.0, max_tokens=args.steps + 10, ignore_eos=True))
    for _ in range(3):  # prefill and the first decode steps
        engine.poll()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.poll()
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    print(f"batch {args.batch}: {ms:.3f} ms of host time a decode step ({args.steps} steps, forward stubbed)")


if __name__ == "__main__":
    main()
