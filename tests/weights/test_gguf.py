"""GGUF files written from an HF directory load to the same model: both DeltaNet layouts, split files, older and
newer metadata, fused experts, tied embeddings, multi-token-prediction blocks; raw expert blocks; gguf-py agrees."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ktrans.config import FULL_ATTENTION
from ktrans.model.tiny import random_state_dict
from ktrans.weights.gguf import GGUFModelFile
from ktrans.weights.gguf_source import GGUFSource
from ktrans.weights.gguf_writer import split_gguf, write_gguf
from ktrans.model.convert import convert_hf_dir
from ktrans.inject import load_model
from ktrans.model.source import ModelSource
from ktrans.weights.quants import dequantize_torch
from ktrans.weights.safetensors_mmap import SafetensorsCheckpoint

from ..model.helpers import OTHER_SHAPE, load, make_checkpoint, run_chunks

LAYOUTS = {"split": False, "legacy": True}
ZERO_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf"), "small", seed=1)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return load(hf_dir)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def gguf_file(request, hf_dir, tmp_path_factory):
    return convert_hf_dir(hf_dir, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", "f32",
                          legacy_ssm_in=LAYOUTS[request.param])


def load_gguf(path, dtype=torch.float32):
    return load_model(ModelSource(gguf_path=str(path)), dtype, show_progress=False)[0]


def assert_same_params(a, b):
    """Bit-identical, except what the GGUF stores transformed: 1 + w for zero-centred norms (w comes back within
    one float32 ulp of 1) and -exp(A_log) (A_log within a few ulp)."""
    pb = dict(b.named_parameters())
    assert set(pb) == {n for n, _ in a.named_parameters()}
    for op_name, p in a.named_parameters():
        q, name = pb[op_name], op_name.replace(".op.", ".")  # the HF name: the default rules' ops hold the weights
        assert p.shape == q.shape and p.dtype == q.dtype, name
        if name.endswith(ZERO_CENTRED):
            assert (p - q).abs().max() <= 2.0**-23, name
        elif name.endswith("A_log"):
            torch.testing.assert_close(p, q, rtol=4e-7, atol=0, msg=name)
        else:
            assert torch.equal(p, q), name


def state_of(hf_dir) -> dict[str, torch.Tensor]:
    ckpt = SafetensorsCheckpoint(hf_dir)
    return {k: ckpt.get(k) for k in ckpt.keys()}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (19, 7, 33)]


def assert_same_logits(a, b):
    ps = prompts(a.config.vocab_size)
    la, lb = run_chunks(a, ps)[0], run_chunks(b, ps, chunk_plans=[[10, 9], [7], [1, 32]])[0]
    for x, y in zip(la, lb):
        assert x.abs().max() > 1.0, "flat logits test nothing"
        torch.testing.assert_close(y, x, rtol=0, atol=1e-4)  # the norms' 1-ulp rounding; |logits| reach ~15


def test_f32_gguf_loads_the_hf_parameters(gguf_file, hf_model):
    assert_same_params(hf_model, load_gguf(gguf_file))


def test_f32_gguf_gives_the_hf_logits(gguf_file, hf_model):
    assert_same_logits(hf_model, load_gguf(gguf_file))


def test_layouts_hold_the_tensors_llama_cpp_names(gguf_file):
    names = set(GGUFModelFile(gguf_file).tensors)
    legacy = gguf_file.stem == "legacy"
    assert ("blk.0.ssm_in.weight" in names) == legacy
    assert ("blk.0.attn_qkv.weight" in names) == (not legacy) == ("blk.0.attn_gate.weight" in names)
    for n in ("token_embd.weight", "output_norm.weight", "output.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias",
              "blk.0.ssm_conv1d.weight", "blk.0.ssm_ba.weight", "blk.0.ssm_norm.weight", "blk.0.ssm_out.weight",
              "blk.0.post_attention_norm.weight", "blk.3.attn_q.weight", "blk.3.attn_q_norm.weight",
              "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight",
              "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_up_shexp.weight"):
        assert n in names, n


def test_stored_transforms_match_the_converter(gguf_file, hf_dir):
    """The bytes on disk are what llama.cpp's converter writes: -exp(A_log), 1 + w, squeezed conv, [q|k|v] rows."""
    f, hf = GGUFModelFile(gguf_file), SafetensorsCheckpoint(hf_dir)
    raw = lambda n: f.raw(n).view(np.float32).reshape(f.info(n).shape)  # noqa: E731
    a_log = hf.get("model.layers.0.linear_attn.A_log").numpy()
    np.testing.assert_array_equal(raw("blk.0.ssm_a"), -np.exp(a_log))
    norm = hf.get("model.layers.0.input_layernorm.weight").numpy()
    np.testing.assert_array_equal(raw("blk.0.attn_norm.weight"), norm + np.float32(1))
    np.testing.assert_array_equal(raw("blk.0.ssm_norm.weight"), hf.get("model.layers.0.linear_attn.norm.weight"))
    assert f.info("blk.0.ssm_conv1d.weight").shape == (hf.shape("model.layers.0.linear_attn.conv1d.weight")[0], 4)
    if gguf_file.stem == "split":  # q of key head 1 starts right after q of key head 0 in attn_qkv
        cfg = GGUFSource(gguf_file).config
        qkvz = hf.get("model.layers.0.linear_attn.in_proj_qkvz.weight").numpy()
        dk, group = cfg.linear_key_head_dim, qkvz.shape[0] // cfg.linear_num_key_heads
        np.testing.assert_array_equal(raw("blk.0.attn_qkv.weight")[dk:2 * dk], qkvz[group:group + dk])


