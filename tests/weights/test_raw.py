"""WeightSource.get_raw: every tensor's stored blocks by HF name, on tiny GGUF and safetensors files.

A RawTensor decodes (ggml's own dequantization) to exactly what `get` returns, for every parameter of the model, in
both DeltaNet layouts, with fused gate_up experts, quantized or not; tensors whose stored rows are HF's are views of
the mapped file, not copies."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ktrans.model.source import ModelSource, build_model
from ktrans.model.tiny import random_state_dict
from ktrans.weights.gguf import GGUFError
from ktrans.weights.gguf_source import GGUFSource
from ktrans.weights.gguf_writer import write_gguf
from ktrans.weights.hf import HFWeightSource
from ktrans.weights.quants import dequantize_torch
from ktrans.weights.source import RawTensor, StateDictSource, WeightError

from ..model.helpers import make_checkpoint

# q8_0 wants rows of whole 32-blocks: every matrix of this shape is Q8_0, 1-D tensors stay F32
SHAPE = dict(hidden_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf"), "small", seed=4, **SHAPE)


def decode(raw: RawTensor) -> torch.Tensor:
    rows = raw.data.reshape(-1, raw.data.shape[-1]).contiguous()
    return dequantize_torch(rows, raw.ggml_type, (rows.shape[0], raw.shape[-1])).reshape(raw.shape)


def names(source) -> list[str]:
    return [n for n, _ in build_model(source.config).named_parameters()]


def is_view(t: torch.Tensor) -> bool:
    return not t.untyped_storage().resizable()  # a memory map, not a tensor torch allocated


@pytest.mark.parametrize("quant", ["f32", "q8_0", "bf16"])
@pytest.mark.parametrize("layout", ["split", "legacy", "fused_gate_up"])
def test_every_gguf_tensor_decodes_to_get(hf_dir, tmp_path, quant, layout):
    config = ModelSource(model_path=str(hf_dir)).config()
    state = load_file(str(hf_dir / "model.safetensors"))
    path = write_gguf(tmp_path / "m.gguf", config, state, quant, legacy_ssm_in=layout == "legacy",
                      fused_gate_up=layout == "fused_gate_up")
    src = GGUFSource(path)
    types = set()
    for name in names(src):
        raw = src.get_raw(name)
        ref = src.get(name).float()
        assert raw.name == name and raw.shape == tuple(ref.shape), name
        assert raw.data.dtype == torch.uint8 and raw.data.shape[:-1] == ref.shape[:-1], name
        assert torch.equal(decode(raw), ref), name
        types.add(raw.type_name)
        stored_as_hf = not name.endswith(("norm.weight", "A_log")) or name.endswith("linear_attn.norm.weight")
        regrouped = name.endswith("in_proj_qkvz.weight") and layout != "legacy"
        if stored_as_hf and not regrouped:
            assert is_view(raw.data), f"{name} should be a view of the file"
    main = quant.upper()
    assert main in types and types <= {"F32", "F16", main}  # F16: llama.cpp's fallback for short rows


def test_gguf_raw_blocks_are_the_files(hf_dir, tmp_path):
    """An expert's blocks are its slice of the stacked tensor; a plain matrix's are the tensor's bytes."""
    config = ModelSource(model_path=str(hf_dir)).config()
    path = write_gguf(tmp_path / "q.gguf", config, load_file(str(hf_dir / "model.safetensors")), "q8_0")
    src = GGUFSource(path)
    e3 = src.get_raw("model.layers.1.mlp.experts.3.down_proj.weight")
    assert torch.equal(e3.data, src.get_raw_experts(1, "down").data[3])
    o = src.get_raw("model.layers.3.self_attn.o_proj.weight")
    stored = torch.from_numpy(src.file.raw("blk.3.attn_output.weight").reshape(-1).copy())
    assert o.type_name == "Q8_0" and torch.equal(o.data.reshape(-1), stored)
    with pytest.raises(GGUFError, match="model.layers.0.nope.weight"):
        src.get_raw("model.layers.0.nope.weight")


@pytest.mark.parametrize("dtype, type_name", [(torch.float32, "F32"), (torch.bfloat16, "BF16"),
                                               (torch.float16, "F16")])
def test_safetensors_raw_is_the_float_bytes(hf_dir, tmp_path, dtype, type_name):
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in
             load_file(str(hf_dir / "model.safetensors")).items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    opened = ModelSource(model_path=str(tmp_path)).open()
    src = opened.weights
    assert isinstance(src, HFWeightSource)
    for name in names(opened):
        raw = src.get_raw(name)
        stored = src.get(name)
        assert raw.type_name == type_name and raw.shape == tuple(stored.shape), name
        assert torch.equal(raw.data.view(dtype), stored) and is_view(raw.data), name
        assert torch.equal(decode(raw), stored.float()), name


def test_state_dict_raw_and_missing_names():
    src = StateDictSource({"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                           "b": torch.tensor(2.0), "i": torch.zeros(2, dtype=torch.int32)})
    raw = src.get_raw("a.weight")
    assert raw.ggml_type == 0 and raw.shape == (2, 3) and tuple(raw.data.shape) == (2, 12)
    assert torch.equal(decode(raw), src.get("a.weight"))
    assert src.get_raw("b").shape == () and tuple(src.get_raw("b").data.shape) == (4,)
    with pytest.raises(WeightError, match="missing tensor 'c'"):
        src.get_raw("c")
    with pytest.raises(WeightError, match="'i' is torch.int32, not a float type"):
        src.get_raw("i")


def test_random_state_bf16_gguf_experts_are_views(tmp_path):
    """A whole-model BF16 GGUF: every expert matrix comes back without a copy."""
    config = ModelSource(model_path=str(make_checkpoint(tmp_path / "hf", "small", seed=1, **SHAPE))).config()
    src = GGUFSource(write_gguf(tmp_path / "b.gguf", config, random_state_dict(config, 0), "bf16"))
    raws = [src.get_raw(f"model.layers.0.mlp.experts.{e}.up_proj.weight") for e in range(config.num_experts)]
    assert all(r.type_name == "BF16" and is_view(r.data) for r in raws)


def test_split_qkvz_of_two_types_comes_in_parts(tmp_path):
    """Q4_K_M at the tiny widths stores attn_qkv and attn_gate in different types (Q8_0 / Q5_0 fallbacks in some
    layers): get_raw_parts hands both as stored, views of the file, and the order of HF's rows in their concat."""
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config

    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    src = GGUFSource(write_gguf(tmp_path / "q.gguf", config, random_state_dict(config, 1), "q4_k_m"))
    mixed = 0
    for i in range(config.num_hidden_layers):
        name = f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"
        if name not in src:
            continue
        parts, order = src.get_raw_parts(name)
        assert len(parts) == 2 and all(is_view(p.data) for p in parts)
        mixed += parts[0].type_name != parts[1].type_name
        rows = torch.cat([decode(p) for p in parts])
        assert torch.equal(rows[order], src.get(name).float())
    assert mixed > 0
    parts, order = src.get_raw_parts("model.layers.0.mlp.shared_expert.up_proj.weight")
    assert order is None and len(parts) == 1
