"""ModelConfig reads HF config.json strictly; errors name the field."""
import json

import pytest

from ktrans.config import CONFIGS_DIR, ConfigError, ModelConfig


def _real() -> dict:
    return json.loads((CONFIGS_DIR / "qwen3-next-80b-a3b.json").read_text())


def test_real_80b_config():
    c = ModelConfig.from_hf_dict(_real())
    assert c.full_attention_layers == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
    assert len(c.linear_attention_layers) == 36
    assert c.rotary_dim == 64 and c.conv_dim == 8192 and c.num_experts == 512 and c.num_experts_per_tok == 10


def test_layer_types_from_interval_and_explicit():
    d = _real()
    d["full_attention_interval"] = 3
    assert ModelConfig.from_hf_dict(d).full_attention_layers[:2] == [2, 5]
    d["layer_types"] = ["full_attention"] + ["linear_attention"] * 47
    assert ModelConfig.from_hf_dict(d).full_attention_layers == [0]


def test_rope_parameters_form():
    d = _real()
    del d["rope_theta"], d["partial_rotary_factor"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5.0e6, "partial_rotary_factor": 0.5}
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 5.0e6 and c.rotary_dim == 128


def test_round_trip_through_hf_dict():
    c = ModelConfig.from_hf_dict(_real())
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "linear_num_value_heads", "rope_theta",
                                   "moe_intermediate_size", "linear_conv_kernel_dim"])
def test_missing_field_is_named(field):
    d = _real()
    del d[field]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("patch, field", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"linear_num_value_heads": 20}, "linear_num_value_heads"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["mamba"] * 48}, "layer_types"),
    ({"num_experts_per_tok": 600}, "num_experts_per_tok"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": "wide"}, "wrong type"),
])
def test_inconsistent_field_is_named(patch, field):
    d = _real()
    d.update(patch)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(d)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        ModelConfig.from_json(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
