"""The one load path: a ModelSource's parts, a rule set (the built-in default rules unless given), a loaded model.

    opened = ModelSource(model_path, gguf_path).open()      # config, WeightSource, tokenizer
    model, injection = load_model(opened, dtype, device)      # meta tree -> inject(rules) -> operators load

The plain model is the injected model under the default rules (optimize_rules/Qwen3Next-default.yaml: every
module on `device`, reference torch ops); a rule file places modules elsewhere or picks other ops. Either way every
weight is read by an operator (or a kept module) from the one WeightSource, by HF name.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ktrans.config import RULES_DIR
from ktrans.inject.injector import Injection, build_injected_model
from ktrans.inject.rules import RuleSet, load_rules
from ktrans.model.qwen3_next import Qwen3NextForCausalLM
from ktrans.model.source import ModelSource, OpenedModel

DEFAULT_RULES = RULES_DIR / "Qwen3Next-default.yaml"


def default_rules() -> RuleSet:
    """Everything on the injection's default device, reference ops: the plain model."""
    return load_rules(DEFAULT_RULES)


def load_model(source: ModelSource | OpenedModel, dtype: torch.dtype = torch.float32, device: str | None = None,
               rules: RuleSet | str | Path | None = None, show_progress: bool = True
               ) -> tuple[Qwen3NextForCausalLM, Injection]:
    """The loaded model and where its modules went. Without rules, the default rules on `device` (cpu when None);
    with rules, `device` is the default device of modules no rule places (None: cuda:0 if a rule uses CUDA)."""
    opened = source.open() if isinstance(source, ModelSource) else source
    if rules is None:
        rules, device = default_rules(), device or "cpu"
    return build_injected_model(opened.config, rules, opened.weights, dtype, device, show_progress)