def test_gguf_py_reads_our_file_the_same(gguf_file):
    gguf = pytest.importorskip("gguf")
    ref, ours = gguf.GGUFReader(str(gguf_file)), GGUFModelFile(gguf_file)
    assert {t.name for t in ref.tensors} == set(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(x) for x in reversed(t.shape)) and info.ggml_type == int(t.tensor_type)
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), ours.raw(t.name).reshape(-1)), t.name
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            v = field.contents()
            assert ours.metadata[key] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v), key


def test_we_read_what_gguf_py_writes(tmp_path):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "qwen3next")
    w.add_uint32("qwen3next.block_count", 3)
    w.add_float32("qwen3next.rope.freq_base", 1e7)
    w.add_token_list(["a", "b c", "中"])
    w.add_array("qwen3next.attention.recurrent_layers", [True, False, True])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    data = np.arange(64, dtype=np.float32).reshape(2, 32)
    w.add_tensor("blk.0.attn_norm.weight", data[0])
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("w", gguf.quants.quantize(data, q8), raw_dtype=q8)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    f = GGUFModelFile(tmp_path / "x.gguf")
    assert f.metadata["qwen3next.block_count"] == 3 and f.metadata["qwen3next.rope.freq_base"] == 1e7
    assert f.metadata["tokenizer.ggml.tokens"] == ["a", "b c", "中"]
    assert f.metadata["qwen3next.attention.recurrent_layers"] == [True, False, True]
    assert f.metadata["tokenizer.ggml.add_bos_token"] is False
    np.testing.assert_array_equal(f.raw("blk.0.attn_norm.weight").view(np.float32), data[0])
    assert f.info("w").shape == (2, 32) and f.info("w").type_name == "Q8_0"


