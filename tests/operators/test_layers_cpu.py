"""KGatedDeltaNetCPU, KAttentionCPU, KRMSNormCPU and KRouterCPU (the C++ kernels) in a whole small model against the
reference ops: the same checkpoint, the same CPU placement with the reference experts and linears; only these ops
differ.

Teacher-forced (tests/operators/helpers.py): chunked prefill, a mixed step (one sequence decoding beside two
prefilling: the DeltaNet and attention ops' torch path), then pure decode steps (the C++ kernels), the logits of
every step compared. The norms and the router take their C++ path at every step of these sizes.
Tolerance: fp32 models, so the kernels differ from torch only in summation order (ulps per op) through 4 layers:
max |diff| / max |logit| below 1e-4; a wrong head, gate, state slot or page moves the logits by O(1).
"""
from __future__ import annotations

import torch

from ktrans.operators import layers_cpu
from ktrans.operators.attention import ATTENTION_OPS
from ktrans.operators.gdn import GDN_OPS

from ..inject.helpers import CPU_RULES, cpu_variant, injected, rules
from ..model.helpers import OTHER_SHAPE, make_checkpoint
from .helpers import compare_teacher_forced

TOL = 1e-4
# DeltaNet, attention, DeltaNet, attention: value-head groups of 2 on 3 key heads, Dk=20, Dv=12, conv width 3;
# 8 query heads on 2 kv heads of 24.
SHAPE = {**OTHER_SHAPE, "num_hidden_layers": 4, "mlp_only_layers": [2], "linear_num_value_heads": 6,
         "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]}
# cpu_variant maps every C++ op to its reference; the layer ops under test are put back
OURS = cpu_variant(CPU_RULES.name).replace('"KRMSNormTorch"', '"KRMSNormCPU"').replace('"KRouterTorch"', '"KRouterCPU"')
REFERENCE = (OURS.replace('"KGatedDeltaNetCPU"', '"KGatedDeltaNetTorch"').replace('"KAttentionCPU"', '"KAttentionTorch"')
             .replace('"KRMSNormCPU"', '"KRMSNormTorch"').replace('"KRouterCPU"', '"KRouterTorch"'))


def test_shipped_cpu_rules_use_them():
    assert GDN_OPS.built("KGatedDeltaNetCPU") and ATTENTION_OPS.built("KAttentionCPU")
    text = CPU_RULES.read_text()
    assert text.count('_op: "KGatedDeltaNetCPU"') == 2 and text.count('_op: "KAttentionCPU"') == 2
    assert text.count('_op: "KRMSNormCPU"') == 2 and text.count('_op: "KRouterCPU"') == 2
    assert OURS != REFERENCE and "CPU\"" not in REFERENCE.replace('"KLinearCPUInfer"', "").replace('"KExpertsCPU"', "")


def test_cpu_ops_match_reference_ops_teacher_forced(tmp_path, monkeypatch):
    calls = {"gdn": 0, "attn": 0, "norm": 0, "route": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(layers_cpu, "gdn_decode", counted("gdn", layers_cpu.gdn_decode))
    monkeypatch.setattr(layers_cpu, "attn_decode", counted("attn", layers_cpu.attn_decode))
    monkeypatch.setattr(layers_cpu.cpu_layers, "rms_norm", counted("norm", layers_cpu.cpu_layers.rms_norm))
    monkeypatch.setattr(layers_cpu.cpu_layers, "moe_route", counted("route", layers_cpu.cpu_layers.moe_route))
    ckpt = make_checkpoint(tmp_path, "small", seed=7, **SHAPE)
    ref_model, _ = injected(ckpt, rules(REFERENCE))
    model, _ = injected(ckpt, rules(OURS))
    assert type(model.model.layers[0].linear_attn.op).__name__ == "KGatedDeltaNetCPU"
    assert type(model.model.layers[1].self_attn.op).__name__ == "KAttentionCPU"
    compare_teacher_forced(ref_model, model, torch.device("cpu"), TOL)
    # 3 pure decode steps x 2 layers of each kind went through the kernels; the prefill and mixed steps did not.
    assert calls["gdn"] == 6 and calls["attn"] == 6
    assert calls["norm"] > 0 and calls["route"] > 0
