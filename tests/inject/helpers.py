"""Helpers for injection tests: rule files from text, small checkpoints loaded plain and injected."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import torch

from ktrans.config import RULES_DIR, ModelConfig
from ktrans.inject import build_injected_model, parse_rules
from ktrans.weights.hf import HFWeightSource

SHIPPED = ["Qwen3Next-serve.yaml", "Qwen3Next-cpu.yaml", "Qwen3Next-gpu.yaml"]
CPU_RULES = RULES_DIR / "Qwen3Next-cpu.yaml"


def rules(text: str, source: str = "test.yaml"):
    return parse_rules(textwrap.dedent(text), source)


def injected(ckpt: Path, rule_set, dtype=torch.float32, default_device: str | None = None):
    config = ModelConfig.from_json(ckpt / "config.json")
    model, injection = build_injected_model(config, rule_set, HFWeightSource(ckpt, config), dtype, default_device)
    return model, injection


def cpu_variant(name: str) -> str:
    """A shipped file with every device set to cpu and the reference expert and linear ops (the C++ and Triton ops are
    compared with them in their own tests, within a quantization bound): the same operators and structure, exact,
    runnable here."""
    text = (RULES_DIR / name).read_text().replace('"cuda"', '"cpu"')
    for op, ref in (("KExpertsCPU", "KExpertsTorch"), ("KLinearCPUInfer", "KLinearTorch"),
                    ("KExpertsMarlin", "KExpertsTorch"), ("KLinearMarlin", "KLinearTorch"),
                    ("KExpertsSplit", "KExpertsTorch"), ("KRMSNormCPU", "KRMSNormTorch"),
                    ("KRouterCPU", "KRouterTorch")):
        text = text.replace(f'"{op}"', f'"{ref}"')
    # the Triton layer ops: each operator's default op is its torch reference
    return re.sub(r'(?m)^ *(generate|prefill)_op: "K\w+Triton"\n', "", text)
