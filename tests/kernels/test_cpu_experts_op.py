"""KExpertsCPU in the injected model: Qwen3Next-cpu.yaml with the C++ experts against the same rules with
KExpertsTorch, on tiny GGUF files (Q8_0, and Q4_K_M whose 64-wide expert rows fall back to Q5_0/Q8_0 as
llama.cpp does) and on a float safetensors checkpoint quantized at load."""
from __future__ import annotations

import pytest
import torch

from ktrans.config import RULES_DIR, ModelConfig
from ktrans.inject import build_injected_model, parse_rules
from ktrans.model.tiny import preset_config, random_state_dict
from ktrans.operators.experts import EXPERT_OPS
from ktrans.engine.sampler import SamplingParams
from ktrans.weights.gguf_source import GGUFSource
from ktrans.weights.gguf_writer import write_gguf
from ktrans import _cpu
from ktrans.weights.source import StateDictSource

from ..model.helpers import generate

CPU_RULES = (RULES_DIR / "Qwen3Next-cpu.yaml").read_text()  # as shipped: KExpertsCPU in both phases
TORCH_RULES = CPU_RULES.replace('_op: "KExpertsCPU"', '_op: "KExpertsTorch"')
Q8_RULES = CPU_RULES.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"\n      quant: "Q8_0"')
assert CPU_RULES != TORCH_RULES and "quant" in Q8_RULES
# The experts' output against KExpertsTorch (relative RMS): int8 activations cost ~1-1.5%, as in test_cpu_moe.
OP_TOL = 0.03
# The logits of the whole tiny model (relative RMS over prefill and decode positions): four layers of that.
LOGIT_TOL = 0.05


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    return config, random_state_dict(config, seed=3)


@pytest.fixture(scope="module", params=["q8_0", "q4_k_m"])
def gguf_source(request, tiny, tmp_path_factory):
    config, state = tiny
    path = write_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf", config, state, request.param)
    return request.param, GGUFSource(path)


def build(config, source, rules_text):
    model, _ = build_injected_model(config, parse_rules(rules_text, "test.yaml"), source, torch.float32)
    return model


def greedy(model, prompt, n):
    return generate(model, prompt, n, SamplingParams(temperature=0.0, ignore_eos=True)).token_ids


def test_op_is_registered():
    assert EXPERT_OPS.built("KExpertsCPU")


def test_gguf_model_matches_torch_experts(tiny, gguf_source):
    config, _ = tiny
    quant, source = gguf_source
    ref, model = build(config, source, TORCH_RULES), build(config, source, CPU_RULES)
    assert type(model.model.layers[0].mlp.experts.op).__name__ == "KExpertsCPU"
    # llama.cpp's types: Q8_0 everywhere, or for Q4_K_M the fallbacks of 64-wide rows (Q5_0, Q8_0), all read natively
    want = {"q8_0": {"Q8_0"}, "q4_k_m": {"Q5_0", "Q8_0"}}[quant]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, config.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(config.num_experts, generator=gen)[:config.num_experts_per_tok] for _ in x])
    w = torch.rand(ids.shape, generator=gen)
    for a, b in zip(ref.model.layers, model.model.layers):
        assert set(b.mlp.experts.op.load_report["types"]) <= want
        ya, yb = a.mlp.experts.op(x, ids, w), b.mlp.experts.op(x, ids, w)
        assert rel(yb, ya) < OP_TOL
    prompt = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    out_ref, out = greedy(ref, prompt, 16), greedy(model, prompt, 16)
    if quant == "q8_0":
        assert out == out_ref, "greedy output diverged from KExpertsTorch on the Q8_0 file"
    # Logits of prefill and decode steps, teacher-forcing the reference continuation through both models.
    ids_all = prompt + out_ref
    err = rel(_all_logits(model, ids_all), _all_logits(ref, ids_all))
    assert err < LOGIT_TOL, f"{quant}: logits differ by {err:.3f} (relative RMS)"


