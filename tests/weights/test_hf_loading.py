"""Loading HF checkpoints: sharded files, dtypes, memory mapping, and errors that name the tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ktrans.weights.safetensors_mmap import CheckpointError, SafetensorsCheckpoint
from ktrans.inject import load_model
from ktrans.model.source import ModelSource

from ..model.helpers import load, make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "small", seed=1)


def test_fp32_params_are_memory_mapped_views(ckpt):
    model = load(ckpt)
    w = model.model.layers[0].mlp.experts.op.w["up_proj"][3]
    ref = load_file(str(ckpt / "model.safetensors"))["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert torch.equal(w, ref)
    mapped = SafetensorsCheckpoint(ckpt).get("model.layers.0.mlp.experts.3.up_proj.weight")
    assert not mapped.untyped_storage().resizable()  # a view of the mmap, not a private copy


def test_bfloat16_load(ckpt):
    model, _ = load_model(ModelSource(model_path=str(ckpt)), torch.bfloat16, show_progress=False)
    assert model.lm_head.op.weight.dtype == torch.bfloat16
    assert model.model.layers[0].linear_attn.op.A_log.dtype == torch.float32


def test_sharded_checkpoint_loads_the_same(ckpt, tmp_path):
    state = load_file(str(ckpt / "model.safetensors"))
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(tmp_path / fname))
        weight_map.update({k: fname for k in ks})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    a, b = load(ckpt), load(tmp_path)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def _rewrite(ckpt, tmp_path, edit):
    state = load_file(str(ckpt / "model.safetensors"))
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    return tmp_path


def test_missing_tensor_is_named(ckpt, tmp_path):
    path = _rewrite(ckpt, tmp_path, lambda s: s.pop("model.layers.5.linear_attn.dt_bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.5\.linear_attn\.dt_bias'"):
        load(path)


def test_wrong_shape_is_named(ckpt, tmp_path):
    def edit(s):
        s["model.layers.3.self_attn.q_proj.weight"] = s["model.layers.3.self_attn.q_proj.weight"][:-1].contiguous()
    path = _rewrite(ckpt, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.q_proj\.weight.*shape"):
        load(path)


def test_truncated_file(ckpt, tmp_path):
    data = (ckpt / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match="truncated"):
        load(tmp_path)


def test_mtp_tensors_are_ignored(ckpt, tmp_path):
    path = _rewrite(ckpt, tmp_path, lambda s: s.update({"mtp.fc.weight": torch.zeros(2, 2)}))
    load(path)


def test_no_weights(tmp_path, ckpt):
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load(tmp_path)
