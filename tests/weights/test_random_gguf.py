"""Random-weight GGUF files written block by block (`ktrans make-tiny --gguf --preset CONFIG`): the same bytes for
the same seed whatever the number of workers, llama-quantize's type mix as gguf-py reads it, well-formed blocks
whose values have the intended spread, a skewed router that really skews, and a 4-layer slice at the real 80B
shapes that the project loads under the CPU rules and generates from.
"""
from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from ktrans.config import CONFIGS_DIR, ModelConfig
from ktrans.model.tiny import SMALL_OVERRIDES, preset_config
from ktrans.weights.gguf_writer import choose_types, tensor_census
from ktrans.model.random_gguf import plan_tensors, router_row_scales, write_random_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

# the small preset with rows that fill Q4_K/Q6_K blocks, so the k-quants are really written
ALIGNED = dict(SMALL_OVERRIDES, hidden_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
               linear_num_value_heads=4, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256,
               shared_expert_intermediate_size=256, vocab_size=512)


def _config(**kw) -> ModelConfig:
    return ModelConfig.from_hf_dict({**preset_config("tiny"), **ALIGNED, **kw})


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("rg") / "s.gguf", _config(), "q4_k_m", seed=5, workers=2)


def test_same_seed_same_bytes_whatever_the_workers(tmp_path, small_file, monkeypatch):
    import ktrans.model.random_gguf as rg

    monkeypatch.setattr(rg, "UNIT_BYTES", 1 << 14)
    monkeypatch.setattr(rg, "CHUNK_BYTES", 1 << 16)  # many tasks per tensor, so their order really varies
    small = write_random_gguf(tmp_path / "small.gguf", _config(), "q4_k_m", seed=5, workers=2)
    monkeypatch.setattr(rg, "CHUNK_BYTES", 1 << 15)  # other task sizes: the same bytes
    a = write_random_gguf(tmp_path / "a.gguf", _config(), "q4_k_m", seed=5, workers=1)
    b = write_random_gguf(tmp_path / "b.gguf", _config(), "q4_k_m", seed=5, workers=3)
    c = write_random_gguf(tmp_path / "c.gguf", _config(), "q4_k_m", seed=6, workers=3)
    assert _sha(a) == _sha(b) == _sha(small)
    assert _sha(c) != _sha(a)
    assert _sha(a) != _sha(small_file)  # the seeding unit is part of the format
    assert not list(tmp_path.glob("*.part"))


def test_types_are_choose_types_as_gguf_py_reads_them(small_file):
    config = _config()
    reader = gguf.GGUFReader(small_file)
    got = {t.name: t.tensor_type.name for t in reader.tensors}
    plan = plan_tensors(config, "q4_k_m")
    assert got == {t.name: t.qtype for t in plan}
    assert got == choose_types([(t.name, t.shape) for t in plan], "q4_k_m", config.num_hidden_layers)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    assert shapes == {t.name: t.shape for t in plan}
    assert {"Q4_K", "Q6_K", "F32"} <= set(got.values())


def test_real_model_type_mix_is_llama_quantizes():
    """The 48-layer Q4_K_M mix, as llama-quantize (llama.cpp of llama-cpp-python 0.3.36) wrote it for a qwen3next
    file of this layer pattern: attn_v/attn_qkv share one use_more_bits counter over 48 tensors, ffn_down (experts
    and shared) takes the layer from its name over 48 layers."""
    config = ModelConfig.from_json(CONFIGS_DIR / "qwen3-next-80b-a3b.json")
    got = {t.name: t.qtype for t in plan_tensors(config, "q4_k_m")}
    q6 = lambda kind: {i for i in range(48) if got.get(f"blk.{i}.{kind}.weight") == "Q6_K"}  # noqa: E731
    assert q6("attn_qkv") == {0, 1, 2, 4, 5, 8, 14, 17, 20, 26, 29, 32, 38, 41, 42, 44, 45, 46}
    assert q6("attn_v") == {3, 11, 23, 35, 43, 47}
    down = set(range(6)) | set(range(8, 42, 3)) | set(range(42, 48))
    assert q6("ffn_down_exps") == q6("ffn_down_shexp") == down
    others = {n: t for n, t in got.items() if not re.search(r"(attn_qkv|attn_v|ffn_down_\w+|output)\.weight$", n)}
    assert {t for n, t in others.items() if n.endswith("_norm.weight") or "ffn_gate_inp" in n or "ssm_" in n
            and not n.endswith(("ssm_ba.weight", "ssm_out.weight"))} == {"F32"}
    assert {t for n, t in others.items() if t != "F32"} == {"Q4_K"} and got["output.weight"] == "Q6_K"