def rel(y, ref) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def _all_logits(model, ids):
    from ktrans.runtime.batch import ForwardBatch, SeqChunk
    from ktrans.engine.cache import CacheManager
    from ktrans.engine.engine import make_pools

    kv, states = make_pools(model, -(-(len(ids) + 1) // 16), 16, num_slots=1)
    cache = CacheManager.from_pools(kv, states)
    pages = cache.alloc_pages(kv.pages_for(len(ids) + 1))
    slot = cache.alloc_slot()
    out = [model(ForwardBatch.build([SeqChunk(ids[:8], 0, slot, pages)], kv, states))]
    for t in range(8, len(ids)):  # then pure decode steps
        out.append(model(ForwardBatch.build([SeqChunk([ids[t]], t, slot, pages)], kv, states)))
    return torch.cat(out).float()


def test_float_checkpoint_kept_in_model_dtype_by_default(tiny):
    """Without `quant`, float experts stay float32: the shipped CPU rules reproduce the torch reference."""
    config, state = tiny
    source = StateDictSource(state)
    ref, model = build(config, source, TORCH_RULES), build(config, source, CPU_RULES)
    assert model.model.layers[0].mlp.experts.op.load_report["types"] == ("F32",) * 3
    prompt = list(range(100, 112))
    assert rel(_all_logits(model, prompt), _all_logits(ref, prompt)) < 1e-6


def test_float_checkpoint_is_quantized_at_load_when_asked(tiny):
    config, state = tiny
    source = StateDictSource(state)
    ref, model = build(config, source, TORCH_RULES), build(config, source, Q8_RULES)
    assert model.model.layers[0].mlp.experts.op.load_report["types"] == ("Q8_0",) * 3
    prompt = list(range(100, 112))
    assert rel(_all_logits(model, prompt), _all_logits(ref, prompt)) < LOGIT_TOL


def test_hugepages_rule_kwarg(tiny):
    """`hugepages: false` reads the weights in place; a value that is not a bool is refused, naming the field."""
    config, state = tiny
    off = CPU_RULES.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"\n      hugepages: false')
    op = build(config, StateDictSource(state), off).model.layers[0].mlp.experts.op
    assert op.hugepages is False and op.load_report["hugepages"] is False
    bad = CPU_RULES.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"\n      hugepages: "yes"')
    with pytest.raises(Exception, match="hugepages.*must be a bool"):
        parse_rules(bad, "bad.yaml")


def test_cpu_config_rule_kwarg(tiny):
    """`cpu_config` sets fields of every layer's CPUMoEConfig (the others keep their defaults); an unknown field or a
    bad value is refused naming it, and a value that is not a mapping by the rules."""
    from ktrans.kernels.cpu import CPUMoEConfig

    config, state = tiny

    def rules(value):
        return CPU_RULES.replace('generate_op: "KExpertsCPU"', f'generate_op: "KExpertsCPU"\n      cpu_config: {value}')

    model = build(config, StateDictSource(state), rules("{gate_up_tasks: 8, prefetch_hint: t1, tile_min_tokens: 4}"))
    want = CPUMoEConfig(gate_up_tasks=8, prefetch_hint="t1", tile_min_tokens=4)
    for block in model.model.layers:
        assert block.mlp.experts.op.moe.config == want
    for value, match in [("{gate_up_task: 8}", "cpu_config: unknown CPUMoEConfig field 'gate_up_task'"),
                         ("{down_tasks: 0}", r"cpu_config: CPUMoEConfig\.down_tasks: must be at least 1"),
                         ("{prefetch_hint: t3}", r"cpu_config: CPUMoEConfig\.prefetch_hint")]:
        with pytest.raises(ValueError, match=match):
            build(config, StateDictSource(state), rules(value))
    with pytest.raises(Exception, match="cpu_config.*must be a dict"):
        parse_rules(rules("8"), "bad.yaml")


@pytest.fixture(scope="module")
def tiny256():
    """The tiny model with sizes that fill Q4_K blocks (256 values) in both directions, so Q4_K experts are repacked."""
    hf = preset_config("tiny")
    hf.update(hidden_size=256, moe_intermediate_size=256)
    config = ModelConfig.from_hf_dict(hf, source="tiny-256")
    return config, random_state_dict(config, seed=4)


Q4_RULES = CPU_RULES.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"\n      quant: "Q4_K"')


def test_repacked_q4_k_model_matches_the_blocks_as_they_are(tiny256):
    """The whole model on repacked Q4_K experts against the same Q4_K blocks unrepacked (which test_cpu_moe checks
    against the torch reference on the dequantized blocks): logits within float summation order, the same greedy
    tokens."""
    config, state = tiny256
    source = StateDictSource(state)
    x16 = build(config, source, Q4_RULES)
    plain = build(config, source, Q4_RULES.replace('quant: "Q4_K"', 'quant: "Q4_K"\n      repack: false'))
    if not _cpu.reads_x16(x16.model.layers[0].mlp.experts.op.moe.path):
        pytest.skip("the kernel path here does not read Q4_K_X16")
    assert x16.model.layers[0].mlp.experts.op.load_report["layouts"] == ("Q4_K_X16",) * 3
    assert plain.model.layers[0].mlp.experts.op.load_report["layouts"] == ("Q4_K",) * 3
    prompt = list(range(100, 112))
    assert rel(_all_logits(x16, prompt), _all_logits(plain, prompt)) < 1e-4
    assert greedy(x16, prompt, 16) == greedy(plain, prompt, 16)


def test_repack_rule_kwarg(tiny256):
    """`repack: false` keeps Q4_K blocks as the GGUF has them; on by default, it repacks them where the kernel path
    reads Q4_K_X16; a value that is not a bool is refused, naming the field."""
    config, state = tiny256
    q4 = Q4_RULES
    experts = build(config, StateDictSource(state), q4).model.layers[0].mlp.experts
    op = experts.op
    want = "Q4_K_X16" if _cpu.reads_x16(op.moe.path) else "Q4_K"
    assert op.repack is True and op.load_report["layouts"] == (want,) * 3
    off = q4.replace('quant: "Q4_K"', 'quant: "Q4_K"\n      repack: false')
    op = build(config, StateDictSource(state), off).model.layers[0].mlp.experts.op
    assert op.repack is False and op.load_report["layouts"] == ("Q4_K",) * 3
    # a streaming op (prefill elsewhere than decode) builds its layer per call: it reads the blocks in place
    streaming = type(op)(experts, op.device, streaming=True, quant="Q4_K")
    streaming.source = StateDictSource(state)
    streaming.submit(torch.randn(2, 256), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    assert streaming.sync().shape == (2, 256)
    assert streaming.load_report["layouts"] == ("Q4_K",) * 3 and not streaming.load_report["hugepages"]
    bad = CPU_RULES.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"\n      repack: 1')
    with pytest.raises(Exception, match="repack.*must be a bool"):
        parse_rules(bad, "bad.yaml")


@pytest.mark.triton
def test_gpu_experts_rule_kwarg(tiny256, tmp_path, caplog, monkeypatch, triton_device):
    """`gpu_experts: N`: experts 0..N-1 also packed on `gpu_device` (the GPU; interpreted, the CPU), the pairs routed
    to them computed there by the Triton MoE and the rest by the C++ experts (their ids masked to -1 on each side;
    on a GPU the CPU's share runs on the stream): within the int8 activations' tolerance of the torch experts, like
    the CPU alone; a step routed only to resident experts gives the Triton MoE's output exactly. Without CUDA the
    default device keeps every expert on the CPU (a warning); N past the layer's experts is refused."""
    import logging

    from ktrans.kernels.triton.moe_quant import moe_quant

    config, state = tiny256
    source = GGUFSource(write_gguf(tmp_path / "t.gguf", config, state, "q4_k_m"))
    e, k = config.num_experts, config.num_experts_per_tok

    def rules(kwargs):
        return CPU_RULES.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"' + kwargs)

    hybrid = build(config, source, rules(f'\n      gpu_experts: 3\n      gpu_device: "{triton_device}"'))
    op = hybrid.model.layers[0].mlp.experts.op
    plain = build(config, source, CPU_RULES).model.layers[0].mlp.experts.op
    ref = build(config, source, TORCH_RULES).model.layers[0].mlp.experts.op
    assert op.resident is not None and op.resident[0].experts == 3 and op.load_report["gpu_experts"] == 3
    from ktrans.api.server import gpu_experts_line

    assert "experts 0..N-1" in gpu_experts_line(hybrid) and gpu_experts_line(build(config, source, CPU_RULES)) is None
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(6)])
    w = torch.rand(6, k, generator=g)
    assert (ids < 3).any() and (ids >= 3).any()
    want = ref.forward(x, ids, w)
    dx, dids, dw = x.to(triton_device), ids.to(triton_device), w.to(triton_device)
    got, cpu_only = op.forward(dx, dids, dw).cpu(), plain.forward(x, ids, w)
    assert rel(got, want) < OP_TOL and rel(cpu_only, want) < OP_TOL and not torch.equal(got, cpu_only)
    resident_ids = dids % 3
    assert torch.equal(op.forward(dx, resident_ids, dw), moe_quant(dx, resident_ids, dw, *op.resident))
    # the CPU's share is handed off before the resident pairs are launched, so that the two run side by side
    from ktrans.kernels import cpu, cpu_stream
    from ktrans.kernels.triton import moe_quant as mq

    order = []
    for owner in (cpu.CPUMoE, cpu_stream.StreamMoE, mq):
        name = "moe_quant" if owner is mq else "submit"
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _n=owner.__name__, **kw: (order.append(_n),
                                                                                            _real(*a, **kw))[1])
    assert torch.equal(op.forward(dx, dids, dw).cpu(), got) and len(order) == 2 and order[1] == mq.__name__
    # a resident launch that fails drains the CPU's share in flight and reports the GPU's error; the next step runs

    def broken(*a, **kw):
        raise RuntimeError("resident launch failed")

    monkeypatch.setattr(mq, "moe_quant", broken)
    with pytest.raises(RuntimeError, match="resident launch failed"):
        op.forward(dx, dids, dw)
    assert op._resident_out is None and op._pending is None and op._on_stream is None
    monkeypatch.undo()
    assert torch.equal(op.forward(dx, dids, dw).cpu(), got)
    with caplog.at_level(logging.WARNING):
        op = build(config, source, rules("\n      gpu_experts: 2")).model.layers[0].mlp.experts.op
    if not torch.cuda.is_available():
        assert op.resident is None and "no CUDA device" in caplog.text
    with pytest.raises(ValueError, match="gpu_experts must be 0.."):
        build(config, source, rules(f"\n      gpu_experts: {e + 1}"))


