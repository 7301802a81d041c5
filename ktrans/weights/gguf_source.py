"""The Hugging Face view of a Qwen3-Next GGUF: a ModelConfig from its metadata, and each HF parameter with
llama.cpp's conversion undone.

llama.cpp's converter (conversion/qwen.py, Qwen3NextModel.modify_tensors) and loader (src/models/qwen3next.cpp,
load_arch_tensors / build_qkvz / build_layer_attn_linear) define the layout this file inverts:

    A_log                   blk.N.ssm_a (no .weight suffix) holds -exp(A_log)       -> A_log = log(-ssm_a)
    dt_bias                 blk.N.ssm_dt.bias
    conv1d.weight [C,1,K]   blk.N.ssm_conv1d.weight, squeezed to [C, K]; channels stay q | k | v
    in_proj_ba              blk.N.ssm_ba.weight, unchanged (per key head: b then a)
    *norm.weight            stored as 1 + w (zero-centred RMSNorm), except linear_attn.norm -> ssm_norm (plain)
    post_attention_layernorm blk.N.post_attention_norm.weight
    q_proj                  blk.N.attn_q.weight, unchanged ([query | gate] per head)
    in_proj_qkvz            legacy files: blk.N.ssm_in.weight, unchanged (grouped per key head);
                            newer files: blk.N.attn_qkv.weight (all q rows, all k rows, all v rows) and
                            blk.N.attn_gate.weight (z), which are regrouped here into HF's per-key-head layout
    experts                 ffn_{gate,up,down}_exps [E, rows, cols], or ffn_gate_up_exps (gate rows then up rows)
    mlp.gate / shared_expert_gate   ffn_gate_inp / ffn_gate_inp_shexp; shared expert ffn_{gate,up,down}_shexp
    lm_head                 output.weight, or token_embd.weight when output is absent (tied)

Routed-expert tensors are not dequantized at load: `get_raw_experts` hands their blocks to the CPU kernels in
place, and `get_raw` any tensor's blocks (for quantized GPU linears). `get` dequantizes (for the torch ops).
"""
from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from ktrans.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, ModelConfig
from ktrans.weights.gguf import GGUFError, GGUFModelFile, TensorInfo
from ktrans.weights.quants import UnsupportedQuantError, dequantize, quant_type
from ktrans.weights.source import EXPERT_KINDS, RawExperts, RawTensor, WeightSource, float_bytes

log = logging.getLogger(__name__)

ARCH = "qwen3next"
_DEQUANT_CHUNK = 1 << 22  # values dequantized per step
_VIEW_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# HF name inside model.layers.N -> (GGUF name inside blk.N, transform)
_LAYER_TENSORS: dict[str, tuple[str, str]] = {
    "input_layernorm.weight": ("attn_norm.weight", "minus_one"),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", "minus_one"),
    "self_attn.q_proj.weight": ("attn_q.weight", ""),
    "self_attn.k_proj.weight": ("attn_k.weight", ""),
    "self_attn.v_proj.weight": ("attn_v.weight", ""),
    "self_attn.o_proj.weight": ("attn_output.weight", ""),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "minus_one"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "minus_one"),
    "linear_attn.in_proj_ba.weight": ("ssm_ba.weight", ""),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", "conv"),
    "linear_attn.dt_bias": ("ssm_dt.bias", ""),
    "linear_attn.A_log": ("ssm_a", "a_log"),
    "linear_attn.norm.weight": ("ssm_norm.weight", ""),
    "linear_attn.out_proj.weight": ("ssm_out.weight", ""),
    "mlp.gate.weight": ("ffn_gate_inp.weight", ""),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", "row"),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", ""),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", ""),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", ""),
    "mlp.gate_proj.weight": ("ffn_gate.weight", ""),  # dense MLP layers
    "mlp.up_proj.weight": ("ffn_up.weight", ""),
    "mlp.down_proj.weight": ("ffn_down.weight", ""),
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("token_embd.weight", ""),
    "model.norm.weight": ("output_norm.weight", "minus_one"),
    "lm_head.weight": ("output.weight", ""),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


