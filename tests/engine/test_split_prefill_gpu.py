"""Prefill with the experts split between the CPU and the GPU (Qwen3Next-serve.yaml's KExpertsSplit) against prefill
with the experts on the CPU alone (Qwen3Next-serve-cpuexperts.yaml), on a tiny Q4_K_M GGUF whose matrices are Q4_K /
Q6_K as in the 80B file. Decode is the same op in both (the CPU experts), so what differs is what the prefill left in
the KV cache and the DeltaNet states.

Teacher-forced as the equivalence rule asks: prompts of exactly the threshold (16 tokens), of 40 tokens cut into a
32-token chunk (split) and an 8-token one (below the threshold: CPU alone) and of 7 tokens, then 64 decode steps
fed the reference's tokens. The two sides differ in one place, the prefill's MoE: the CPU experts quantize each
token's activations to 8 bits per 256-value block (Q8_K, up to ~0.4% of a block's largest value per element) where
the GPU share multiplies bf16 activations by the exactly dequantized blocks. That difference in the KV cache and the
DeltaNet states then runs through 64 decode steps of a random model. Logits within GPU_TOL: four bf16 ulps of the
largest logits (|logit| < 32: an ulp of 0.125; the test checks that the logits stay under 32). Measured on the H200:
0.1875 with the reference layer ops, 0.367 with the Triton layer ops (both sessions' runs, deterministic). The argmax
must agree wherever the reference's top-2 margin exceeds 2 ARGMAX_TOL = 0.5 (two ulps: the stricter check).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GPU_TOL = 0.5
ARGMAX_TOL = 0.25
LOGIT_MAX = 32.0  # GPU_TOL is four bf16 ulps below this magnitude


def test_split_prefill_matches_cpu_prefill(tmp_path_factory):
    from ktrans.config import RULES_DIR
    from ktrans.inject import build_injected_model, parse_rules
    from ktrans.runtime.batch import SeqChunk

    from ..operators.test_gpu_quant_rules import _gguf
    from .test_graphs import _model_runner, teacher_forced_steps

    config, source = _gguf(tmp_path_factory, "q4_k_m")
    serve = (RULES_DIR / "Qwen3Next-serve.yaml").read_text()
    assert "gpu_prefill_min_tokens: 512" in serve
    split = serve.replace("gpu_prefill_min_tokens: 512", "gpu_prefill_min_tokens: 16\n      cpu_share: 0.5")
    texts = [(RULES_DIR / "Qwen3Next-serve-cpuexperts.yaml").read_text(), split]
    models = [build_injected_model(config, parse_rules(t, f"r{i}.yaml"), source, torch.bfloat16)[0]
              for i, t in enumerate(texts)]
    experts = models[1].model.layers[0].mlp.experts
    assert type(experts.impl["prefill"]).__name__ == "KExpertsSplit"
    runners = [_model_runner(m, graphs=False, max_num_tokens=32) for m in models]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (16, 40, 7)]
    pages = [[4 * i + j for j in range(4)] for i in range(3)]
    worst = 0.0
    splits = []
    for slot, (p, pg) in enumerate(zip(prompts, pages)):
        outs = []
        for r in runners:
            for start in range(0, len(p), 32):  # 40 tokens: a 32-token chunk, then 8 (below the threshold)
                logits = r.step([SeqChunk(p[start:start + 32], start, slot, pg)])
                if r is runners[1]:
                    splits.append(experts.impl["prefill"].last["n_cpu"])
            outs.append(logits.float())
        assert float(outs[0].abs().max()) < LOGIT_MAX
        worst = max(worst, float((outs[1] - outs[0]).abs().max()))
    assert splits == [config.num_experts // 2, config.num_experts // 2, config.num_experts, config.num_experts]
    decode_worst, disagreements = teacher_forced_steps(runners, prompts, pages, ARGMAX_TOL)
    assert max(worst, decode_worst) <= GPU_TOL, \
        f"max |logits - CPU prefill|: {worst:.4f} at the prompts' last tokens, {decode_worst:.4f} over 64 decode steps"
    assert not disagreements, f"argmax differs where the margin exceeds {2 * ARGMAX_TOL}: steps {disagreements}"
