"""Quantized GGUF models: llama.cpp's type mix, logits close to F32 for Q8_0, sane greedy output for Q4_K_M.

The test model is the `small` preset with every row length a multiple of 256, so Q4_K and Q6_K are really used
(llama.cpp falls back to Q5_0 / Q8_0 for shorter rows). Random-weight models amplify weight noise: Gaussian noise
of 0.17% (bf16's rounding) on every matrix already moves the logits by ~2% (relative L2), so the bounds below are
set against that, not against a trained model's robustness.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ktrans.weights.gguf import GGUFModelFile
from ktrans.weights.gguf_source import GGUFSource
from ktrans.weights.gguf_writer import choose_types, tensor_census
from ktrans.model.convert import convert_hf_dir
from ktrans.inject import load_model
from ktrans.model.source import ModelSource

from ..model.helpers import generate, load, make_checkpoint, run_chunks

ALIGNED = dict(hidden_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
               linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
               shared_expert_intermediate_size=256)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf"), "small", seed=2, **ALIGNED)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (24,), generator=g).tolist() for _ in range(4)]


@pytest.fixture(scope="module")
def f32_logits(hf_dir, prompts):
    return torch.cat(run_chunks(load(hf_dir), prompts)[0])


@pytest.fixture(scope="module")
def quantized(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("q")
    return {q: convert_hf_dir(hf_dir, out / f"{q}.gguf", q) for q in ("q8_0", "q4_k_m")}


def load_gguf(path):
    return load_model(ModelSource(gguf_path=str(path)), torch.float32, show_progress=False)[0]


def drift(logits, ref):
    rel = ((logits - ref).norm() / ref.norm()).item()
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return rel, agree


def test_q8_0_logits_stay_close_to_f32(quantized, prompts, f32_logits):
    census = tensor_census(quantized["q8_0"])
    assert set(census.values()) == {"Q8_0", "F32"}
    assert census["blk.0.ffn_gate_inp.weight"] == census["blk.0.attn_norm.weight"] == census["blk.0.ssm_a"] == "F32"
    logits = torch.cat(run_chunks(load_gguf(quantized["q8_0"]), prompts)[0])
    rel, agree = drift(logits, f32_logits)
    # metric: relative L2 error of all logits, ||q8 - f32|| / ||f32|| (measured 0.06), and top-1 agreement
    # (measured 0.92) over 96 positions
    assert rel < 0.10 and agree >= 0.85, (rel, agree)


def test_q4_k_m_mixes_types_as_llama_quantize(quantized):
    t = tensor_census(quantized["q4_k_m"])
    assert t["output.weight"] == "Q6_K" and t["token_embd.weight"] == "Q4_K"
    assert t["blk.0.ffn_gate_inp.weight"] == "F32" and t["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
    assert {t[n] for n in t if n.endswith(("_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight"))} == {"F32"}
    more_bits = {0, 3, 6, 7}  # use_more_bits(i, 8): first and last eighth, and every third layer between
    for i in range(8):
        want = "Q6_K" if i in more_bits else "Q4_K"
        assert t[f"blk.{i}.ffn_down_exps.weight"] == t[f"blk.{i}.ffn_down_shexp.weight"] == want, i
        # this model has 8 experts: llama-quantize gives its attn_v / attn_qkv Q8_0 (and attn_output Q5_K)
        assert t.get(f"blk.{i}.attn_v.weight", t.get(f"blk.{i}.attn_qkv.weight")) == "Q8_0", i
        assert t[f"blk.{i}.ffn_gate_exps.weight"] == t[f"blk.{i}.ffn_up_exps.weight"] == "Q4_K"
    assert t["blk.0.attn_gate.weight"] == t["blk.0.ssm_ba.weight"] == t["blk.3.attn_q.weight"] == "Q4_K"
    assert t["blk.3.attn_output.weight"] == "Q5_K" and t["blk.3.attn_k.weight"] == "Q8_0"


def test_q4_k_m_decodes_as_gguf_py_does(quantized):
    gguf_quants = pytest.importorskip("gguf.quants")
    f, src = GGUFModelFile(quantized["q4_k_m"]), GGUFSource(quantized["q4_k_m"])
    for gname, hf_name in (("blk.1.ffn_down_exps.weight", "model.layers.1.mlp.experts.6.down_proj.weight"),
                           ("blk.0.ffn_down_exps.weight", "model.layers.0.mlp.experts.6.down_proj.weight"),
                           ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight")):
        info = f.info(gname)
        ref = gguf_quants.dequantize(f.raw(gname), info.ggml_type)
        if "exps" in gname:
            ref = ref[6]
        np.testing.assert_array_equal(src.get(hf_name).numpy(), ref)


def test_q4_k_m_greedy_output_is_sane(quantized, hf_dir, prompts, f32_logits):
    model = load_gguf(quantized["q4_k_m"])
    logits = torch.cat(run_chunks(model, prompts)[0])
    assert torch.isfinite(logits).all()
    rel, agree = drift(logits, f32_logits)
    assert agree >= 0.4, (rel, agree)  # measured 0.57 (chance: 1/512); relative L2 error measured 0.30
    out = generate(model, prompts[0][:8], 32).token_ids
    assert len(out) == 32 and len(set(out)) > 4, out


def test_short_rows_fall_back_as_llama_cpp():
    shapes = [("token_embd.weight", (512, 128)), ("output.weight", (512, 128)), ("blk.0.attn_qkv.weight", (256, 128)),
              ("blk.0.ffn_down_exps.weight", (8, 128, 64)), ("blk.7.ffn_down_exps.weight", (8, 128, 48)),
              ("blk.0.ffn_gate_exps.weight", (8, 48, 128))]
    got = choose_types(shapes, "q4_k_m", n_layers=8)
    # Q4_K -> Q5_0 and Q6_K -> Q8_0 when a row is not a multiple of 256; F16 when not even of 32
    assert got == {"token_embd.weight": "Q5_0", "output.weight": "Q8_0", "blk.0.attn_qkv.weight": "Q8_0",
                   "blk.0.ffn_down_exps.weight": "Q8_0", "blk.7.ffn_down_exps.weight": "F16",
                   "blk.0.ffn_gate_exps.weight": "Q5_0"}
    assert choose_types(shapes[3:5], "q8_0", 8) == {"blk.0.ffn_down_exps.weight": "Q8_0",
                                                    "blk.7.ffn_down_exps.weight": "F16"}
    # tied embeddings take the output rule, whose Q6_K falls back to Q8_0, then to F16
    assert choose_types([("token_embd.weight", (512, 48))], "q4_k_m", 8) == {"token_embd.weight": "F16"}


def test_eight_experts_bump_attention_as_llama_quantize():
    """llama-quantize gives an 8-expert model Q8_0 attn_v/attn_qkv and attn_k, Q5_K attn_output (checked against
    its output on a 48-layer qwen3next file)."""
    shapes = [("blk.0.attn_qkv.weight", (512, 256)), ("blk.3.attn_v.weight", (256, 256)),
              ("blk.3.attn_k.weight", (256, 256)), ("blk.3.attn_output.weight", (256, 512)),
              ("blk.3.attn_q.weight", (512, 256))]
    for n_experts, want in ((8, ["Q8_0", "Q8_0", "Q8_0", "Q5_K", "Q4_K"]), (16, ["Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K"])):
        exps = [("blk.0.ffn_gate_exps.weight", (n_experts, 256, 256))]
        got = choose_types(shapes + exps, "q4_k_m", n_layers=4)
        assert [got[n] for n, _ in shapes] == want, n_experts