# ---------------------------------------------------------------------------------------------- config


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, TensorInfo], source: str) -> ModelConfig:
    """ModelConfig from `qwen3next.*` metadata (and, where the metadata is silent, from the tensor table)."""
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ConfigError(f"{source}: metadata 'general.architecture' is {arch!r}; ktrans serves {ARCH!r}")

    def key(name: str, default: Any = ...) -> Any:
        full = f"{ARCH}.{name}"
        if full in meta:
            v = meta[full]
            return max(v) if isinstance(v, list) and name != "attention.recurrent_layers" else v
        if default is ...:
            raise ConfigError(f"{source}: missing metadata key {full!r}")
        return default

    n_all = int(key("block_count"))
    nextn = int(key("nextn_predict_layers", 0))
    n_layers = n_all - nextn  # multi-token-prediction blocks follow the trunk
    if n_layers <= 0:
        raise ConfigError(f"{source}: {ARCH}.block_count {n_all} leaves no layers after "
                          f"{ARCH}.nextn_predict_layers {nextn}")
    recurrent = key("attention.recurrent_layers", None)
    if recurrent is not None:
        flags = recurrent if isinstance(recurrent, list) else [recurrent] * n_all
        if len(flags) < n_layers:
            raise ConfigError(f"{source}: {ARCH}.attention.recurrent_layers has {len(flags)} entries for "
                              f"{n_layers} layers")
        layer_types = [LINEAR_ATTENTION if r else FULL_ATTENTION for r in flags[:n_layers]]
    else:  # older files lack the key; llama.cpp then uses 4
        interval = int(key("full_attention_interval", 4))
        if interval <= 0:
            raise ConfigError(f"{source}: {ARCH}.full_attention_interval must be positive, got {interval}")
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    rope_dim = int(key("rope.dimension_count", head_dim // 4))
    n_v_heads = int(key("ssm.time_step_rank"))
    vocab = key("vocab_size", None)
    if vocab is None:
        vocab = tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else \
            len(meta.get("tokenizer.ggml.tokens", ()))
    dense_ff = int(key("feed_forward_length", 0))
    if dense_ff == 0 and "blk.0.ffn_gate.weight" in tensors:
        dense_ff = tensors["blk.0.ffn_gate.weight"].shape[0]
    d = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "layer_types": layer_types,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "partial_rotary_factor": rope_dim / head_dim,
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": n_v_heads,
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // n_v_heads,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "num_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),  # llama.cpp always renormalises top-k
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length")),
        "intermediate_size": dense_ff,
        # a layer with a dense ffn_gate and no router is a dense MLP layer (a missing router stays an error)
        "mlp_only_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
                            and f"blk.{i}.ffn_gate.weight" in tensors],
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "max_position_embeddings": int(key("context_length", 262144)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return ModelConfig.from_hf_dict(d, source=source)


# ---------------------------------------------------------------------------------------------- source


class GGUFSource(WeightSource):
    """Weights of a Qwen3-Next GGUF under HF names: `get` for dense tensors, `get_raw` / `get_raw_experts` for the
    blocks as stored."""

    def __init__(self, path: str | Path):
        self.file = GGUFModelFile(path)
        self.path = self.file.path
        self.description = str(self.path)
        self.config = config_from_gguf(self.file.metadata, self.file.tensors, str(self.path))

    @property
    def metadata(self) -> dict[str, Any]:
        return self.file.metadata

    # ---- raw access -------------------------------------------------------------------------------
    def _raw_torch(self, name: str) -> torch.Tensor:
        with warnings.catch_warnings():  # a read-only map: the tensors are never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.file.raw(name))

    def _float(self, name: str, rows: slice | None = None, expert: int | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name` (optionally one expert of a stacked tensor, or a row range) as float.

        F32/F16/BF16 come back as views of the map in their own dtype; quantized types are dequantized, a few
        million values at a time, straight into a tensor of `dtype` (fp32 by default), so a large embedding
        never has a whole fp32 copy next to its bf16 one.
        """
        info = self.file.info(name)
        shape = list(info.shape)
        raw = self.file.raw(name)
        if expert is not None:
            raw, shape = raw[expert], shape[1:]
        if rows is not None:
            raw = raw[rows]
            shape[0] = raw.shape[0]
        try:
            tname = quant_type(info.ggml_type).name
            if tname in _VIEW_DTYPES:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    return torch.from_numpy(np.ascontiguousarray(raw)).view(_VIEW_DTYPES[tname]).reshape(shape)
            cols = shape[-1]
            out = torch.empty(shape, dtype=dtype or torch.float32)
            src, dst = raw.reshape(-1, raw.shape[-1]), out.view(-1, cols)
            step = max(1, _DEQUANT_CHUNK // cols)
            for s in range(0, len(src), step):
                block = src[s:s + step]
                dst[s:s + len(block)] = torch.from_numpy(dequantize(block, info.ggml_type, (len(block), cols)))
            return out
        except UnsupportedQuantError as e:
            raise GGUFError(f"{info.path}: tensor {name!r}: {e}") from None
        except ValueError as e:
            raise GGUFError(f"{info.path}: tensor {name!r} ({info.type_name} {list(info.shape)}): {e}") from None

    def __contains__(self, hf_name: str) -> bool:
        """Whether the file holds what parameter `hf_name` is made from."""
        try:
            gname, how, layer = self._locate(hf_name)
        except GGUFError:
            return False
        if how == "regroup_qkvz":
            return gname in self.file and f"blk.{layer}.attn_gate.weight" in self.file
        return gname in self.file

    def require(self, hf_name: str, shape: tuple[int, ...], dtype: torch.dtype | None,
                device: str | torch.device = "cpu") -> torch.Tensor:
        if hf_name not in self:
            self.get(hf_name)  # raises the GGUFError that names the file's tensor and the parameter
        return super().require(hf_name, shape, dtype, device)

    def tensor_type(self, hf_name: str) -> str:
        """The ggml type name of the stored tensor behind `hf_name` (for placement reports)."""
        gguf_name = self._locate(hf_name)[0]
        return self.file.info(gguf_name).type_name

    # ---- HF names -----------------------------------------------------------------------------------
    def _locate(self, hf_name: str) -> tuple[str, str, int | None]:
        """(GGUF tensor, transform, layer) for an HF parameter name."""
        if hf_name in _GLOBAL_TENSORS:
            gname, how = _GLOBAL_TENSORS[hf_name]
            if hf_name == "lm_head.weight" and gname not in self.file:
                gname = "token_embd.weight"  # tied, as llama.cpp does when output is absent
            return gname, how, None
        m = _LAYER_RE.match(hf_name)
        if m is None or int(m[1]) >= self.config.num_hidden_layers:
            raise GGUFError(f"{self.path}: no GGUF tensor is known for parameter {hf_name!r}")
        i, rest = int(m[1]), m[2]
        e = _EXPERT_RE.match(rest)
        if e is not None:
            return self._expert_tensor(i, e[2])[0], f"expert:{e[2]}:{e[1]}", i
        if rest == "linear_attn.in_proj_qkvz.weight":
            if f"blk.{i}.ssm_in.weight" in self.file:
                return f"blk.{i}.ssm_in.weight", "", i
            return f"blk.{i}.attn_qkv.weight", "regroup_qkvz", i
        if rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight") \
                and f"blk.{i}.attn_q.weight" not in self.file and f"blk.{i}.attn_qkv.weight" in self.file:
            return f"blk.{i}.attn_qkv.weight", f"fused_qkv:{rest[10]}", i  # q, k or v rows of a fused tensor
        if rest not in _LAYER_TENSORS:
            raise GGUFError(f"{self.path}: no GGUF tensor is known for parameter {hf_name!r}")
        gname, how = _LAYER_TENSORS[rest]
        return f"blk.{i}.{gname}", how, i

    def _expert_tensor(self, layer: int, kind: str) -> tuple[str, slice | None]:
        """The stacked tensor holding `kind` experts of `layer`, and the row slice when gate and up are fused."""
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        fused = f"blk.{layer}.ffn_gate_up_exps.weight"
        if name not in self.file and kind in ("gate", "up") and fused in self.file:
            f = self.file.info(fused).shape[1] // 2
            return fused, slice(0, f) if kind == "gate" else slice(f, 2 * f)
        return name, None

    def get(self, hf_name: str, dtype: torch.dtype | None = None,
            device: str | torch.device | None = None) -> torch.Tensor:
        """Parameter `hf_name` in HF layout and shape, in `dtype`. Without dtype, F32/F16/BF16 tensors stored as-is
        come back as zero-copy views of the file and anything transformed or dequantized as fp32; with the file's
        own dtype, still a view."""
        try:
            t = self._get(hf_name, dtype)
        except GGUFError as e:
            if hf_name in str(e):
                raise
            raise GGUFError(f"{e} (needed for {hf_name})") from None
        return t.to(device=device, dtype=dtype) if dtype is not None or device is not None else t

    def _get(self, hf_name: str, dtype: torch.dtype | None) -> torch.Tensor:
        gname, how, layer = self._locate(hf_name)
        if how.startswith("expert:"):
            _, kind, e = how.split(":")
            name, rows = self._expert_tensor(layer, kind)
            return self._float(name, rows, expert=int(e), dtype=dtype)
        if how == "regroup_qkvz":
            return self._regroup_qkvz(layer)
        if how.startswith("fused_qkv:"):
            return self._fused_attention_part(layer, how[-1])
        t = self._float(gname, dtype=dtype if not how else None)  # transforms compute in fp32
        if how == "minus_one":  # exact: g - 1 is representable for g in [0.5, 2], and 1 + (g - 1) == g
            return t.float() - 1.0
        if how == "a_log":
            return torch.log(-t.float())
        if how == "conv":  # [C, K] -> [C, 1, K]
            return t.reshape(t.shape[0], 1, t.shape[-1])
        if how == "row":  # [H] or [1, H] -> [1, H]
            return t.reshape(1, -1)
        return t

    def _regroup_qkvz(self, i: int, raw: bool = False) -> torch.Tensor:
        """HF in_proj_qkvz from the split layout: rows [q(all heads) | k | v] + z -> per key head [q_h|k_h|v_h|z_h].
        raw: move the stored rows (whole blocks each; both tensors of one type) instead of float values."""
        c = self.config
        read = self._raw_torch if raw else (lambda name: self._float(name).float())
        qkv, z = read(f"blk.{i}.attn_qkv.weight"), read(f"blk.{i}.attn_gate.weight")
        if qkv.shape[0] != c.conv_dim or z.shape[0] != c.linear_value_dim:
            raise GGUFError(f"{self.path}: blk.{i}.attn_qkv.weight / attn_gate.weight have {qkv.shape[0]} / "
                            f"{z.shape[0]} rows, expected {c.conv_dim} / {c.linear_value_dim} for this config")
        return self._qkvz_grouped(qkv, z)

    def _qkvz_grouped(self, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Rows [q(all heads) | k | v] and z -> per key head [q_h | k_h | v_h | z_h]."""
        c = self.config
        nk, dk, dv, r = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, \
            c.linear_num_value_heads // c.linear_num_key_heads
        h = qkv.shape[1]
        q, k, v = qkv.split([nk * dk, nk * dk, nk * r * dv])
        grouped = torch.cat([q.reshape(nk, dk, h), k.reshape(nk, dk, h), v.reshape(nk, r * dv, h),
                             z.reshape(nk, r * dv, h)], 1)
        return grouped.reshape(-1, h)

    def get_raw_parts(self, hf_name: str) -> tuple[list[RawTensor], torch.Tensor | None]:
        """The split in_proj_qkvz as its two stored tensors (attn_qkv, attn_gate: their types may differ) and the
        order of HF's rows in their concatenation; any other tensor as get_raw gives it."""
        gname, how, layer = self._locate(hf_name)
        if how != "regroup_qkvz":
            return [self.get_raw(hf_name)], None
        parts = []
        for name in (gname, f"blk.{layer}.attn_gate.weight"):
            info, data = self.file.info(name), self._raw_torch(name)
            parts.append(RawTensor(name, info.ggml_type, tuple(info.shape), data))
        n_qkv, n_z = parts[0].shape[0], parts[1].shape[0]
        rows = torch.arange(n_qkv + n_z)[:, None]
        order = self._qkvz_grouped(rows[:n_qkv], rows[n_qkv:])[:, 0]
        return parts, order

    def _fused_attention_rows(self, which: str) -> tuple[int, int]:
        """(first row, rows) of q (with its gate), k or v in a fused attention attn_qkv tensor."""
        c = self.config
        q_rows, kv_rows = 2 * c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        return {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}[which]

    def _fused_attention_part(self, i: int, which: str) -> torch.Tensor:
        start, n = self._fused_attention_rows(which)
        return self._float(f"blk.{i}.attn_qkv.weight", rows=slice(start, start + n))

    # ---- raw blocks ---------------------------------------------------------------------------------
    def get_raw(self, hf_name: str) -> RawTensor:
        """Parameter `hf_name` as stored, in HF layout (see RawTensor): a view of the mapped blocks where the GGUF
        keeps HF's rows (a reshape, a row range of a fused tensor or one expert of a stacked one is still a view);
        the split attn_qkv + attn_gate rows regrouped (a copy); norms and A_log, which the file stores as other
        values, as HF's F32 values."""
        try:
            gname, how, layer = self._locate(hf_name)
        except GGUFError as e:
            raise GGUFError(f"{e} (needed for {hf_name})") from None
        if how.startswith("expert:"):
            _, kind, e = how.split(":")
            name, rows = self._expert_tensor(layer, kind)
            info, data = self.file.info(name), self._raw_torch(name)[int(e)]
            data = data[rows] if rows is not None else data
            return RawTensor(hf_name, info.ggml_type, (data.shape[0], info.shape[-1]), data)
        if how == "regroup_qkvz" and self.file.info(gname).ggml_type == \
                self.file.info(f"blk.{layer}.attn_gate.weight").ggml_type:
            info = self.file.info(gname)
            data = self._regroup_qkvz(layer, raw=True)
            return RawTensor(hf_name, info.ggml_type, (data.shape[0], info.shape[-1]), data)
        if how.startswith("fused_qkv:"):
            start, n = self._fused_attention_rows(how[-1])
            info = self.file.info(gname)
            return RawTensor(hf_name, info.ggml_type, (n, info.shape[-1]), self._raw_torch(gname)[start:start + n])
        if how in ("", "conv", "row"):  # HF's values; at most the shape differs
            info, data = self.file.info(gname), self._raw_torch(gname)
            if how == "conv":  # [C, K] -> [C, 1, K]
                return RawTensor(hf_name, info.ggml_type, (info.shape[0], 1, info.shape[-1]), data.unsqueeze(1))
            if how == "row":  # [H] or [1, H] -> [1, H]
                return RawTensor(hf_name, info.ggml_type, (1, info.shape[-1]), data.reshape(1, -1))
            return RawTensor(hf_name, info.ggml_type, tuple(info.shape), data)
        t = self._get(hf_name, None).float()  # stored as other values (or regrouped across types): HF's, in F32
        ggml_type, data = float_bytes(t)
        return RawTensor(hf_name, ggml_type, tuple(t.shape), data)

    # ---- experts ------------------------------------------------------------------------------------
    def get_raw_experts(self, layer: int, kind: str) -> RawExperts:
        """Layer `layer`'s stacked `kind` ("gate", "up", "down") expert matrices as stored, without dequantizing."""
        if kind not in EXPERT_KINDS:
            raise ValueError(f"expert kind must be one of {EXPERT_KINDS}, got {kind!r}")
        name, rows = self._expert_tensor(layer, kind)
        info = self.file.info(name)
        data = self._raw_torch(name)  # an unknown type is refused here, naming the tensor
        if rows is not None:
            data = data[:, rows]
        e, n_rows, cols = info.shape[0], data.shape[1], info.shape[2]
        return RawExperts(data, info.ggml_type, (e, n_rows, cols), name)

    def load_experts(self, layer: int, kind: str, native_types: Iterable[str],
                     dtype: torch.dtype = torch.bfloat16) -> RawExperts | torch.Tensor:
        """What an expert operator should hold: the raw blocks when its kernel decodes their type, else (with a
        warning) the dequantized [E, rows, cols] tensor in `dtype` — slower and larger, but never wrong numbers."""
        raw = self.get_raw_experts(layer, kind)
        if raw.type_name in set(native_types):
            return raw
        log.warning("%s: %s is %s, which has no native expert kernel; dequantizing it to %s", self.path, raw.name,
                    raw.type_name, str(dtype).removeprefix("torch."))
        return self._dequantize_experts(layer, kind, dtype)

    def _dequantize_experts(self, layer: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        name, rows = self._expert_tensor(layer, kind)
        n = self.file.info(name).shape[0]
        return torch.stack([self._float(name, rows, expert=e, dtype=dtype).to(dtype) for e in range(n)])

    # ---- bookkeeping --------------------------------------------------------------------------------
    def unused(self, hf_names: Iterable[str]) -> list[str]:
        """GGUF tensors the given parameters do not use (multi-token-prediction blocks excluded)."""
        used = set()
        for n in hf_names:
            m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts(\.\*.*)?$", n)  # a whole layer's experts
            if m:
                used.update(self._expert_tensor(int(m[1]), k)[0] for k in EXPERT_KINDS)
                continue
            try:
                gname, how, layer = self._locate(n)
            except GGUFError:
                continue
            if how.startswith("expert:"):
                used.add(self._expert_tensor(layer, how.split(":")[1])[0])
            elif how == "regroup_qkvz":
                used.update({gname, f"blk.{layer}.attn_gate.weight"})
            else:
                used.add(gname)
        trunk = self.config.num_hidden_layers
        mtp = re.compile(r"^blk\.(\d+)\.")
        return [t for t in self.file.tensors if t not in used
                and not ((m := mtp.match(t)) and int(m[1]) >= trunk) and t != "rope_freqs.weight"]

