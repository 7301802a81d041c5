"""KLinearCPUInfer (the C++ quantized linear as an op) against the torch reference on gguf-py's dequantized weights,
for every GGUF type it reads and one it dequantizes at load; and the CPU-only model with it against the same rules
with KLinearTorch, on a tiny Q4_K_M GGUF."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ktrans.config import RULES_DIR, ModelConfig  # noqa: E402
from ktrans.inject import build_injected_model, parse_rules  # noqa: E402
from ktrans.model.tiny import preset_config, random_state_dict  # noqa: E402
from ktrans.operators.linear import LINEAR_OPS, KTransformersLinear  # noqa: E402
from ktrans.weights import quants as Q  # noqa: E402
from ktrans.weights.gguf_source import GGUFSource  # noqa: E402
from ktrans.weights.gguf_writer import write_gguf  # noqa: E402
from ktrans.weights.source import RawTensor, StateDictSource  # noqa: E402

# relative error ||y - ref|| / ||ref||: int8 activations for the integer formats, exact products for the floats
BOUND = {"Q8_0": 0.01, "Q4_0": 0.01, "Q4_1": 0.01, "Q5_0": 0.01, "Q5_1": 0.01, "Q4_K": 0.01, "Q5_K": 0.01,
         "Q6_K": 0.01, "BF16": 1e-5, "F16": 1e-5, "F32": 1e-5}
_FLOAT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
N_OUT = 37  # no row block divides it


class RawSource(StateDictSource):
    """A source whose one weight is stored in `qtype` (what a GGUF file hands the op)."""

    def __init__(self, name: str, raw: torch.Tensor, qtype: str, shape, bias: torch.Tensor | None):
        super().__init__({} if bias is None else {name.removesuffix("weight") + "bias": bias})
        self.raw = RawTensor(name, Q.quant_type(qtype).id, tuple(shape), raw)

    def get_raw(self, name: str) -> RawTensor:
        return self.raw if name == self.raw.name else super().get_raw(name)


def _weight(qtype: str, n_in: int):
    x = np.random.default_rng(7).standard_normal((N_OUT, n_in)).astype(np.float32)
    if qtype in _FLOAT:
        w = torch.from_numpy(x).to(_FLOAT[qtype])
        return w.view(torch.uint8).reshape(N_OUT, -1), w.double()
    raw = Q.quantize(x, qtype)
    return torch.from_numpy(raw), torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType[qtype])).double()


def _op(qtype: str, n_in: int, bias: bool, dtype=torch.float32):
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    key = "model.layers.0.mlp.shared_expert.up_proj"
    lin = KTransformersLinear(key, nn.Linear(n_in, N_OUT, bias=bias, device="meta"), config,
                              generate_op="KLinearCPUInfer", prefill_op="KLinearCPUInfer")
    lin.build_ops()
    raw, deq = _weight(qtype, n_in)
    b = torch.randn(N_OUT) if bias else None
    lin.load(RawSource(f"{key}.weight", raw, qtype, (N_OUT, n_in), b), dtype)
    return lin, deq, b


@pytest.mark.parametrize("qtype", list(BOUND))
@pytest.mark.parametrize("bias", [False, True])
def test_every_type_against_the_reference(qtype, bias):
    n_in = 512 if qtype.endswith("_K") else (50 if qtype in _FLOAT else 96)
    lin, deq, b = _op(qtype, n_in, bias)
    assert lin.op.qtype == qtype  # read as stored, not dequantized
    for t in (1, 5, 33):
        x = torch.randn(t, n_in, generator=torch.Generator().manual_seed(t))
        ref = x.double() @ deq.T + (b.double() if b is not None else 0)
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (t, N_OUT)
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < BOUND[qtype], (qtype, t, err)


def test_bfloat16_activations_come_back_in_their_dtype():
    lin, deq, _ = _op("Q8_0", 96, False, torch.bfloat16)
    x = torch.randn(3, 96).to(torch.bfloat16)
    y = lin(x)
    ref = x.double() @ deq.T
    assert y.dtype == torch.bfloat16 and float((y.double() - ref).norm() / ref.norm()) < 0.015


def test_an_unread_type_is_dequantized_at_load(caplog):
    """Q2_K (no kernel reads it): random blocks with finite scales, dequantized once to F32, then exact."""
    n_in = 256
    raw = np.random.default_rng(3).integers(0, 256, (N_OUT, 84), dtype=np.uint8)
    raw[:, 80:84] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)  # d, dmin
    deq = torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType.Q2_K)).double()
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    key = "model.layers.0.mlp.shared_expert.up_proj"
    lin = KTransformersLinear(key, nn.Linear(n_in, N_OUT, bias=False, device="meta"), config,
                              generate_op="KLinearCPUInfer", prefill_op="KLinearCPUInfer")
    lin.build_ops()
    with caplog.at_level("WARNING"):
        lin.load(RawSource(f"{key}.weight", torch.from_numpy(raw), "Q2_K", (N_OUT, n_in), None), torch.float32)
    assert lin.op.qtype == "F32" and "dequantizing it to F32" in caplog.text
    x = torch.randn(4, n_in)
    ref = x.double() @ deq.T
    assert float((lin(x).double() - ref).norm() / ref.norm()) < 1e-5


def test_split_qkvz_of_two_types_runs_as_two_quantized_matrices(tmp_path):
    """in_proj_qkvz stored as attn_qkv and attn_gate of different types (tiny Q4_K_M: the Q8_0 / Q5_0 fallbacks in
    some layers) is read as its two stored matrices, not as one float matrix, and its output is HF's rows in order."""
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    src = GGUFSource(write_gguf(tmp_path / "q.gguf", config, random_state_dict(config, 1), "q4_k_m"))
    mixed = 0
    for i in range(config.num_hidden_layers):
        key = f"model.layers.{i}.linear_attn.in_proj_qkvz"
        if f"{key}.weight" not in src:
            continue
        parts, _ = src.get_raw_parts(f"{key}.weight")
        w = src.get(f"{key}.weight").double()
        lin = KTransformersLinear(key, nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"), config,
                                  generate_op="KLinearCPUInfer", prefill_op="KLinearCPUInfer")
        lin.build_ops()
        lin.load(src, torch.float32)
        if parts[0].type_name != parts[1].type_name:
            mixed += 1
            assert lin.op.qtype == f"{parts[0].type_name}+{parts[1].type_name}" and len(lin.op.parts) == 2
        else:
            assert lin.op.qtype == parts[0].type_name and not lin.op.parts
        for t in (1, 7):
            x = torch.randn(t, w.shape[1], generator=torch.Generator().manual_seed(t))
            ref = x.double() @ w.T
            assert float((lin(x).double() - ref).norm() / ref.norm()) < 0.02, (key, t)
    assert mixed > 0