def test_split_file_loads_from_first_shard(hf_dir, hf_model, tmp_path):
    whole = convert_hf_dir(hf_dir, tmp_path / "m.gguf", "f32")
    shards = split_gguf(whole, 3)
    assert [s.name for s in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert_same_params(hf_model, load_gguf(shards[0]))


def test_other_shape_round_trips(tmp_path):
    """Attention first, irregular layer types (-> attention.recurrent_layers), a dense MLP layer, conv kernel 3,
    value heads == key heads, top-1 routing without renormalisation, tied embeddings."""
    hf_dir = make_checkpoint(tmp_path / "hf", "small", seed=4, **OTHER_SHAPE, tie_word_embeddings=True)
    path = convert_hf_dir(hf_dir, tmp_path / "o.gguf", "f32")
    meta = GGUFModelFile(path).metadata
    assert "qwen3next.attention.recurrent_layers" in meta and "output.weight" not in GGUFModelFile(path).tensors
    ref, got = load(hf_dir), load_gguf(path)
    assert got.config == ref.config
    assert_same_params(ref, got)
    assert_same_logits(ref, got)


def test_older_files_and_fused_experts(hf_dir, hf_model, tmp_path):
    """No full_attention_interval key (llama.cpp then uses 4), F16 routers, fused ffn_gate_up_exps."""
    path = write_gguf(tmp_path / "old.gguf", hf_model.config, state_of(hf_dir), "f32",
                      fused_gate_up=True, router_type="F16", drop_metadata=("qwen3next.full_attention_interval",))
    f = GGUFModelFile(path)
    assert "qwen3next.full_attention_interval" not in f.metadata
    assert f.info("blk.0.ffn_gate_up_exps.weight").shape == (32, 2 * 48, 128)
    assert f.info("blk.0.ffn_gate_inp.weight").type_name == "F16"
    got = load_gguf(path)
    assert got.config == hf_model.config
    for (name, p), q in zip(hf_model.named_parameters(), got.parameters()):
        if name.replace(".op.", ".").endswith("mlp.gate.weight"):
            torch.testing.assert_close(q, p.half().float(), rtol=0, atol=0)
        elif "experts." in name:
            assert torch.equal(p, q), name


def test_mtp_blocks_after_the_trunk_are_skipped(hf_dir, hf_model, tmp_path):
    n = hf_model.config.num_hidden_layers
    path = write_gguf(tmp_path / "mtp.gguf", hf_model.config, state_of(hf_dir), "f32",
                      extra_metadata={"qwen3next.block_count": n + 1, "qwen3next.nextn_predict_layers": 1},
                      extra_tensors={f"blk.{n}.nextn.eh_proj.weight": np.zeros((128, 256), np.float32),
                                     f"blk.{n}.attn_norm.weight": np.ones(128, np.float32)})
    got = load_gguf(path)
    assert got.config.num_hidden_layers == n
    assert_same_params(hf_model, got)


def test_raw_experts_are_views_of_the_file(tmp_path):
    cfg_over = dict(hidden_size=64, moe_intermediate_size=64)
    hf_dir = make_checkpoint(tmp_path / "hf", "small", seed=2, **cfg_over)
    for fused in (False, True):
        path = write_gguf(tmp_path / f"q{fused}.gguf", load(hf_dir).config, state_of(hf_dir), "q8_0",
                          fused_gate_up=fused)
        src = GGUFSource(path)
        for kind, rows in (("gate", 64), ("up", 64), ("down", 64)):
            raw = src.get_raw_experts(2, kind)
            assert raw.type_name == "Q8_0" and raw.shape == (32, rows, 64)
            assert raw.data.dtype == torch.uint8 and tuple(raw.data.shape) == (32, rows, 64 // 32 * 34)
            assert not raw.data.untyped_storage().resizable()  # the mapped file, not a copy
            e5 = dequantize_torch(raw.data[5].contiguous(), raw.ggml_type, (rows, 64))
            assert torch.equal(e5, src.get(f"model.layers.2.mlp.experts.5.{kind}_proj.weight"))
        assert torch.equal(src.load_experts(2, "down", native_types={"Q8_0"}).data, src.get_raw_experts(2, "down").data)


def test_random_preset_writes_without_a_checkpoint(tmp_path):
    """make-tiny's path: a preset's random state straight to GGUF; bf16 reads as zero-copy views."""
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import SMALL_OVERRIDES, preset_config

    d = {**preset_config("tiny"), **SMALL_OVERRIDES, "vocab_size": 256}
    cfg = ModelConfig.from_hf_dict(d)
    path = write_gguf(tmp_path / "b.gguf", cfg, random_state_dict(cfg, 0), "bf16")
    model = load_gguf(path, torch.bfloat16)
    w = model.model.layers[0].mlp.experts.op.w["up_proj"][1]
    stored = GGUFSource(path).get("model.layers.0.mlp.experts.1.up_proj.weight", torch.bfloat16)
    assert w.dtype == torch.bfloat16 and torch.equal(w, stored) and not stored.untyped_storage().resizable()
    assert [t == FULL_ATTENTION for t in model.config.layer_types].count(True) == 2


def test_real_80b_metadata_gives_the_hf_config():
    """Keys as Qwen's Qwen3-Next-80B-A3B GGUFs carry them (no vocab_size / expert_weights_norm), in the older form
    and in the newer one with a multi-token-prediction block and attention.recurrent_layers."""
    from ktrans.config import CONFIGS_DIR, ModelConfig
    from ktrans.weights.gguf import TensorInfo
    from ktrans.weights.gguf_source import config_from_gguf
    from ktrans.weights.gguf_writer import model_metadata

    hf = ModelConfig.from_json(CONFIGS_DIR / "qwen3-next-80b-a3b.json")
    meta = model_metadata(hf, "q4_k_m")
    for k in ("qwen3next.vocab_size", "qwen3next.expert_weights_norm"):
        meta.pop(k)
    meta.update({"tokenizer.ggml.bos_token_id": 151643, "tokenizer.ggml.eos_token_id": 151645})
    info = TensorInfo("x", (151936, 2048), 12, 0, 0, None)
    tensors = {"token_embd.weight": info, "output.weight": info, **{f"blk.{i}.ffn_gate_inp.weight": info
                                                                   for i in range(49)}}
    assert config_from_gguf(meta, tensors, "old") == hf
    meta.pop("qwen3next.full_attention_interval")
    meta.update({"qwen3next.block_count": 49, "qwen3next.nextn_predict_layers": 1,
                 "qwen3next.attention.recurrent_layers": [(i + 1) % 4 != 0 for i in range(48)] + [False]})
    assert config_from_gguf(meta, tensors, "new") == hf


def test_fused_attention_qkv_loads_the_same(gguf_file, hf_model, tmp_path):
    """llama.cpp also accepts one attn_qkv tensor ([q_proj rows | k | v]) in full-attention layers."""
    from ktrans.weights.gguf_writer import GGUFWriter, Typed

    src = GGUFModelFile(gguf_file)
    w = GGUFWriter(tmp_path / "fused.gguf")
    types = src.files[0].value_types
    w.metadata.update({k: v if types[k] == 9 else Typed(types[k], v) for k, v in src.metadata.items()})
    for name, info in src.tensors.items():
        if name.endswith((".attn_k.weight", ".attn_v.weight")):
            continue
        if name.endswith(".attn_q.weight"):
            parts = [src.raw(name.replace("attn_q", p)) for p in ("attn_q", "attn_k", "attn_v")]
            fused = np.concatenate(parts)
            w.add_tensor(name.replace("attn_q", "attn_qkv"), (fused.shape[0], info.shape[1]), "F32", lambda f=fused: f)
        else:
            w.add_tensor(name, info.shape, info.ggml_type, lambda n=name: src.raw(n))
    assert_same_params(hf_model, load_gguf(w.write()))