@pytest.mark.triton
def test_gpu_experts_from_routing_statistics(tiny256, tmp_path, triton_device):
    """`gpu_experts_from`: the layer's N most-routed experts in a routing statistics file (ties: the lower id) are
    the resident ones, in that order; a step's pairs routed to them run on the resident stacks under their slots
    (exactly the Triton MoE on the slot ids), the rest on the C++ experts, within the int8 tolerance of the torch
    experts. Without gpu_experts, or for a layer the file lacks, it is refused naming the kwarg."""
    import json

    from ktrans.kernels.triton.moe_quant import moe_quant
    from ktrans.operators.routing_stats import FORMAT, _read

    config, state = tiny256
    source = GGUFSource(write_gguf(tmp_path / "t.gguf", config, state, "q4_k_m"))
    e, k = config.num_experts, config.num_experts_per_tok
    counts = [0] * e
    counts[e - 1], counts[2], counts[e - 3], counts[0] = 9, 7, 7, 3  # the hottest three: e-1, then 2 and e-3 tied
    stats = tmp_path / "routing.json"
    layers = range(config.num_hidden_layers)
    stats.write_text(json.dumps({"format": FORMAT, "num_experts": e, "layers": {str(i): counts for i in layers},
                                 "tokens": {str(i): 13 for i in layers}}))

    def rules(kwargs):
        return CPU_RULES.replace('generate_op: "KExpertsCPU"', 'generate_op: "KExpertsCPU"' + kwargs)

    hybrid = build(config, source, rules(f'\n      gpu_experts: 3\n      gpu_device: "{triton_device}"'
                                         f'\n      gpu_experts_from: "{stats}"'))
    op = hybrid.model.layers[0].mlp.experts.op
    assert op.resident_ids == [e - 1, 2, e - 3] and op.resident[0].experts == 3
    from ktrans.api.server import gpu_experts_line  # the startup summary's line

    line = gpu_experts_line(hybrid)
    assert f"3 of {e} a layer also on" in line and f"most-routed in {stats}" in line
    assert f"in {config.num_hidden_layers} layers" in line
    ref = build(config, source, TORCH_RULES).model.layers[0].mlp.experts.op
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, config.hidden_size, generator=g)
    assert (e, k) == (16, 4)
    ids = torch.tensor([[15, 1, 5, 6], [2, 0, 7, 8], [13, 3, 9, 10], [1, 13, 11, 4], [15, 4, 12, 14]])  # each row:
    w = torch.rand(5, k, generator=g)  # resident (15, 2, 13) and CPU experts
    dx, dids, dw = x.to(triton_device), ids.to(triton_device), w.to(triton_device)
    assert rel(op.forward(dx, dids, dw).cpu(), ref.forward(x, ids, w)) < OP_TOL
    # a pair masked off by the caller (-1, as the split prefill's GPU share passes) adds nothing: it is not the last
    # expert's (15, resident) slot
    masked = ids.clone()
    masked[:, 2] = -1
    dropped = torch.where(masked < 0, 4, masked), torch.where(masked < 0, 0.0, w)  # expert 4 at weight 0
    assert rel(op.forward(dx, masked.to(triton_device), dw).cpu(), ref.forward(x, *dropped)) < OP_TOL
    hot = torch.tensor([e - 1, 2, e - 3], device=triton_device)
    pick = torch.stack([torch.randperm(3, generator=g)[:min(k, 3)] for _ in range(5)]).to(triton_device)
    only_hot = hot[pick]
    assert torch.equal(op.forward(dx, only_hot, dw[:, :only_hot.shape[1]]),
                       moe_quant(dx, pick, dw[:, :only_hot.shape[1]], *op.resident))
    with pytest.raises(ValueError, match="gpu_experts_from needs gpu_experts"):
        build(config, source, rules(f'\n      gpu_experts_from: "{stats}"'))
    stats.write_text(json.dumps({"format": FORMAT, "num_experts": e, "layers": {str(i): counts for i in layers[1:]},
                                 "tokens": {str(i): 13 for i in layers[1:]}}))
    _read.cache_clear()
    with pytest.raises(ValueError, match="no counts for layer 0"):
        build(config, source, rules(f'\n      gpu_experts: 3\n      gpu_device: "{triton_device}"'
                                    f'\n      gpu_experts_from: "{stats}"'))