def test_blocks_decode_to_the_intended_spread(small_file):
    """Every tensor decodes (gguf-py) to finite values with mean ~0 and the float path's std within 15%."""
    by_name = {t.name: t for t in plan_tensors(_config(), "q4_k_m")}
    for t in gguf.GGUFReader(small_file).tensors:
        x = dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(x).all(), t.name
        law = by_name[t.name].law
        if law[0] == "normal":
            std = law[1]
            assert abs(x.std() / std - 1) < 0.15, (t.name, x.std(), std)
            assert abs(x.mean()) < 0.1 * std + 3 * std / np.sqrt(x.size), (t.name, x.mean())
        else:
            lo, hi = sorted((law[1], law[2]) if law[0] == "uniform" else (-law[2], -law[1]))
            assert lo <= x.min() and x.max() <= hi, t.name


def test_q4_k_blocks_are_well_formed(small_file):
    """Q4_K heads: positive fp16 d and dmin, 6-bit scale and min codes in 32..63 (never 0: no dead sub-block)."""
    from ktrans.weights.quants import _k_scale_min

    t = next(t for t in gguf.GGUFReader(small_file).tensors if t.name == "blk.0.ffn_gate_exps.weight")
    blocks = np.asarray(t.data).reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    assert (d > 0).all() and (dmin > 0).all() and np.isfinite(d).all()
    sc, mn = _k_scale_min(blocks[:, 4:16])
    assert sc.min() >= 32 and sc.max() <= 63 and mn.min() >= 32


def test_dense_bf16_keeps_experts_quantized(tmp_path):
    plan = {t.name: t.qtype for t in plan_tensors(_config(), "q4_k_m", dense="bf16")}
    for name, qtype in plan.items():
        if "_exps." in name:
            assert qtype in ("Q4_K", "Q6_K"), name
        elif re.search(r"(attn_qkv|attn_gate|attn_q|ssm_out|_shexp|token_embd|output)\.weight$", name) \
                and "gate_inp" not in name:
            assert qtype == "BF16", name
    with pytest.raises(ValueError, match="q4_k_m"):
        plan_tensors(_config(), "q8_0", dense="bf16")


