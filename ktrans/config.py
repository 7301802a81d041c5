"""ModelConfig: the shape of a Qwen3-Next network, read from an HF config.json (or, later, GGUF metadata).

One frozen dataclass with the fields the model, the loaders and the memory planner need. Reading is strict: a
missing field or one that contradicts another raises ConfigError naming it, because a silently defaulted head
count gives garbage logits rather than an error.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ConfigError(ValueError):
    """A model config that cannot describe a Qwen3-Next network; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    intermediate_size: int  # dense MLP layers (mlp_only_layers / decoder_sparse_step)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"config field {name!r}: {why}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts_per_tok"):
            need(int(getattr(self, name)) > 0, name, f"must be a positive integer, got {getattr(self, name)!r}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted({t for t in self.layer_types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)})
        need(not bad, "layer_types", f"unknown layer type(s) {bad}; expected {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
             f"{self.linear_num_value_heads} is not a multiple of linear_num_key_heads {self.linear_num_key_heads}")
        need(0.0 < self.partial_rotary_factor <= 1.0, "partial_rotary_factor",
             f"must be in (0, 1], got {self.partial_rotary_factor}")
        need(self.rotary_dim % 2 == 0 and self.rotary_dim > 0, "partial_rotary_factor",
             f"head_dim * partial_rotary_factor = {self.head_dim * self.partial_rotary_factor} must be a positive even integer")
        need(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        need(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        if self.num_experts > 0:
            need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 f"{self.num_experts_per_tok} is more than num_experts {self.num_experts}")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive when num_experts > 0")
        need(self.decoder_sparse_step > 0, "decoder_sparse_step", "must be positive")
        for i in self.mlp_only_layers:
            need(0 <= i < self.num_hidden_layers, "mlp_only_layers", f"layer {i} is out of range")

    # ---- derived shapes -------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    # ---- reading and writing --------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        def get(name: str, *alts: str, default: Any = ...) -> Any:
            for key in (name, *alts):
                if key in d and d[key] is not None:
                    return d[key]
            rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
            for key in (name, *alts):
                if key in rope and rope[key] is not None:
                    return rope[key]
            if default is ...:
                raise ConfigError(f"{source}: missing required field {name!r}")
            return default

        model_type = d.get("model_type")
        if model_type is not None and model_type != "qwen3_next":
            raise ConfigError(f"{source}: field 'model_type' is {model_type!r}; ktrans serves 'qwen3_next'")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: field 'rope_parameters.rope_type' is {rope_type!r}; only 'default' is supported")

        try:
            return cls._from_hf_dict(d, get, source)
        except ConfigError as e:
            if str(e).startswith(source):
                raise
            raise ConfigError(f"{source}: {e}") from None  # checks in __post_init__ do not know the file
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: a field has the wrong type: {e}") from None

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], get, source: str) -> "ModelConfig":
        n_layers = int(get("num_hidden_layers"))
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = int(get("full_attention_interval", default=4))
            if interval <= 0:
                raise ConfigError(f"{source}: field 'full_attention_interval' must be positive, got {interval}")
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
        hidden = int(get("hidden_size"))
        n_heads = int(get("num_attention_heads"))
        head_dim = d.get("head_dim") or hidden // n_heads
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=n_heads,
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(head_dim),
            partial_rotary_factor=float(get("partial_rotary_factor", default=0.25)),
            rope_theta=float(get("rope_theta")),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim")),
            num_experts=int(get("num_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            norm_topk_prob=bool(get("norm_topk_prob", default=True)),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
            intermediate_size=int(get("intermediate_size")),
            decoder_sparse_step=int(get("decoder_sparse_step", default=1)),
            mlp_only_layers=tuple(int(i) for i in get("mlp_only_layers", default=[])),
            rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            max_position_embeddings=int(get("max_position_embeddings", default=262144)),
            hidden_act=str(get("hidden_act", default="silu")),
            attention_bias=bool(get("attention_bias", default=False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config file at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json for this shape (what transformers' Qwen3NextConfig reads)."""
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        eos = list(self.eos_token_id)
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        d["rope_parameters"] = rope
        d.update(rope_theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor)
        d.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", torch_dtype="float32")
        return d


PACKAGE_DIR = Path(__file__).parent
CONFIGS_DIR = PACKAGE_DIR / "configs"
RULES_DIR = PACKAGE_DIR / "optimize_rules"
