"""Injection semantics and parity: the injected model computes exactly what the plain model does."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ktrans.cli import main
from ktrans.inject import RuleError, inject, pool_devices
from ktrans.operators import BaseOperator
from ktrans.operators.experts import EXPERT_OPS, KExpertsTorch, KTransformersExperts
from ktrans.operators.linear import KTransformersLinear
from ktrans.operators.moe import KQwen3NextSparseMoeBlock
from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.model.source import build_model
from ktrans.engine.cache import CacheManager

from ..model.helpers import OTHER_SHAPE, load, make_checkpoint, pools, run_chunks
from .helpers import CPU_RULES, cpu_variant, injected, rules

TOL = 1e-6  # fp32, relative to the largest logit


@pytest.fixture(scope="module", params=["small", "other"])
def ckpt(request, tmp_path_factory):
    overrides = OTHER_SHAPE if request.param == "other" else {}
    return make_checkpoint(tmp_path_factory.mktemp(request.param), "small", seed=7, **overrides)


@pytest.fixture(scope="module")
def plain(ckpt):
    return load(ckpt)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= tol, f"relative max error {err:.2e} > {tol:.0e}"


def _decode_logits(model, prompts, conts):
    """Prefill the prompts together, then decode their continuations in pure decode batches."""
    kv, states = pools(model, len(prompts), 40)
    cache = CacheManager.from_pools(kv, states)
    pages = [cache.alloc_pages(kv.pages_for(40)) for _ in prompts]
    slots = [cache.alloc_slot() for _ in prompts]
    out = [model(ForwardBatch.build([SeqChunk(p, 0, s, pg) for p, s, pg in zip(prompts, slots, pages)], kv, states))]
    for step in range(len(conts[0])):
        chunks = [SeqChunk([c[step]], len(p) + step, s, pg) for p, c, s, pg in zip(prompts, conts, slots, pages)]
        batch = ForwardBatch.build(chunks, kv, states)
        assert batch.is_decode
        out.append(model(batch))
    return torch.cat(out)


@pytest.mark.parametrize("rules_file", ["Qwen3Next-cpu.yaml", "Qwen3Next-serve.yaml", "Qwen3Next-gpu.yaml"])
def test_injected_logits_equal_plain(ckpt, plain, rules_file):
    """Each shipped file with every device set to cpu (Qwen3Next-cpu.yaml: as shipped) and KExpertsTorch."""
    text = cpu_variant(rules_file)
    model, inj = injected(ckpt, rules(text, rules_file))
    assert not inj.unused_rules()
    prompts = [_ids(n, 10 + n) for n in (1, 9, 33)]
    # prefill of a batch, chunked prefill with mixed chunk plans, and decode batches
    for plan in (None, [[1], [4, 5], [1, 13, 19]]):
        for a, b in zip(run_chunks(model, prompts, plan)[0], run_chunks(plain, prompts, plan)[0]):
            _close(a, b)
    conts = [_ids(5, 60 + i) for i in range(3)]
    _close(_decode_logits(model, prompts, conts), _decode_logits(plain, prompts, conts))
    assert pool_devices(model) == (torch.device("cpu"), torch.device("cpu"))


def test_shipped_cpu_rules_equal_plain(ckpt, plain):
    """Qwen3Next-cpu.yaml exactly as shipped (C++ experts and linears, float weights kept in fp32) against the plain
    model. The C++ kernels sum in another order than torch (blocked, fused multiply-add), so fp32 rounding differs per
    matmul and compounds over the layers (with the C++ experts alone: 1.3e-6 (small) and 1.6e-5 (other shape) of
    the logit scale), bounded at 5e-5.
    """
    model, inj = injected(ckpt, rules(CPU_RULES.read_text()))
    assert type(model.model.layers[0].mlp.experts.op).__name__ == "KExpertsCPU"
    prompts = [_ids(n, 20 + n) for n in (1, 9, 33)]
    for plan in (None, [[1], [4, 5], [1, 13, 19]]):
        for a, b in zip(run_chunks(model, prompts, plan)[0], run_chunks(plain, prompts, plan)[0]):
            _close(a, b, tol=5e-5)
    conts = [_ids(5, 70 + i) for i in range(3)]
    _close(_decode_logits(model, prompts, conts), _decode_logits(plain, prompts, conts), tol=5e-5)


def test_every_module_is_placed_and_loaded(ckpt):
    model, inj = injected(ckpt, rules(CPU_RULES.read_text()))
    assert not [n for n, p in model.named_parameters() if p.is_meta]
    names = {p.name for p in inj.placed}
    assert {n for n, _ in model.named_modules() if n and ".op" not in n and "prefill_op" not in n} >= names
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, KQwen3NextSparseMoeBlock)
    assert isinstance(layer.mlp.experts, KTransformersExperts)
    assert isinstance(layer.mlp.gate, KTransformersLinear)


def _meta(ckpt):
    from ktrans.config import ModelConfig

    return build_model(ModelConfig.from_json(ckpt / "config.json"))


def test_first_matching_rule_wins(ckpt):
    rs = rules("""
    - match: {name: "^lm_head$"}
      replace: {class: tests.inject.custom_ops.KScaledLinear, kwargs: {scale: 2.0}}
    - match: {class: torch.nn.Linear}
      replace: {class: KTransformersLinear}
    - match: {name: "^lm_head$"}
      replace: {class: KTransformersLinear}
    """)
    model = _meta(ckpt)
    inj = inject(model, rs)
    assert type(model.lm_head).__name__ == "KScaledLinear"
    assert type(model.model.layers[0].mlp.gate) is KTransformersLinear
    assert {p.name: p.rule.index for p in inj.placed if p.rule}["lm_head"] == 1
    unused = [(r.index, why) for r, why in inj.unused_rules()]
    assert unused == [(3, "matches only modules an earlier rule already placed")]


def test_op_specific_kwargs_reach_a_custom_operator(ckpt, plain):
    rs = rules("""
    - match: {name: "^lm_head$"}
      replace: {class: tests.inject.custom_ops.KScaledLinear, kwargs: {scale: 2.0}}
    """)
    model, _ = injected(ckpt, rs)
    ids = _ids(12, 3)
    _close(run_chunks(model, [ids])[0][0], 2.0 * run_chunks(plain, [ids])[0][0])
    with pytest.raises(RuleError, match="replace.kwargs.scale: must be a float, got 'big'"):
        rules("""
        - match: {name: "^lm_head$"}
          replace: {class: tests.inject.custom_ops.KScaledLinear, kwargs: {scale: big}}
        """)


def test_recursive_false_stops_the_walk(ckpt, plain):
    rs = rules(r"""
    - match: {name: '^model\.layers\.0\.mlp$'}
      replace: {class: KQwen3NextSparseMoeBlock}
      recursive: false
    - match: {class: torch.nn.Linear}
      replace: {class: KTransformersLinear}
    - match: {class: Qwen3NextSparseMoeBlock}
      replace: {class: KQwen3NextSparseMoeBlock}
    """)
    model, inj = injected(ckpt, rs)
    l0, l1 = model.model.layers[0].mlp, model.model.layers[1].mlp
    assert isinstance(l0, KQwen3NextSparseMoeBlock) and isinstance(l1, KQwen3NextSparseMoeBlock)
    assert type(l0.gate) is nn.Linear and type(l0.shared_expert.up_proj) is nn.Linear  # not walked into
    # No rule reaches the experts, skeletons whose math is their operator's: they get it, with its default op.
    assert type(l1.gate) is KTransformersLinear and type(l1.experts) is KTransformersExperts
    assert type(l0.experts) is KTransformersExperts and l0.experts.op_names["generate"] == "KExpertsTorch"
    ids = _ids(20, 4)
    _close(run_chunks(model, [ids])[0][0], run_chunks(plain, [ids])[0][0])


def test_class_and_name_must_both_hold(ckpt):
    rs = rules(r"""
    - match: {name: '^model\.layers\.0\.', class: Qwen3NextRMSNorm}
      replace: {class: KQwen3NextRMSNorm}
    """)
    model = _meta(ckpt)
    inj = inject(model, rs)
    replaced = sorted(p.name for p in inj.placed if p.operator is not None and p.rule is not None)  # by the rule
    expected = {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"}
    if model.config.layer_types[0] == "full_attention":
        expected |= {"model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"}
    assert set(replaced) == expected  # not layer 1's norms, not the final norm, not the gated DeltaNet norm


def test_negative_lookahead_skips_shared_expert_gate(ckpt):
    model = _meta(ckpt)
    inject(model, rules(cpu_variant("Qwen3Next-serve.yaml")))
    moe = [m for m in model.modules() if isinstance(m, KQwen3NextSparseMoeBlock)]
    assert moe
    for m in moe:
        assert type(m.shared_expert_gate) is nn.Linear
        assert type(m.gate) is KTransformersLinear and type(m.shared_expert.down_proj) is KTransformersLinear


KEEP_EMBEDDING = r"""
- match:
    name: "^model\\.embed_tokens$"
  replace:
    class: "default"
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
"""


def test_default_keeps_the_module_and_places_it(ckpt, plain):
    model, inj = injected(ckpt, rules(KEEP_EMBEDDING + cpu_variant("Qwen3Next-serve.yaml")))
    emb = model.model.embed_tokens
    assert type(emb) is nn.Embedding and not emb.weight.is_meta
    assert emb._ktrans_device == torch.device("cpu")
    assert {p.name: p.rule.index for p in inj.placed if p.rule}["model.embed_tokens"] == 1  # the first rule (indices count from 1)


def test_placement_of_the_serve_rules_without_loading(ckpt):
    """On the meta device, no GPU needed: devices per phase, inheritance and out devices."""
    from ktrans.config import RULES_DIR
    from ktrans.inject import load_rules

    model = _meta(ckpt)
    inj = inject(model, load_rules(RULES_DIR / "Qwen3Next-serve.yaml"))
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert inj.default_device == cuda
    placed = {p.name: p for p in inj.placed}
    experts = placed["model.layers.0.mlp.experts"].operator
    assert experts.devices == {"prefill": cuda, "generate": cpu}
    assert experts.op_names == {"prefill": "KExpertsSplit", "generate": "KExpertsCPU"}
    assert experts.out_devices == {"prefill": cuda, "generate": cuda}
    assert experts.streams("prefill") and experts.resident_devices() == [cpu]
    gate = placed["model.layers.0.mlp.shared_expert_gate"]  # no rule: inherits the MoE block's device
    assert gate.rule is None and gate.devices["generate"] == cuda
    emb = placed["model.embed_tokens"]  # on the GPU with the rest of a decode step (a CUDA graph holds it)
    assert emb.devices["generate"] == cuda and emb.out_devices["generate"] == cuda
    assert placed["model.layers.0"].devices["prefill"] == cuda  # containers: the default device


def test_operator_on_the_wrong_module_class(ckpt):
    rs = rules(r"""
    - match: {name: '^model\.layers\.0\.mlp$'}
      replace: {class: KTransformersLinear}
    """)
    with pytest.raises(RuleError) as e:
        inject(_meta(ckpt), rs)
    assert ("test.yaml: rule 1 (line 2): replace.class: KTransformersLinear replaces Linear modules, but "
            "model.layers.0.mlp is a Qwen3NextSparseMoeBlock") in str(e.value)


@pytest.fixture
def future_op():
    EXPERT_OPS.declare("KExpertsFuture", devices=("cpu",), module="ktrans.operators.no_such_module",
                       provided_by="a later issue")
    yield "KExpertsFuture"
    EXPERT_OPS._ops.pop("KExpertsFuture")


def test_op_not_built_fails_at_build_time(ckpt, future_op):
    text = cpu_variant("Qwen3Next-cpu.yaml").replace('generate_op: "KExpertsTorch"', f'generate_op: "{future_op}"')
    rs = rules(text)  # validates: the op is declared
    with pytest.raises(RuleError) as e:
        injected(ckpt, rs)
    msg = str(e.value)
    assert "test.yaml: rule 5 (line" in msg and "model.layers.0.mlp.experts" in msg
    assert "experts op KExpertsFuture is not built yet: it comes with a later issue" in msg
    assert "KExpertsTorch" in msg  # what to use instead


@pytest.fixture
def counting_op():
    calls = {"submit": 0, "sync": 0}

    @EXPERT_OPS.register("KExpertsCounting", devices=("cpu",))
    class KExpertsCounting(KExpertsTorch):
        def submit(self, x, topk_ids, topk_weights):
            calls["submit"] += 1
            super().submit(x, topk_ids, topk_weights)

        def sync(self):
            calls["sync"] += 1
            return super().sync()

    yield calls
    EXPERT_OPS._ops.pop("KExpertsCounting")


def test_expert_op_plugs_in_by_name_and_prefill_streams(ckpt, plain, counting_op):
    """A registered op is usable by name; a prefill placement apart from decode streams its experts."""
    text = cpu_variant("Qwen3Next-cpu.yaml").replace('generate_op: "KExpertsTorch"', 'generate_op: "KExpertsCounting"')
    model, _ = injected(ckpt, rules(text))
    experts = model.model.layers[0].mlp.experts
    assert type(experts.impl["generate"]).__name__ == "KExpertsCounting"
    assert experts.impl["prefill"].streaming and not list(experts.impl["prefill"].parameters())
    prompts, conts = [_ids(7, 1), _ids(11, 2)], [_ids(3, 3), _ids(3, 4)]
    # the streamed prefill groups tokens per expert and decode gathers weights into batched matmuls: other fp32
    # summation orders than the plain model's (1.5e-6 on a Zen 4 box)
    _close(_decode_logits(model, prompts, conts), _decode_logits(plain, prompts, conts), tol=5e-6)
    n_moe = sum(isinstance(m, KQwen3NextSparseMoeBlock) for m in model.modules())
    assert counting_op == {"submit": 3 * n_moe, "sync": 3 * n_moe}  # decode steps only; prefill streamed


def test_generate_cli_with_rules_matches_plain(ckpt, capsys, tmp_path):
    args = ["generate", "--model_path", str(ckpt), "--prompt_ids", "5,17,300,2,9", "--max_new_tokens", "6",
            "--ignore_eos", "--json", "--chunk_size", "3"]
    assert main(args) == 0
    plain_out = json.loads(capsys.readouterr().out)
    path = tmp_path / "cpu.yaml"
    path.write_text(cpu_variant("Qwen3Next-cpu.yaml"))
    assert main(args + ["--optimize_config_path", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == plain_out["output_ids"]


def test_generate_cli_rejects_device_with_rules(ckpt, capsys):
    args = ["generate", "--model_path", str(ckpt), "--prompt_ids", "1", "--optimize_config_path", str(CPU_RULES),
            "--device", "cuda"]
    assert main(args) == 2
    assert "with --optimize_config_path the rules place every module" in capsys.readouterr().err


def test_operators_report_their_placement(ckpt):
    model, _ = injected(ckpt, rules(cpu_variant("Qwen3Next-cpu.yaml")))
    ops = [m for m in model.modules() if isinstance(m, BaseOperator)]
    assert ops and all(m.devices["prefill"] == torch.device("cpu") for m in ops)
    assert "cpu KExpertsTorch" in repr(model.model.layers[0].mlp.experts)