def test_skewed_router_has_hot_experts(tmp_path):
    """On isotropic hidden states, the busiest n/64 experts of a skewed router take >3x their uniform share of
    the top-k picks; a uniform router's busiest take < 2x."""
    config = _config(num_hidden_layers=4)
    shares = {}
    for router in ("uniform", "skewed"):
        path = write_random_gguf(tmp_path / f"{router}.gguf", config, "q4_k_m", seed=1, router=router, workers=2)
        w = next(dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors
                 if t.name == "blk.1.ffn_gate_inp.weight")
        x = np.random.default_rng(0).standard_normal((8000, config.hidden_size)).astype(np.float32)
        top = np.argpartition(-(x @ w.T), config.num_experts_per_tok, axis=1)[:, :config.num_experts_per_tok]
        counts = np.sort(np.bincount(top.ravel(), minlength=config.num_experts))[::-1]
        n_hot = max(1, config.num_experts // 64)
        shares[router] = counts[:n_hot].sum() / counts.sum() / (n_hot / config.num_experts)
    assert shares["skewed"] > 3.0 and shares["uniform"] < 2.0, shares
    # the same hot experts as the float path's skewed router for that seed and layer
    s = router_row_scales(1, 1, config.num_experts)
    assert (s > 1.5).sum() >= 1


# ---------------------------------------------------------------------------------------------- the real shapes


@pytest.fixture(scope="module")
def real_slice(tmp_path_factory):
    """4 layers at Qwen3-Next-80B-A3B's shapes (3 DeltaNet + 1 attention), Q4_K_M: ~4.4 GB."""
    from ktrans.cli import main

    path = tmp_path_factory.mktemp("real") / "slice.gguf"
    assert main(["make-tiny", "--gguf", "--preset", "qwen3-next-80b-a3b", "--quant", "q4_k_m", "--layers", "4",
                 "--seed", "7", "--out", str(path)]) == 0
    yield path
    path.unlink()


@pytest.mark.slow
def test_real_slice_type_mix(real_slice):
    reader = gguf.GGUFReader(real_slice)
    got = {t.name: t.tensor_type.name for t in reader.tensors}
    d = json.loads((CONFIGS_DIR / "qwen3-next-80b-a3b.json").read_text())
    config = ModelConfig.from_hf_dict({**d, "num_hidden_layers": 4})
    assert got == {t.name: t.qtype for t in plan_tensors(config, "q4_k_m")}
    assert got == tensor_census(real_slice)
    # llama-quantize's Q4_K_M: experts Q4_K, ffn_down at Q6_K in use_more_bits layers (of 4: layers 2 and 3),
    # output Q6_K, the router F32, the shared expert's one-row gate F16
    for i in range(4):
        assert got[f"blk.{i}.ffn_gate_exps.weight"] == got[f"blk.{i}.ffn_up_exps.weight"] == "Q4_K"
        assert got[f"blk.{i}.ffn_down_exps.weight"] == ("Q6_K" if i in (2, 3) else "Q4_K")
        assert got[f"blk.{i}.ffn_gate_inp.weight"] == "F32"
        assert got[f"blk.{i}.ffn_gate_inp_shexp.weight"] == "F32"
    assert got["output.weight"] == "Q6_K" and got["token_embd.weight"] == "Q4_K"
    assert got["blk.3.attn_q.weight"] == "Q4_K" and got["blk.0.ssm_conv1d.weight"] == "F32"
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == (512, 512, 2048)
    assert shapes["blk.0.attn_qkv.weight"] == (8192, 2048) and shapes["output.weight"] == (151936, 2048)
    # what llama.cpp needs to load it: its architecture's keys and the whole vocabulary
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "qwen3next"
    assert len(fields["tokenizer.ggml.tokens"].data) == 151936
    assert "tokenizer.chat_template" in fields


@pytest.mark.slow
def test_real_slice_loads_under_cpu_rules_and_generates(real_slice):
    import torch

    from ktrans.config import RULES_DIR
    from ktrans.engine.sampler import SamplingParams
    from ktrans.inject import load_model
    from ktrans.model.source import ModelSource

    from ..model.helpers import generate

    model, _ = load_model(ModelSource(None, str(real_slice)), torch.float32, rules=RULES_DIR / "Qwen3Next-cpu.yaml",
                          show_progress=False)
    config = model.config
    assert config.num_hidden_layers == 4 and config.num_experts == 512 and config.hidden_size == 2048
    prompt = [9707, 11, 1879, 0, 151644, 77091, 198]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    runs = [generate(model, prompt, 6, greedy) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 6
    assert all(0 <= t < config.vocab_size for t in runs[0].token_ids)
    scored = generate(model, prompt, 0, SamplingParams(temperature=0.0, prompt_logprobs=2))
    lp = [v for e in scored.prompt_logprobs for v in (e.logprob, *e.top.values())]
    assert lp and all(np.isfinite(lp)) and len(set(np.round(lp, 3))) > 1  # finite, and not a flat distribution
