"""Bad GGUF files fail with errors naming the file and the key or tensor; the CLI reads and writes GGUF."""
from __future__ import annotations

import json
import logging
import shutil
import struct

import pytest
import torch

from ktrans.cli import main
from ktrans.config import ConfigError
from ktrans.weights.gguf import GGUFError, GGUFModelFile
from ktrans.weights.gguf_source import GGUFSource
from ktrans.weights.gguf_writer import GGUFWriter, Typed, split_gguf
from ktrans.model.convert import convert_hf_dir
from ktrans.inject import load_model
from ktrans.model.source import ModelSource

from ..model.helpers import make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("good")
    return convert_hf_dir(make_checkpoint(tmp / "hf", "small", seed=1), tmp / "m.gguf", "q8_0")


def load(path):
    return load_model(ModelSource(gguf_path=str(path)), show_progress=False)[0]


def rewrite(src, out, drop=(), metadata=None, drop_keys=()):
    """Copy a GGUF, leaving out tensors in `drop` and keys in `drop_keys`, overriding `metadata`."""
    f = GGUFModelFile(src)
    w = GGUFWriter(out)
    types = f.files[0].value_types
    w.metadata.update({k: v if types[k] == 9 else Typed(types[k], v) for k, v in f.metadata.items()
                       if k not in drop_keys})
    w.metadata.update(metadata or {})
    for name, info in f.tensors.items():
        if name not in drop:
            w.add_tensor(name, info.shape, info.ggml_type, lambda n=name: f.raw(n))
    return w.write()


def retype(src, out, name, ggml_type):
    """Copy a GGUF with the type field of tensor `name` overwritten (a type ktrans does not know)."""
    data = bytearray(src.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    out.write_bytes(bytes(data))
    return out


def test_truncated_data_names_the_tensor(good, tmp_path):
    data = good.read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) - 5000])
    with pytest.raises(GGUFError, match=r"t\.gguf: tensor '.*' .*runs past the end.*truncated"):
        load(tmp_path / "t.gguf")


def test_truncated_header_names_the_key(good, tmp_path):
    (tmp_path / "t.gguf").write_bytes(good.read_bytes()[:300])
    with pytest.raises(GGUFError, match=r"file ends inside metadata .*'qwen3next\..*truncated"):
        load(tmp_path / "t.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load(tmp_path / "x.gguf")
    with pytest.raises(GGUFError, match="no such file"):
        load(tmp_path / "missing.gguf")


def test_wrong_architecture_names_the_key(good, tmp_path):
    path = rewrite(good, tmp_path / "llama.gguf", metadata={"general.architecture": "llama"})
    with pytest.raises(ConfigError, match=r"'general\.architecture' is 'llama'; ktrans serves 'qwen3next'"):
        load(path)


def test_missing_metadata_key_is_named(good, tmp_path):
    path = rewrite(good, tmp_path / "k.gguf", drop_keys=("qwen3next.ssm.state_size",))
    with pytest.raises(ConfigError, match=r"missing metadata key 'qwen3next\.ssm\.state_size'"):
        load(path)


def test_missing_tensor_is_named(good, tmp_path):
    path = rewrite(good, tmp_path / "m.gguf", drop=("blk.5.ssm_dt.bias",))
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.5\.ssm_dt\.bias'.*layers\.5\.linear_attn\.dt_bias"):
        load(path)


def test_unknown_quant_type_is_named(good, tmp_path):
    path = retype(good, tmp_path / "u.gguf", "blk.2.ffn_up_exps.weight", 99)
    with pytest.raises(GGUFError, match=r"tensor 'blk\.2\.ffn_up_exps\.weight'.*ggml type 99 \(unknown\)"):
        load(path)
    path = retype(good, tmp_path / "iq2.gguf", "blk.0.attn_qkv.weight", 16)
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.attn_qkv\.weight'.*16 \(IQ2_XXS\) is not supported"):
        GGUFSource(path).get("model.layers.0.linear_attn.in_proj_qkvz.weight")
    with pytest.raises(GGUFError, match=r"blk\.2\.ffn_up_exps\.weight.*99"):
        GGUFSource(tmp_path / "u.gguf").get_raw_experts(2, "up")


def test_split_file_errors(good, tmp_path):
    shutil.copy(good, tmp_path / "m.gguf")
    shards = split_gguf(tmp_path / "m.gguf", 2)
    with pytest.raises(GGUFError, match="shard 2 of 2; pass the first shard"):
        load(shards[1])
    shards[1].unlink()
    with pytest.raises(GGUFError, match="missing shard.*m-00002-of-00002.gguf"):
        load(shards[0])


def test_type_without_native_kernel_falls_back_with_a_warning(good, caplog):
    src = GGUFSource(good)
    with caplog.at_level(logging.WARNING, logger="ktrans.weights.gguf_source"):
        got = src.load_experts(1, "gate", native_types={"Q4_K", "Q6_K"}, dtype=torch.float32)
    assert "blk.1.ffn_gate_exps.weight is Q8_0, which has no native expert kernel; dequantizing" in caplog.text
    assert torch.equal(got[3], src.get("model.layers.1.mlp.experts.3.gate_proj.weight"))


def test_cli_make_tiny_gguf_then_generate(tmp_path, capsys):
    out = tmp_path / "tiny.gguf"
    assert main(["make-tiny", "--gguf", "--out", str(out), "--quant", "q8_0"]) == 0
    assert "Q8_0 GGUF (split attn_qkv/attn_gate;" in capsys.readouterr().out
    assert main(["generate", "--gguf_path", str(out), "--chat", "Hi", "--max_new_tokens", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prompt_ids"][:3] == [151644, 872, 198] and len(res["output_ids"]) == 4  # <|im_start|>user\n
    (tmp_path / "bad.gguf").write_bytes(out.read_bytes()[:-100000])
    assert main(["generate", "--gguf_path", str(tmp_path / "bad.gguf"), "--prompt", "x"]) == 2
    assert "truncated" in capsys.readouterr().err
    assert main(["make-tiny", "--out", str(tmp_path / "d"), "--quant", "q8_0"]) == 2
