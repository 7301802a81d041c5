"""Random-weight Qwen3-Next checkpoints with the real architecture, for tests, demos and the embedded default.

`write_tiny_model` writes an HF directory (config.json, model.safetensors, tokenizer files) that loads in both
ktrans and transformers. Weights are scaled so activations stay O(1) through the layers and logits have a spread
of a few units (greedy decoding is then stable and not flat); norm weights, A_log and dt_bias vary per channel so
a transposed or mis-grouped tensor changes the output.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ktrans.config import CONFIGS_DIR, ModelConfig

PRESETS = {
    # the embedded default: 3 DeltaNet + 1 attention layer
    "tiny": "tiny-qwen3next.json",
}

# `small`: at least 2 full-attention and 6 DeltaNet layers, experts well above top-k, value heads > key heads.
SMALL_OVERRIDES = dict(
    hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=24,
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=48, shared_expert_intermediate_size=96,
    intermediate_size=256,
)


def preset_config(preset: str, layers: int | None = None) -> dict:
    """The HF config dict of a preset: `tiny` (the embedded default), `small`, a shipped config by name
    (`qwen3-next-80b-a3b`, the real shapes) or a config.json path (or its directory). `layers` keeps the first
    N layers of the stack (their attention / DeltaNet pattern unchanged)."""
    base = json.loads((CONFIGS_DIR / PRESETS["tiny"]).read_text())
    if preset == "small":
        base.update(SMALL_OVERRIDES)
    elif preset != "tiny":
        path = Path(preset)
        if not path.exists() and (CONFIGS_DIR / f"{path.name.removesuffix('.json')}.json").is_file():
            path = CONFIGS_DIR / f"{path.name.removesuffix('.json')}.json"
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            shipped = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
            raise ValueError(f"--preset {preset!r}: not 'tiny', 'small', a shipped config ({', '.join(shipped)}) "
                             f"or a config.json path")
        base = json.loads(path.read_text())
    if layers is not None:
        base = with_layers(base, layers)
    return base


def with_layers(d: dict, layers: int) -> dict:
    """An HF config dict cut to its first `layers` layers."""
    n = int(d["num_hidden_layers"])
    if not 1 <= layers <= n:
        raise ValueError(f"--layers must be between 1 and the config's {n} layers, got {layers}")
    d = dict(d, num_hidden_layers=layers)
    if d.get("layer_types") is not None:
        d["layer_types"] = list(d["layer_types"])[:layers]
    if d.get("mlp_only_layers"):
        d["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < layers]
    return d


def random_state_dict(config: ModelConfig, seed: int = 0, router: str = "uniform") -> dict[str, torch.Tensor]:
    """fp32 weights for every parameter of the HF module tree, deterministic in `seed`. router="skewed" scales
    each router's rows so a few experts per layer are picked far more often (weights/random_gguf.py says how)."""
    from ktrans.model.qwen3_next import Qwen3NextForCausalLM

    if router not in ("uniform", "skewed"):
        raise ValueError(f"--router must be 'uniform' or 'skewed', got {router!r}")
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen3NextForCausalLM(config).named_parameters()}
    depth_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        def normal(std: float) -> torch.Tensor:
            return torch.randn(shape, generator=gen) * std

        def uniform(lo: float, hi: float) -> torch.Tensor:
            return torch.rand(shape, generator=gen) * (hi - lo) + lo

        if name.endswith("embed_tokens.weight"):
            t = normal(1.0)
        elif name == "lm_head.weight":
            t = normal(3.0 / math.sqrt(config.hidden_size))
        elif name.endswith("linear_attn.norm.weight"):
            t = uniform(0.7, 1.3)
        elif name.endswith("norm.weight"):  # zero-centred RMSNorm weights: (1 + w)
            t = uniform(-0.3, 0.3)
        elif name.endswith("A_log"):
            t = uniform(1.0, 16.0).log()
        elif name.endswith("dt_bias"):
            t = uniform(-1.0, 1.5)
        elif name.endswith("conv1d.weight"):
            t = normal(1.0 / math.sqrt(shape[-1]))
        elif name.endswith("mlp.gate.weight"):
            t = normal(2.0 / math.sqrt(shape[-1]))
        elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t = normal(depth_scale * 2.0 / math.sqrt(shape[-1]))
        else:
            t = normal(1.0 / math.sqrt(shape[-1]))
        if router == "skewed" and name.endswith("mlp.gate.weight"):
            from ktrans.model.random_gguf import router_row_scales

            t = t * torch.from_numpy(router_row_scales(seed, int(name.split(".")[2]), shape[0]))[:, None]
        out[name] = t.contiguous()
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def write_tiny_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, config_overrides: dict | None = None,
                     with_tokenizer: bool = True, layers: int | None = None, router: str = "uniform") -> Path:
    """Write a random-weight HF directory; returns its path."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = preset_config(preset, layers)
    d.update(config_overrides or {})
    config = ModelConfig.from_hf_dict(d, source=f"preset {preset!r}")
    state = random_state_dict(config, seed, router)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    if with_tokenizer:
        from ktrans.tokenizer.tokenizer import Tokenizer

        Tokenizer.default().write_hf_files(out_dir)
    return out_dir


def cache_dir() -> Path:
    return Path(os.environ.get("KTRANS_CACHE_DIR", Path.home() / ".cache" / "ktrans"))


def default_model_dir() -> Path:
    """The embedded default model (the `tiny` preset, seed 0), written to the cache on first use."""
    path = cache_dir() / "models" / "tiny-qwen3next-seed0"
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_tiny_model(tmp, "tiny", seed=0)
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
    return path