def test_mlp_of_stored_blocks_runs_as_one_cpu_job(tmp_path):
    """Under the CPU rules on a Q4_K_M GGUF, a SwiGLU MLP (here the shared experts) runs as one job of the C++
    experts (a one-expert CPUMoE on the projections' blocks) and gives what its three projections give."""
    import torch.nn.functional as F

    from ktrans.kernels import cpu
    from ktrans.operators.moe import KQwen3NextMLP

    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    source = GGUFSource(write_gguf(tmp_path / "t.gguf", config, random_state_dict(config, seed=5), "q4_k_m"))
    model = build_injected_model(config, parse_rules(CPU_RULES, "test.yaml"), source, torch.float32)[0]
    mlps = [m for m in model.modules() if isinstance(m, KQwen3NextMLP)]
    assert mlps
    for mlp in mlps:
        for t in (1, 9):
            x = torch.randn(t, config.hidden_size, generator=torch.Generator().manual_seed(t))
            y = mlp(x)
            assert isinstance(mlp._fused["prefill"], cpu.CPUMoE)
            ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
            assert float((y - ref).norm() / ref.norm()) < 1e-5


def test_bad_quant_kwarg_names_the_field():
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    lin = KTransformersLinear("lm_head", nn.Linear(8, 4, device="meta"), config, generate_op="KLinearCPUInfer",
                              prefill_op="KLinearCPUInfer", quant="Q3_K")
    with pytest.raises(ValueError, match="lm_head: KLinearCPUInfer quant must be one of"):
        lin.build_ops()


CPU_RULES = (RULES_DIR / "Qwen3Next-cpu.yaml").read_text()
TORCH_RULES = CPU_RULES.replace('"KLinearCPUInfer"', '"KLinearTorch"')
LOGIT_TOL = 0.05  # relative RMS of the tiny model's logits: every projection's int8 activations, four layers deep


def test_shipped_cpu_rules_use_it():
    assert LINEAR_OPS.built("KLinearCPUInfer") and CPU_RULES != TORCH_RULES


def test_cpu_only_model_against_torch_linears_teacher_forced(tmp_path):
    """Q4_K_M blocks: the C++ linears read them, the reference dequantizes them. The reference's greedy tokens are
    fed to both for 64 steps (one forward over prompt + tokens, every position's logits)."""
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    source = GGUFSource(write_gguf(tmp_path / "t.gguf", config, random_state_dict(config, seed=5), "q4_k_m"))
    models = [build_injected_model(config, parse_rules(r, "test.yaml"), source, torch.float32)[0]
              for r in (TORCH_RULES, CPU_RULES)]
    from tests.model.helpers import generate, run_chunks
    from ktrans.engine.sampler import SamplingParams

    prompt = list(range(11, 40))
    tokens = generate(models[0], prompt, 64, SamplingParams(temperature=0.0, ignore_eos=True)).token_ids
    ref, got = (run_chunks(m, [prompt + tokens])[0][0].float() for m in models)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < LOGIT_TOL, rel
    top2 = ref.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_TOL * ref.abs().max()
    assert torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_repacked_rows_equal_the_blocks_as_stored(qtype):
    """The 16-row layout (default where the AVX-512 kernels read it) against the row kernels on the stored blocks:
    bitwise from 3 tokens, within 1e-5 at one (the fused pass folds the sub-block sums in another order)."""
    from ktrans import _cpu

    n_in = 512
    n_out = 48  # repacking needs whole groups of 16 rows
    raw, _ = _weight(qtype, n_in)
    raw = torch.cat([raw, raw[:11]])  # 48 rows
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    key = "model.layers.0.mlp.shared_expert.up_proj"
    ops = []
    for repack in (False, True):
        lin = KTransformersLinear(key, nn.Linear(n_in, n_out, bias=False, device="meta"), config,
                                  generate_op="KLinearCPUInfer", prefill_op="KLinearCPUInfer", repack=repack)
        lin.build_ops()
        lin.load(RawSource(f"{key}.weight", raw, qtype, (n_out, n_in), None), torch.float32)
        ops.append(lin)
    assert ops[0].op.lin.layout == qtype
    assert ops[1].op.lin.layout == (f"{qtype}_X16" if _cpu.reads_x16("auto") else qtype)
    for t in (1, 3, 20):
        x = torch.randn(t, n_in, generator=torch.Generator().manual_seed(t))
        a, b = ops[0](x), ops[1](x)
        if t >= 3:
            assert torch.equal(a, b)
        else:
            assert float((a - b).abs().max() / a.abs().max()) < 1e-5
