"""The CPU placement's flat decode step (ktrans.engine.cpu_decode) against the module forward it stands in for.

Both run the same ops and C++ kernels on the same inputs, so the logits must be equal, not close: under the shipped
Qwen3Next-cpu.yaml, three prompts are prefilled, then all three decode for 24 steps fed the module forward's greedy
tokens (teacher-forced), and every step's logits are compared with torch.equal (and checked finite). Two models:
- a tiny Q4_K_M GGUF, whose in_proj_qkvz is stored as two tensors of different types in some layers (the split
  projection's gather) and whose shared experts run as one-expert CPUMoE jobs;
- a float32 checkpoint with a dense (non-MoE) layer and attention/DeltaNet shapes unlike the preset's, whose float
  weights keep the MLPs on their three projections.
"""
from __future__ import annotations

import pytest
import torch

from ktrans.runtime.batch import SeqChunk

pytest.importorskip("gguf")
STEPS = 24


def _runner(model, flat: bool):
    """A runner with the flat step asked for (KTRANS_CPU_DECODE=1, read at import) or not."""
    from ktrans.engine import runner as runner_mod
    from ktrans.runtime.pools import KVPool, StatePool

    kv = KVPool(model.config, 16, 32, torch.float32, torch.device("cpu"))
    states = StatePool(model.config, 4, torch.float32, torch.device("cpu"))
    saved, runner_mod._CPU_DECODE = runner_mod._CPU_DECODE, flat
    try:
        return runner_mod.ModelRunner(model, kv, states, max_num_seqs=4, max_num_tokens=64, max_pages_per_seq=4,
                                      device="cpu")
    finally:
        runner_mod._CPU_DECODE = saved


def _flat_equals_modules(models, vocab: int, monkeypatch):
    """Prefill, then STEPS teacher-forced decode steps of three sequences: the logits of the flat step (second
    model) equal the module forward's (first) at every step, and the flat step ran exactly the decode steps."""
    from ktrans.engine.cpu_decode import CPUDecodeStep

    runners = [_runner(models[0], flat=False), _runner(models[1], flat=True)]
    assert runners[0].cpu_decode is None and isinstance(runners[1].cpu_decode, CPUDecodeStep)
    calls = []
    real = CPUDecodeStep.__call__
    monkeypatch.setattr(CPUDecodeStep, "__call__", lambda self, batch: calls.append(batch.num_seqs) or real(self, batch))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 17, 4)]
    pages = [[4 * i + j for j in range(4)] for i in range(3)]
    for slot, (p, pg) in enumerate(zip(prompts, pages)):
        firsts = [r.step([SeqChunk(p, 0, slot, pg)]) for r in runners]  # both through the modules
        assert torch.equal(firsts[0], firsts[1])
    tokens = [int(p[-1]) for p in prompts]
    lens = [len(p) for p in prompts]
    for step in range(STEPS):
        chunks = [SeqChunk([t], n, i, pages[i]) for i, (t, n) in enumerate(zip(tokens, lens))]
        ref, got = (r.step(chunks) for r in runners)
        assert torch.isfinite(ref).all() and ref.shape == (3, vocab)
        assert torch.equal(got, ref), f"step {step}: max |diff| {float((got - ref).abs().max())}"
        tokens, lens = ref.argmax(-1).tolist(), [n + 1 for n in lens]
    assert calls == [3] * STEPS  # every decode step took the flat path, no prefill step did
    return runners[1].cpu_decode


@pytest.mark.parametrize("small", [None, 300], ids=["c++ rows", "torch above the size rule"])
def test_flat_decode_equals_the_module_forward_gguf(tmp_path_factory, monkeypatch, small):
    from ktrans.config import RULES_DIR
    from ktrans.engine.cpu_decode import _Linear
    from ktrans.inject import build_injected_model, parse_rules
    from ktrans.operators import layers_cpu

    from ..operators.test_gpu_quant_rules import _gguf

    if small is not None:  # every norm and router call then takes the ops' torch path, in both forwards
        monkeypatch.setattr(layers_cpu, "SMALL_ELEMENTS", small)

    config, source = _gguf(tmp_path_factory, "q4_k_m")
    rules = parse_rules((RULES_DIR / "Qwen3Next-cpu.yaml").read_text(), "Qwen3Next-cpu.yaml")
    models = [build_injected_model(config, rules, source, torch.float32)[0] for _ in range(2)]
    step = _flat_equals_modules(models, config.vocab_size, monkeypatch)
    linears = [v for layer in step.layers for v in vars(layer).values() if isinstance(v, _Linear)]
    assert any(lin.order is not None for lin in linears), "no split projection in the file: the gather is untested"
    spans = [type(plan[1]) for lin in linears for plan in lin._plans.values()]
    # the split in_proj_qkvz's [q | k | v] and z lie side by side as stored (views); in_proj_ba's b and a do not
    assert tuple in spans and torch.Tensor in spans, spans
    assert all(layer.gdn.calls > 0 for layer in step.layers if layer.gdn is not None)  # its one C++ call, not the op
    assert all(layer.shared.fused is not None for layer in step.layers)


def test_flat_decode_equals_the_module_forward_dense_layer(tmp_path, monkeypatch):
    from ..inject.helpers import CPU_RULES, injected, rules
    from ..model.helpers import make_checkpoint
    from ..operators.test_layers_cpu import SHAPE

    ckpt = make_checkpoint(tmp_path, "small", seed=11, **SHAPE)
    models = [injected(ckpt, rules(CPU_RULES.read_text()))[0] for _ in range(2)]
    step = _flat_equals_modules(models, models[0].config.vocab_size, monkeypatch)
    assert step.layers[2].dense is not None and step.layers[2].dense.fused is None  # three float projections
    assert any(layer.gdn is not None for layer in step.layers) and any(layer.attn is not None for layer in step.layers)


def test_build_declines_what_it_does_not_cover(tmp_path_factory):
    from ktrans.config import RULES_DIR
    from ktrans.engine.cpu_decode import CPUDecodeStep
    from ktrans.inject import build_injected_model, parse_rules

    from ..operators.test_gpu_quant_rules import _gguf

    config, source = _gguf(tmp_path_factory, "q4_k_m")
    shipped = (RULES_DIR / "Qwen3Next-cpu.yaml").read_text()
    for text, dtype, why in ((shipped.replace('"KRouterCPU"', '"KRouterTorch"'), torch.float32, "KRouterCPU"),
                             (shipped, torch.bfloat16, "float32")):
        model = build_injected_model(config, parse_rules(text, "t.yaml"), source, dtype)[0]
        step, reason = CPUDecodeStep.build(model)
        assert step is None and why in reason, reason
        assert _runner(model, flat=True).cpu_decode is None
