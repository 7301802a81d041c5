"""The default rules (optimize_rules/Qwen3Next-default.yaml): the plain model is an injected model with every module
on one device and the reference ops, and `rules show` reports on it like any shipped file."""
from __future__ import annotations

import json

import torch

from ktrans.cli import main
from ktrans.inject import default_rules, load_model
from ktrans.inject.load import DEFAULT_RULES
from ktrans.model.source import ModelSource

from ..model.helpers import make_checkpoint

REFERENCE_OPS = {"KEmbeddingTorch", "KLinearTorch", "KExpertsTorch", "KGatedDeltaNetTorch", "KAttentionTorch",
                 "KRMSNormTorch", "KRoPETorch", "KRouterTorch", None}  # None: composites (MLP) run their children


def test_default_rules_place_every_module_on_one_device_with_reference_ops(tmp_path):
    rules = default_rules()
    assert not rules.devices(), "the default rules name no device: the caller's --device places everything"
    model, inj = load_model(ModelSource(model_path=str(make_checkpoint(tmp_path, "small", seed=5))),
                            show_progress=False)
    assert not inj.unused_rules()
    ops = inj.operators()
    assert {type(p.operator).__name__ for p in ops} >= {"KEmbedding", "KTransformersLinear", "KTransformersExperts",
                                                         "KQwen3NextGatedDeltaNet", "KQwen3NextAttention",
                                                         "KQwen3NextRMSNorm", "KQwen3NextSparseMoeBlock",
                                                         "KQwen3NextRotaryEmbedding"}
    assert {p.operator.placement(ph)[1] for p in ops for ph in ("prefill", "generate")} <= REFERENCE_OPS
    assert inj.devices() == [torch.device("cpu")]
    assert all(t.device.type == "cpu" and not t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_rules_show_reports_the_default_rules(capsys):
    assert main(["rules", "show", "--optimize_config_path", str(DEFAULT_RULES), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert not rep["warnings"] and set(rep["memory"]) == {"cpu"}
