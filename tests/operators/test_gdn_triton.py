"""KGatedDeltaNetTriton in a whole (small) model against KGatedDeltaNetTorch: the same checkpoint, the same
schedule, the same device; only the DeltaNet op differs.

Teacher-forced: both models are fed the same tokens through chunked prefill, a mixed step (one sequence decoding
while two prefill), and pure decode steps; the logits of every step are compared. Marked `triton`: compiled on
CUDA, interpreted on the CPU (a 3-layer model with two DeltaNet layers keeps that under ~15 s).
"""
from __future__ import annotations

import pytest
import torch

from ktrans.config import RULES_DIR
from ktrans.operators.gdn import GDN_OPS
from ktrans.runtime.pools import KVPool, StatePool

from ..inject.helpers import injected, rules
from .helpers import compare_teacher_forced
from ..model.helpers import OTHER_SHAPE, make_checkpoint

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

# fp32 models on one device: the kernels sum in other orders than torch (ulps per op), and the logits pass
# through 3 layers; a wrong head, gate or state would be off by O(1).
TOL = 1e-4
# Two DeltaNet layers around a full-attention one, a value-head group of 2, Dk=20 and Dv=12 (not powers of two),
# conv width 3.
SHAPE = {**OTHER_SHAPE, "num_hidden_layers": 3, "mlp_only_layers": [1], "linear_num_value_heads": 6,
         "layer_types": ["linear_attention", "full_attention", "linear_attention"]}


def default_rules(op: str):
    text = (RULES_DIR / "Qwen3Next-default.yaml").read_text()
    return rules(text.replace('"KGatedDeltaNetTorch"', f'"{op}"'), op)


def matches_torch_op(tmp_path, device, op: str, tol: float = TOL) -> None:
    """The SHAPE model with `op` against the same checkpoint with KGatedDeltaNetTorch, teacher-forced."""
    assert GDN_OPS.built(op)
    ckpt = make_checkpoint(tmp_path, "small", seed=5, **SHAPE)
    torch_model, _ = injected(ckpt, default_rules("KGatedDeltaNetTorch"), default_device=str(device))
    model, _ = injected(ckpt, default_rules(op), default_device=str(device))
    assert type(model.model.layers[0].linear_attn.op).__name__ == op
    compare_teacher_forced(torch_model, model, device, tol)


def test_triton_op_matches_torch_op(tmp_path, triton_device):
    matches_torch_op(tmp_path, triton_device, "KGatedDeltaNetTriton")


# bf16 logits of the `small` model (|logits| up to ~5). Twice the CUDA-graph tests' bound (same kernels, other
# shapes): here the ops differ too, the Triton one multiplying bf16 on the tensor cores in prefill and keeping the
# decode conv in fp32, about 1% of a DeltaNet output; a wrong state or gate moves logits by O(1).
GPU_TOL = 0.15


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["KGatedDeltaNetTriton", "KGatedDeltaNetFLA"])
def test_triton_op_in_cuda_graphs_matches_torch_op(op):
    """The gpu placement in bf16 with the Triton op (or fla-core's decode, KGatedDeltaNetFLA), decode replayed from
    CUDA graphs (3 sequences in the 4-row bucket: one pad row on the pad slot), against the same placement with the
    torch op run eagerly; teacher-forced for 64 steps (the torch model's greedy tokens fed to both)."""
    if op == "KGatedDeltaNetFLA":
        pytest.importorskip("fla.ops.gated_delta_rule")
    from ktrans.config import ModelConfig
    from ktrans.inject import build_injected_model
    from ktrans.model.tiny import preset_config, random_state_dict
    from ktrans.weights.source import StateDictSource

    from ..engine.test_graphs import _model_runner, decode_teacher_forced

    config = ModelConfig.from_hf_dict(preset_config("small"), source="small")
    text = (RULES_DIR / "Qwen3Next-gpu.yaml").read_text()
    line = 'class: KQwen3NextGatedDeltaNet\n    kwargs: {generate_device: "cuda", prefill_device: "cuda"'
    assert line in text
    weights = random_state_dict(config, 3)
    models = [build_injected_model(config, rules(text.replace(line, f'{line}, prefill_op: "{name}", '
                                                              f'generate_op: "{name}"'), name),
                                   StateDictSource(weights), torch.bfloat16)[0]
              for name in ("KGatedDeltaNetTorch", op)]
    # a 70-token prompt in one step, then 64 decode steps: 134 tokens, 5 pages of 32
    runners = [_model_runner(m, graphs=g, max_num_tokens=128, max_pages_per_seq=5)
               for m, g in zip(models, (False, True))]
    prompts = [list(range(3, 14)), list(range(40, 110)), list(range(7, 30))]  # 70 tokens: past one chunk
    pages = [[5 * i + j for j in range(5)] for i in range(3)]
    decode_teacher_forced(runners, prompts, pages, GPU_TOL, "torch op")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_decode_step_never_syncs():
    """As tests/engine/test_no_host_sync.py checks the reference ops: a planned decode step with the Triton op reads
    nothing back from the device and makes no synchronising runtime call."""
    from ktrans.config import ModelConfig
    from ktrans.engine.runner import ModelRunner
    from ktrans.inject import build_injected_model, pool_devices
    from ktrans.model.tiny import preset_config, random_state_dict
    from ktrans.weights.source import StateDictSource

    from ..engine.test_no_host_sync import _SYNC_RUNTIME, _decode_step, _profile

    config = ModelConfig.from_hf_dict(preset_config("small"), source="small")
    text = (RULES_DIR / "Qwen3Next-gpu.yaml").read_text()
    line = 'class: KQwen3NextGatedDeltaNet\n    kwargs: {generate_device: "cuda", prefill_device: "cuda"'
    text = text.replace(line, f'{line}, prefill_op: "KGatedDeltaNetTriton", generate_op: "KGatedDeltaNetTriton"')
    model, _ = build_injected_model(config, rules(text), StateDictSource(random_state_dict(config, 3)), torch.bfloat16)
    kv_dev, state_dev = pool_devices(model)
    runner = ModelRunner(model, KVPool(config, 32, 16, torch.bfloat16, kv_dev),
                         StatePool(config, 4, torch.bfloat16, state_dev), max_num_seqs=4, max_num_tokens=64,
                         max_pages_per_seq=8)
    batch = _decode_step(runner)
    logits, seen, device, calls = _profile(runner, batch)
    assert logits.is_cuda and seen == [], sorted(set(seen))
    assert not [e for e in device if "DtoH" in e] and not [e for e in calls if e in _SYNC_RUNTIME]
