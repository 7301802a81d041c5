"""Write Qwen3-Next GGUF files the way llama.cpp lays them out: its converter (conversion/qwen.py,
Qwen3NextModel) for names, transforms and F32/BF16/Q8_0 files, and llama-quantize (src/llama-quant.cpp) for
the Q4_K_M type mix. Used by `ktrans make-tiny --gguf` and by tests that compare a GGUF with its HF directory.

Type choices, as llama.cpp makes them:
- always F32: 1-D tensors (ssm_a, ssm_dt.bias), every *_norm.weight, the routers ffn_gate_inp and
  ffn_gate_inp_shexp (older converters wrote them in F16: `router_type="F16"`), and the [C, K] ssm_conv1d taps;
- f32: everything F32. bf16: other matrices BF16. q8_0: other matrices Q8_0, F16 where a row is not a
  multiple of 32 (the converter's fallback);
- q4_k_m: as `convert --outtype f16` then `llama-quantize Q4_K_M`: Q4_K by default; Q6_K for output.weight,
  and for attn_v / attn_qkv and ffn_down(_exps/_shexp) in the layers llama.cpp's use_more_bits() picks
  (the first and last eighth of the stack and every third layer between); with exactly 8 experts attn_v/attn_qkv
  and attn_k take Q8_0 and attn_output Q5_K. A row length that is not a multiple of 256 falls back as llama.cpp does (Q4_K -> Q5_0,
  Q6_K -> Q8_0, and F16 when not even a multiple of 32).

The DeltaNet input projection is written split (attn_qkv + attn_gate, current llama.cpp) unless
`legacy_ssm_in` asks for the older single ssm_in tensor.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from ktrans.config import FULL_ATTENTION, ModelConfig
from ktrans.weights.gguf import DEFAULT_ALIGNMENT, GGUF_MAGIC, SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_KEY, \
    GGUFModelFile
from ktrans.weights.quants import quant_type, quantize, tensor_nbytes

QUANTS = ("f32", "bf16", "q8_0", "q4_k_m")
DENSE = ("as-quant", "bf16")  # the non-expert tensors: the quant's own choice, or BF16
FILE_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7, "q4_k_m": 15}  # llama_ftype: ALL_F32, MOSTLY_BF16, ...
ARCH = "qwen3next"


# ---------------------------------------------------------------------------------------------- container


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF value type (e.g. Typed(5, [1, 3]) for an INT32 array)."""

    vtype: int
    value: Any


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
       12: "<f8"}


def _infer_type(v: Any) -> int:
    if isinstance(v, bool):
        return 7
    if isinstance(v, int):
        return 4 if 0 <= v < 2**32 else 11
    if isinstance(v, float):
        return 6
    if isinstance(v, str):
        return 8
    if isinstance(v, (list, tuple)):
        return 9
    raise TypeError(f"cannot store {type(v).__name__} in GGUF metadata")


def _encode_value(v: Any) -> bytes:
    """Value type u32 followed by the value."""
    vtype, v = (v.vtype, v.value) if isinstance(v, Typed) else (_infer_type(v), v)
    out = struct.pack("<I", vtype)
    if vtype == 8:
        return out + _encode_string(v)
    if vtype in _FMT:
        return out + struct.pack(_FMT[vtype], v)
    if vtype != 9:
        raise ValueError(f"unknown GGUF value type {vtype}")
    items = list(v)
    etype = (5 if all(isinstance(x, int) and not isinstance(x, bool) for x in items) else _infer_type(items[0])) \
        if items else 5
    out += struct.pack("<IQ", etype, len(items))
    if etype == 8:
        return out + b"".join(_encode_string(s) for s in items)
    if etype in _NP:
        return out + np.asarray(items, dtype=_NP[etype]).tobytes()
    raise ValueError(f"cannot store an array of {type(items[0]).__name__}")


@dataclass
class _PendingTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: int
    produce: Callable[[], np.ndarray]  # the encoded bytes (uint8), called once while writing


