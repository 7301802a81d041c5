"""KLinearMarlin (the Triton quantized linear on the GGUF blocks, repacked for the GPU) against the float64 product
with gguf-py's dequantized weights: every packed type, float types kept as floats, another type dequantized at load,
and a projection stored as two tensors of different types. Marked `triton`: interpreted on a CPU, where the tests
let the op run on the CPU (rules place it on CUDA only).

Tolerance: relative Frobenius error 2e-5 with fp32 activations at M <= 4 (fp32 products), 1e-2 at M = 20 (bf16
activations inside the tensor-core dot); the float types are F.linear's exact result.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ktrans.config import ModelConfig  # noqa: E402
from ktrans.model.tiny import preset_config  # noqa: E402
from ktrans.operators.linear import LINEAR_OPS, KTransformersLinear  # noqa: E402
from ktrans.weights import quants as Q  # noqa: E402
from ktrans.weights.source import RawTensor, StateDictSource  # noqa: E402
from tests.kernels.test_quant_layout import random_blocks  # noqa: E402

pytestmark = pytest.mark.triton
KEY = "model.layers.0.linear_attn.in_proj_qkvz"
N_OUT = 37


@pytest.fixture
def on_cpu(monkeypatch, triton_device):
    """Let the op be placed on the test's device (the CPU runs it interpreted)."""
    import ktrans.operators.linear_marlin  # noqa: F401  registers the op

    monkeypatch.setattr(LINEAR_OPS.info("KLinearMarlin"), "devices", ("cuda", "cpu"))
    return triton_device


class PartsSource(StateDictSource):
    """A source whose one weight is stored as `parts` (RawTensors) whose concatenated rows, taken in `order`, are
    HF's rows."""

    def __init__(self, parts: list[RawTensor], order: torch.Tensor | None = None):
        super().__init__({})
        self.parts, self.order = parts, order

    def get_raw(self, name):
        assert len(self.parts) == 1, "a split tensor of two types is read through get_raw_parts"
        return self.parts[0]

    def get_raw_parts(self, name):
        return self.parts, self.order


def _raw(qtype: str, n: int, k: int, seed: int) -> tuple[RawTensor, torch.Tensor]:
    if qtype == "BF16":
        w = torch.randn(n, k).to(torch.bfloat16)
        return RawTensor("w", 30, (n, k), w.view(torch.uint8)), w.double()
    raw = random_blocks(qtype, n, k, seed) if qtype in ("Q4_K", "Q5_K", "Q6_K", "Q8_0") else \
        Q.quantize(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32), qtype)
    deq = torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType[qtype])).double()
    return RawTensor("w", Q.quant_type(qtype).id, (n, k), torch.from_numpy(raw)), deq


def _linear(source, n_in: int, device, dtype=torch.float32) -> KTransformersLinear:
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    lin = KTransformersLinear(KEY, nn.Linear(n_in, N_OUT, bias=False, device="meta"), config,
                              generate_device=str(device), prefill_device=str(device),
                              generate_op="VLinearMarlin", prefill_op="KLinearMarlin")
    lin.build_ops()
    lin.load(source, dtype)
    return lin


def _err(y, ref) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "BF16"])
def test_every_type_against_the_dequantized_reference(qtype, on_cpu):
    n_in = 512
    raw, deq = _raw(qtype, N_OUT, n_in, 3)
    lin = _linear(PartsSource([raw]), n_in, on_cpu)
    assert (lin.op.parts[0].packed is not None) == (qtype != "BF16")  # the blocks, not floats
    x = torch.randn(3, n_in, device=on_cpu)
    y = lin(x)
    assert y.shape == (3, N_OUT) and y.dtype == torch.float32
    assert _err(y, x.double().cpu() @ deq.T) < (1e-6 if qtype == "BF16" else 2e-5), qtype
    xb = torch.randn(20, n_in, device=on_cpu).to(torch.bfloat16)
    assert _err(lin(xb), xb.double().cpu() @ deq.T) < 1e-2


def test_other_types_are_dequantized_at_load(on_cpu, caplog):
    raw, deq = _raw("Q5_0", N_OUT, 96, 4)
    with caplog.at_level("WARNING"):
        lin = _linear(PartsSource([raw]), 96, on_cpu)
    assert "dequantizing it to float32" in caplog.text and lin.op.parts[0].packed is None
    x = torch.randn(2, 96, device=on_cpu)
    assert _err(lin(x), x.double().cpu() @ deq.T) < 1e-6


def test_two_stored_tensors_of_different_types(on_cpu):
    """in_proj_qkvz as attn_qkv (Q6_K) + attn_gate (Q4_K): two matrices, outputs put into HF's row order."""
    n_in = 256
    (a, da), (b, db) = _raw("Q6_K", 21, n_in, 5), _raw("Q4_K", N_OUT - 21, n_in, 6)
    order = torch.randperm(N_OUT)
    lin = _linear(PartsSource([a, b], order), n_in, on_cpu)
    assert [p.qtype for p in lin.op.parts] == ["Q6_K", "Q4_K"]
    w = torch.cat([da, db])[order]
    x = torch.randn(4, n_in, device=on_cpu)
    assert _err(lin(x), x.double().cpu() @ w.T) < 2e-5
