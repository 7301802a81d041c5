"""Rule files: every validation error names the file, the rule, its line and the field, with a useful message."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ktrans.config import RULES_DIR
from ktrans.inject import RuleError, check_devices, load_rules
from ktrans.inject.rules import resolve_class
from ktrans.model.qwen3_next import Qwen3NextRMSNorm, Qwen3NextSparseMoeBlock
from ktrans.operators.embedding import KEmbedding
from ktrans.operators.experts import KTransformersExperts
from ktrans.operators.linear import KTransformersLinear

from .helpers import SHIPPED, rules

LINEAR = """
- match:
    name: "^lm_head$"
  replace:
    class: KTransformersLinear
    kwargs: {kwargs}
"""

CPU_PATH = RULES_DIR / "Qwen3Next-cpu.yaml"


def error(text: str) -> str:
    with pytest.raises(RuleError) as e:
        rules(text)
    return str(e.value)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_files_validate(name):
    rs = load_rules(RULES_DIR / name)
    assert len(rs) == 10
    assert all(r.replace is not None or r.replace_name == "default" for r in rs)


def test_serve_file_has_the_ktransformers_rules():
    rs = load_rules(RULES_DIR / "Qwen3Next-serve.yaml")
    experts = rs.rules[4]
    assert experts.replace is KTransformersExperts and experts.recursive is False
    assert experts.kwargs == {"prefill_device": "cuda", "prefill_op": "KExpertsSplit", "gpu_prefill_min_tokens": 512,
                              "generate_device": "cpu", "generate_op": "KExpertsCPU", "out_device": "cuda"}
    assert rs.rules[2].name == r"^model\.layers\.(?!.*mlp\.shared_expert_gate).*$"
    assert rs.rules[7].replace is KEmbedding and rs.rules[7].kwargs["generate_device"] == "cuda"


def test_cpuexperts_file_is_the_serve_file_but_for_the_experts_rule():
    """Qwen3Next-serve-cpuexperts.yaml says it is the serve rules with rule 5's prefill on the CPU: the GPU tests
    compare the two placements (split against CPU prefill), so any other difference (the linears' op, a layer op)
    would be measured as the split's (the serve file alone had moved to KLinearMarlin in session 13)."""
    serve, cpux = (load_rules(RULES_DIR / n) for n in ("Qwen3Next-serve.yaml", "Qwen3Next-serve-cpuexperts.yaml"))
    fields = lambda r: (r.name, r.match_class, r.replace, r.replace_name, r.kwargs, r.recursive)  # noqa: E731
    differ = [i for i, (a, b) in enumerate(zip(serve, cpux)) if fields(a) != fields(b)]
    assert len(serve) == len(cpux) and differ == [4]
    assert cpux.rules[4].kwargs == {"prefill_device": "cpu", "prefill_op": "KExpertsCPU", "generate_device": "cpu",
                                    "generate_op": "KExpertsCPU", "out_device": "cuda"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("name", ["Qwen3Next-serve.yaml", "Qwen3Next-gpu.yaml"])
def test_cuda_rules_fail_device_check_without_cuda(name):
    rs = load_rules(RULES_DIR / name)  # validation itself does not need the devices
    with pytest.raises(RuleError) as e:
        check_devices(rs)
    msg = str(e.value)
    assert name in msg and "rule 1 (line" in msg and "replace.kwargs.prefill_device: 'cuda' needs CUDA" in msg
    assert "CUDA is missing" in msg and "optimize_rules/Qwen3Next-cpu.yaml" in msg
    with pytest.raises(RuleError, match="CUDA is missing"):
        load_rules(RULES_DIR / name, check=True)
    check_devices(load_rules(RULES_DIR / "Qwen3Next-cpu.yaml"))


def test_class_names_resolve_like_ktransformers():
    assert resolve_class("ktransformers.operators.experts.KTransformersExpertsV2") is KTransformersExperts
    assert resolve_class("ktransformers.operators.linear.KTransformersLinear") is KTransformersLinear
    assert resolve_class("ktransformers.models.modeling_qwen3_next.Qwen3NextRMSNorm") is Qwen3NextRMSNorm
    assert resolve_class("torch.nn.Linear") is nn.Linear
    assert resolve_class("Qwen3NextSparseMoeBlock") is Qwen3NextSparseMoeBlock
    assert resolve_class("ktrans.operators.linear.KTransformersLinear") is KTransformersLinear
    assert resolve_class("tests.inject.custom_ops.KScaledLinear").__name__ == "KScaledLinear"  # imported


# ---- one test per kind of error -------------------------------------------------------------------------------------

def test_not_a_list():
    assert "expected a YAML list of rules, got a dict" in error("match: {name: x}")
    assert "has no rules" in error("")


def test_yaml_syntax_error():
    msg = error("- match: {name: [unclosed\n")
    assert msg.startswith("test.yaml: not valid YAML")


def test_rule_not_a_mapping():
    assert "test.yaml: rule 1 (line 1): a rule must be a mapping" in error("- just a string")


def test_unknown_top_level_key():
    msg = error("- match: {name: x}\n  recurse: false\n")
    assert "test.yaml: rule 1 (line 1): recurse: unknown key" in msg and "did you mean 'recursive'?" in msg


def test_unknown_match_and_replace_keys():
    assert "rule 1 (line 1): match.names: unknown key" in error("- match: {names: x}")
    msg = error("- match: {name: x}\n  replace: {class: default, kwarg: {}}\n")
    assert "replace.kwarg: unknown key" in msg and "did you mean 'kwargs'?" in msg


def test_missing_match():
    assert "rule 1 (line 1): match: required" in error("- replace: {class: default}")
    assert "match: required" in error("- match: {}\n  replace: {class: default}")


def test_rule_index_and_line_point_at_the_bad_rule():
    text = """
    - match: {name: "^lm_head$"}
      replace: {class: KTransformersLinear}

    - match: {name: "(unclosed"}
    """
    msg = error(text)
    assert "test.yaml: rule 2 (line 5): match.name: bad regex '(unclosed'" in msg


def test_bad_regex():
    assert "match.name: bad regex '[a-'" in error('- match: {name: "[a-"}')
    assert "match.name: must be a regex string" in error("- match: {name: 3}")


def test_unknown_class():
    msg = error("- match: {class: Qwen3NextRMSNrom}")
    assert "match.class: unknown class 'Qwen3NextRMSNrom'; did you mean Qwen3NextRMSNorm" in msg
    msg = error("- match: {name: x}\n  replace: {class: ktransformers.operators.experts.KExpertsFoo}\n")
    assert "replace.class: unknown class 'ktransformers.operators.experts.KExpertsFoo'" in msg
    assert "cannot import class 'no_such_pkg.Op'" in error("- match: {class: no_such_pkg.Op}")


def test_replace_with_a_model_class():
    msg = error("- match: {name: x}\n  replace: {class: Qwen3NextMLP}\n")
    assert "replace.class: 'Qwen3NextMLP' is a model class, not an operator" in msg


def test_unknown_kwarg():
    msg = error(LINEAR.format(kwargs="{prefill_dev: cpu}"))
    assert "rule 1 (line 2): replace.kwargs.prefill_dev: unknown kwarg for KTransformersLinear" in msg
    msg = error("- match: {name: x}\n  replace: {class: default, kwargs: {generate_op: KLinearTorch}}\n")
    assert "replace.kwargs.generate_op: unknown kwarg for default" in msg


def test_bad_device_string():
    msg = error(LINEAR.format(kwargs="{generate_device: gpu}"))
    assert "replace.kwargs.generate_device: unknown device 'gpu': use 'cpu', 'cuda' or 'cuda:N'" in msg


def test_unknown_op():
    msg = error(LINEAR.format(kwargs="{generate_op: KLinearTorh}"))
    assert "replace.kwargs.generate_op: unknown linear op 'KLinearTorh'" in msg and "did you mean 'KLinearTorch'" in msg
    msg = error("- match: {name: experts}\n  replace: {class: KTransformersExperts, kwargs: {prefill_op: KLinearTorch}}")
    assert "unknown experts op 'KLinearTorch'" in msg


def test_op_that_cannot_run_on_the_device():
    text = "- match: {name: experts}\n  replace: {class: KTransformersExperts, kwargs: {generate_device: cuda, " \
           "generate_op: KExpertsCPU}}"
    assert "replace.kwargs.generate_device: KExpertsCPU cannot run on 'cuda:0': it runs on cpu only" in error(text)
    msg = error(LINEAR.format(kwargs="{generate_device: cpu, generate_op: VLinearMarlin}"))
    assert "KLinearMarlin cannot run on 'cpu': it runs on cuda only" in msg


def test_one_device_operators():
    msg = error("- match: {class: Qwen3NextAttention}\n  replace: {class: KQwen3NextAttention, kwargs: "
                "{prefill_device: cuda, generate_device: cpu}}")
    assert "KQwen3NextAttention runs on one device (its KV cache pages live on one device)" in msg
    msg = error("- match: {name: x}\n  replace: {class: default, kwargs: {prefill_device: cuda, generate_device: cpu}}")
    assert "default runs on one device" in msg


def test_composite_has_no_ops():
    msg = error("- match: {class: Qwen3NextMLP}\n  replace: {class: KQwen3NextMLP, kwargs: {generate_op: KLinearTorch}}")
    assert "replace.kwargs.generate_op: KQwen3NextMLP has no ops to choose" in msg


def test_recursive_must_be_a_bool():
    assert "recursive: must be true or false, got 'no'" in error("- match: {name: x}\n  recursive: 'no'\n")


def test_duplicate_keys():
    msg = error("- match: {name: a, name: b}")
    assert "rule 1 (line 1): name: key given twice" in msg


def test_missing_file():
    with pytest.raises(RuleError, match="no-such.yaml: no such rule file.*Qwen3Next-serve.yaml"):
        load_rules("no-such.yaml")


def test_shipped_rules_found_from_any_directory(tmp_path, monkeypatch):
    """`--optimize_config_path optimize_rules/Qwen3Next-cpu.yaml`, as the docs write it, works outside the checkout;
    a user's own file of that relative path still wins when it exists."""
    monkeypatch.chdir(tmp_path)
    assert len(load_rules("optimize_rules/Qwen3Next-cpu.yaml").rules) == len(load_rules(CPU_PATH).rules)
    (tmp_path / "optimize_rules").mkdir()
    (tmp_path / "optimize_rules" / "Qwen3Next-cpu.yaml").write_text(
        "- match: {name: '^lm_head$'}\n  replace: {class: default, kwargs: {generate_device: cpu}}\n")
    assert len(load_rules("optimize_rules/Qwen3Next-cpu.yaml").rules) == 1
    with pytest.raises(RuleError, match="no such rule file"):
        load_rules("elsewhere/Qwen3Next-cpu.yaml")