class GGUFWriter:
    """A GGUF v3 file written in one pass; tensor data is produced lazily, one tensor at a time."""

    def __init__(self, path: str | Path, alignment: int = DEFAULT_ALIGNMENT):
        self.path, self.alignment = Path(path), alignment
        self.metadata: dict[str, Any] = {}
        self.tensors: list[_PendingTensor] = []
        if alignment != DEFAULT_ALIGNMENT:
            self.metadata["general.alignment"] = Typed(4, alignment)

    def add_tensor(self, name: str, shape: tuple[int, ...], ggml_type: int | str,
                   produce: Callable[[], np.ndarray]) -> None:
        self.tensors.append(_PendingTensor(name, tuple(int(s) for s in shape), quant_type(ggml_type).id, produce))

    def layout(self) -> tuple[bytes, list[int], int]:
        """(header padded to the alignment, each tensor's offset from the data start, data bytes in all)."""
        pad = self._pad
        head = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata))]
        head += [_encode_string(k) + _encode_value(v) for k, v in self.metadata.items()]
        offsets, offset = [], 0
        for t in self.tensors:
            ne = struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *reversed(t.shape))
            head.append(_encode_string(t.name) + ne + struct.pack("<IQ", t.ggml_type, offset))
            offsets.append(offset)
            offset = pad(offset + tensor_nbytes(t.ggml_type, t.shape))
        header = b"".join(head)
        return header + b"\0" * (pad(len(header)) - len(header)), offsets, offset

    def _pad(self, n: int) -> int:
        return -(-n // self.alignment) * self.alignment

    def write(self) -> Path:
        header, _, _ = self.layout()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".part")
        with open(tmp, "wb") as f:
            f.write(header)
            for t in self.tensors:
                data = np.ascontiguousarray(t.produce()).view(np.uint8).reshape(-1)
                want = tensor_nbytes(t.ggml_type, t.shape)
                if data.size != want:
                    raise ValueError(f"tensor {t.name!r}: produced {data.size} bytes, its type and shape need {want}")
                f.write(memoryview(data))
                f.write(b"\0" * (self._pad(want) - want))
        tmp.replace(self.path)
        return self.path


# ---------------------------------------------------------------------------------------------- metadata


def model_metadata(config: ModelConfig, quant: str) -> dict[str, Any]:
    """`general.*` and `qwen3next.*` keys as the converter writes them (plus what ktrans needs to round-trip
    shapes llama.cpp's hyperparameters cannot say: recurrent_layers for irregular stacks, expert_weights_norm)."""
    c = config
    m: dict[str, Any] = {
        "general.architecture": ARCH,
        "general.name": "ktrans random Qwen3-Next",
        "general.file_type": FILE_TYPES[quant],
    }
    if quant not in ("f32", "bf16"):
        m["general.quantization_version"] = 2
    a = f"{ARCH}."
    m.update({
        a + "block_count": c.num_hidden_layers,
        a + "context_length": c.max_position_embeddings,
        a + "embedding_length": c.hidden_size,
        a + "feed_forward_length": c.intermediate_size,
        a + "attention.head_count": c.num_attention_heads,
        a + "attention.head_count_kv": c.num_key_value_heads,
        a + "rope.freq_base": float(c.rope_theta),
        a + "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        a + "expert_count": c.num_experts,
        a + "expert_used_count": c.num_experts_per_tok,
        a + "attention.key_length": c.head_dim,
        a + "attention.value_length": c.head_dim,
        a + "vocab_size": c.vocab_size,
        a + "expert_feed_forward_length": c.moe_intermediate_size,
        a + "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
        a + "expert_weights_norm": bool(c.norm_topk_prob),
        a + "ssm.conv_kernel": c.linear_conv_kernel_dim,
        a + "ssm.state_size": c.linear_key_head_dim,
        a + "ssm.group_count": c.linear_num_key_heads,
        a + "ssm.time_step_rank": c.linear_num_value_heads,
        a + "ssm.inner_size": c.linear_value_dim,
        a + "rope.dimension_count": c.rotary_dim,
    })
    interval = next((k for k in range(1, c.num_hidden_layers + 1)
                     if all((t == FULL_ATTENTION) == ((i + 1) % k == 0) for i, t in enumerate(c.layer_types))), None)
    if interval is not None:
        m[a + "full_attention_interval"] = interval
    else:
        m[a + "attention.recurrent_layers"] = [t != FULL_ATTENTION for t in c.layer_types]
    if c.decoder_sparse_step != 1:
        raise ValueError("GGUF has no decoder_sparse_step; express dense layers with mlp_only_layers")
    return m


# ---------------------------------------------------------------------------------------------- tensors


def gguf_tensors(config: ModelConfig, state: Mapping[str, torch.Tensor], legacy_ssm_in: bool = False,
                 fused_gate_up: bool = False) -> Iterator[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(GGUF name, shape, fp32 producer) for every tensor, with the converter's transforms applied."""
    c = config

    def hf(name: str) -> Callable[[], np.ndarray]:
        return lambda: state[name].detach().float().numpy()

    def plus_one(name: str) -> Callable[[], np.ndarray]:
        return lambda: state[name].detach().float().numpy() + np.float32(1)

    def shape(name: str) -> tuple[int, ...]:
        return tuple(state[name].shape)

    def stacked(p: str, kinds: tuple[str, ...]) -> Callable[[], np.ndarray]:
        return lambda: np.stack([np.concatenate([state[f"{p}.experts.{e}.{k}_proj.weight"].detach().float().numpy()
                                                 for k in kinds]) for e in range(c.num_experts)])

    yield "token_embd.weight", shape("model.embed_tokens.weight"), hf("model.embed_tokens.weight")
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        yield f"{b}.attn_norm.weight", shape(f"{p}.input_layernorm.weight"), plus_one(f"{p}.input_layernorm.weight")
        if c.layer_types[i] == FULL_ATTENTION:
            a = f"{p}.self_attn"
            for g, n in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                yield f"{b}.{g}.weight", shape(f"{a}.{n}.weight"), hf(f"{a}.{n}.weight")
            yield f"{b}.attn_q_norm.weight", shape(f"{a}.q_norm.weight"), plus_one(f"{a}.q_norm.weight")
            yield f"{b}.attn_k_norm.weight", shape(f"{a}.k_norm.weight"), plus_one(f"{a}.k_norm.weight")
        else:
            la = f"{p}.linear_attn"
            qkvz = f"{la}.in_proj_qkvz.weight"
            if legacy_ssm_in:
                yield f"{b}.ssm_in.weight", shape(qkvz), hf(qkvz)
            else:
                h = c.hidden_size
                yield f"{b}.attn_qkv.weight", (c.conv_dim, h), lambda qkvz=qkvz: _split_qkvz(c, state[qkvz])[0]
                yield f"{b}.attn_gate.weight", (c.linear_value_dim, h), lambda qkvz=qkvz: _split_qkvz(c, state[qkvz])[1]
            yield f"{b}.ssm_ba.weight", shape(f"{la}.in_proj_ba.weight"), hf(f"{la}.in_proj_ba.weight")
            conv = f"{la}.conv1d.weight"
            yield f"{b}.ssm_conv1d.weight", (c.conv_dim, c.linear_conv_kernel_dim), \
                lambda conv=conv: state[conv].detach().float().numpy().reshape(c.conv_dim, -1)
            yield f"{b}.ssm_dt.bias", shape(f"{la}.dt_bias"), hf(f"{la}.dt_bias")
            yield f"{b}.ssm_a", shape(f"{la}.A_log"), lambda n=f"{la}.A_log": -np.exp(state[n].detach().float().numpy())
            yield f"{b}.ssm_norm.weight", shape(f"{la}.norm.weight"), hf(f"{la}.norm.weight")
            yield f"{b}.ssm_out.weight", shape(f"{la}.out_proj.weight"), hf(f"{la}.out_proj.weight")
        post = f"{p}.post_attention_layernorm.weight"
        yield f"{b}.post_attention_norm.weight", shape(post), plus_one(post)
        m = f"{p}.mlp"
        if c.is_moe_layer(i):
            e, f, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
            yield f"{b}.ffn_gate_inp.weight", shape(f"{m}.gate.weight"), hf(f"{m}.gate.weight")
            if fused_gate_up:
                yield f"{b}.ffn_gate_up_exps.weight", (e, 2 * f, h), stacked(m, ("gate", "up"))
            else:
                yield f"{b}.ffn_gate_exps.weight", (e, f, h), stacked(m, ("gate",))
                yield f"{b}.ffn_up_exps.weight", (e, f, h), stacked(m, ("up",))
            yield f"{b}.ffn_down_exps.weight", (e, h, f), stacked(m, ("down",))
            yield f"{b}.ffn_gate_inp_shexp.weight", shape(f"{m}.shared_expert_gate.weight"), \
                hf(f"{m}.shared_expert_gate.weight")
            for k in ("gate", "up", "down"):
                n = f"{m}.shared_expert.{k}_proj.weight"
                yield f"{b}.ffn_{k}_shexp.weight", shape(n), hf(n)
        else:
            for k in ("gate", "up", "down"):
                yield f"{b}.ffn_{k}.weight", shape(f"{m}.{k}_proj.weight"), hf(f"{m}.{k}_proj.weight")
    yield "output_norm.weight", shape("model.norm.weight"), plus_one("model.norm.weight")
    if "lm_head.weight" in state and not c.tie_word_embeddings:
        yield "output.weight", shape("lm_head.weight"), hf("lm_head.weight")


def _split_qkvz(c: ModelConfig, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """HF in_proj_qkvz (grouped per key head) -> attn_qkv rows [all q | all k | all v] and attn_gate (z)."""
    nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = c.linear_num_value_heads // nk
    w = w.detach().float().numpy()
    g = w.reshape(nk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    h = w.shape[-1]
    return np.concatenate([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]), z.reshape(-1, h)


# ---------------------------------------------------------------------------------------------- types


def _use_more_bits(i: int, n: int) -> bool:
    # llama-quant.cpp: the first and last eighth of the layers, and every third one in between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qtype: str, ncols: int) -> str:
    """llama-quant.cpp tensor_type_fallback: rows that do not fill whole blocks take a smaller-block type."""
    if ncols % quant_type(qtype).block_size == 0:
        return qtype
    qtype = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}.get(qtype, qtype)
    return qtype if ncols % quant_type(qtype).block_size == 0 else "F16"


def choose_types(tensors: list[tuple[str, tuple[int, ...]]], quant: str, n_layers: int,
                 router_type: str = "F32", dense: str = "as-quant") -> dict[str, str]:
    """ggml type name for each (GGUF name, shape), as llama.cpp's converter / llama-quantize would pick it.
    dense="bf16" keeps every tensor but the routed experts (`*_exps`) as a bf16 file has it (a Q4_K_M file with
    BF16 dense layers, as `llama-quantize --tensor-type` makes one)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if dense not in DENSE:
        raise ValueError(f"dense must be one of {DENSE}, got {dense!r}")
    if dense == "bf16":
        if quant != "q4_k_m":
            raise ValueError("dense='bf16' keeps the non-expert tensors of a q4_k_m file in BF16; use it with q4_k_m")
        experts = choose_types(tensors, quant, n_layers, router_type)
        rest = choose_types(tensors, "bf16", n_layers, router_type)
        return {n: experts[n] if "_exps." in n else rest[n] for n, _ in tensors}
    # llama-quantize visits tensors ordered by (layer, name); attn_v-like tensors are counted in that order
    def order(name: str) -> tuple[int, str]:
        return (int(name.split(".")[1]) if name.startswith("blk.") else -1, name)
    attn_v_like = sorted((n for n, _ in tensors if n.endswith(("attn_v.weight", "attn_qkv.weight"))), key=order)
    tied = all(n != "output.weight" for n, _ in tensors)
    n_experts = next((shape[0] for n, shape in tensors if "_exps." in n), 0)
    out = {}
    for name, shape in tensors:
        ncols = shape[-1]
        if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):  # the converter keeps both F32
            out[name] = router_type
        elif len(shape) == 1 or name.endswith(("_norm.weight", "ssm_conv1d.weight")) or quant == "f32":
            out[name] = "F32"
        elif quant == "bf16":
            out[name] = "BF16"
        elif quant == "q8_0":
            out[name] = "Q8_0" if ncols % 32 == 0 else "F16"
        elif sum(s > 1 for s in shape) < 2:  # ggml_n_dims < 2: llama-quantize leaves it as converted (F16)
            out[name] = "F16"
        else:
            # with tied embeddings llama-quantize gives token_embd the output tensor's type
            as_name = "output.weight" if tied and name == "token_embd.weight" else name
            out[name] = _q4_k_m_type(as_name, ncols, attn_v_like, n_layers, n_experts)
    return out


def _q4_k_m_type(name: str, ncols: int, attn_v_like: list[str], n_layers: int, n_experts: int) -> str:
    # llama-quant.cpp (llama.cpp vendored in llama-cpp-python 0.3.36), checked against its llama-quantize on
    # 48-layer qwen3next files with 8 and 16 experts and short rows
    if name == "output.weight":
        return _fallback("Q6_K", ncols)
    new = "Q4_K"
    if name.endswith(("attn_v.weight", "attn_qkv.weight")):  # one counter over both (category_is_attn_v)
        if n_experts == 8:  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
            new = "Q8_0"
        elif _use_more_bits(attn_v_like.index(name), len(attn_v_like)):
            new = "Q6_K"
    elif name.endswith("attn_k.weight") and n_experts == 8:
        new = "Q8_0"
    elif name.endswith("attn_output.weight") and n_experts == 8:
        new = "Q5_K"
    elif "ffn_down" in name and _use_more_bits(int(name.split(".")[1]), n_layers):  # n: the layer count, not
        new = "Q6_K"  # the number of ffn_down tensors; the layer comes from the name
    return _fallback(new, ncols)


# ---------------------------------------------------------------------------------------------- files


def write_gguf(path: str | Path, config: ModelConfig, state: Mapping[str, torch.Tensor], quant: str = "f32",
               legacy_ssm_in: bool = False, fused_gate_up: bool = False, router_type: str = "F32", dense: str = "as-quant",
               extra_metadata: Mapping[str, Any] | None = None, drop_metadata: tuple[str, ...] = (),
               extra_tensors: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write `state` (HF names, the plain model's parameters) as a GGUF. extra_metadata carries the vocabulary
    (ktrans.tokenizer.gguf.gguf_tokenizer_metadata) and, with drop_metadata and extra_tensors (written F32), lets
    tests imitate other writers (older keys, multi-token-prediction blocks). ktrans.model.convert adds the
    tokenizer of an HF directory."""
    tensors = list(gguf_tensors(config, state, legacy_ssm_in, fused_gate_up))
    n_all = int((extra_metadata or {}).get(f"{ARCH}.block_count", config.num_hidden_layers))
    types = choose_types([(n, s) for n, s, _ in tensors], quant, n_all, router_type, dense)
    w = GGUFWriter(path)
    w.metadata.update(model_metadata(config, quant))
    w.metadata.update(extra_metadata or {})
    for k in drop_metadata:
        w.metadata.pop(k, None)
    for name, shape, produce in tensors:
        w.add_tensor(name, shape, types[name], lambda p=produce, t=types[name]: quantize(p(), t))
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr.shape, "F32", lambda a=arr: np.asarray(a, np.float32))
    return w.write()


def split_gguf(path: str | Path, n_shards: int) -> list[Path]:
    """Re-write a GGUF as llama-gguf-split does: `-0000i-of-0000N.gguf` shards, the first with all metadata,
    every one with split.no / split.count / split.tensors.count, tensors dealt out in order."""
    src = GGUFModelFile(path)
    names = list(src.tensors)
    per = -(-len(names) // n_shards)
    stem = Path(path).with_suffix("")
    out = []
    for s in range(n_shards):
        w = GGUFWriter(f"{stem}-{s + 1:05d}-of-{n_shards:05d}.gguf")
        if s == 0:
            types = src.files[0].value_types
            w.metadata.update({k: Typed(types[k], v) if types[k] != 9 else v for k, v in src.metadata.items()})
        w.metadata.update({SPLIT_NO_KEY: Typed(2, s), SPLIT_COUNT_KEY: Typed(2, n_shards),
                           SPLIT_TENSORS_KEY: Typed(5, len(names))})
        for name in names[s * per:(s + 1) * per]:
            info = src.tensors[name]
            w.add_tensor(name, info.shape, info.ggml_type, lambda n=name: src.raw(n))
        out.append(w.write())
    return out


def tensor_census(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> ggml type name (for tests and reports)."""
    return {n: i.type_name for n, i in GGUFModelFile(path).tensors.items()}
