"""The placement report of `ktrans rules show`: what each module group becomes, where it runs, what it costs.

It injects a meta-device model (no weights read, no device required: a GPU rule file can be inspected on a CPU
box), then groups modules that differ only in layer index (`model.layers.{0..47}.mlp.experts`). Weight bytes are
GGUF-like: matrices at --weight_dtype (bf16, or a GGUF quant such as q4_k), while what llama.cpp keeps in F32
(norms, routers, the DeltaNet conv and gates) counts 4 bytes. With a GGUF file (`tensor_type`), each tensor counts
at the type the file stores it in (Q4_K_M mixes Q4_K, Q6_K and F32), unless --weight_dtype is given, or unless the
op holding it dequantizes it into the model dtype (KLinearTorch, KExpertsTorch: registered with float_weights),
which then counts as bf16. KV memory
counts only the full-attention layers; DeltaNet state is per slot, one slot per running request (--max_batch_size).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Callable


from ktrans.config import ModelConfig
from ktrans.inject.injector import Injection, Placed, inject, plain_specs
from ktrans.inject.rules import RuleSet
from ktrans.model.qwen3_next import Qwen3NextAttention, Qwen3NextGatedDeltaNet
from ktrans.operators.attention import KQwen3NextAttention
from ktrans.operators.base import ParamSpec, canonical_device
from ktrans.operators.gdn import KQwen3NextGatedDeltaNet
from ktrans.runtime.batch import GENERATE, PREFILL

FROM_FILE = "gguf"  # weight_dtype: each tensor at its type in the GGUF file
FLOAT_BYTES = {"f32": 4.0, "float32": 4.0, "f16": 2.0, "float16": 2.0, "bf16": 2.0, "bfloat16": 2.0}


def bytes_per_element(dtype: str) -> float:
    """bf16/f16/f32, or a GGUF quant type (q4_k, q8_0, ...) at its block size."""
    key = dtype.lower()
    if key in FLOAT_BYTES:
        return FLOAT_BYTES[key]
    from ktrans.weights.quants import QUANT_BY_NAME

    qt = QUANT_BY_NAME.get(dtype.upper())
    if qt is None:
        raise ValueError(f"unknown weight dtype {dtype!r}: use bf16, f16, f32 or a GGUF type "
                         f"({', '.join(sorted(n.lower() for n in QUANT_BY_NAME))})")
    return qt.type_size / qt.block_size


def spec_bytes(spec: ParamSpec, weight_bpe: float, tensor_type: Callable[[str], str] | None = None) -> int:
    """Bytes of one tensor: at the type its file stores it in when `tensor_type` knows it, else GGUF-like."""
    if tensor_type is not None:
        try:
            return int(spec.numel * bytes_per_element(tensor_type(spec.name)))
        except ValueError:  # not in the file (GGUFError), or a type without a size here: the rule below
            pass
    return int(spec.numel * (4.0 if spec.gguf_float else weight_bpe))


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def compress(indices: list[int]) -> str:
    """[0..47] -> '0..47'; [3, 7, ..., 47] -> '3,7,..,47'; otherwise runs joined by commas."""
    xs = sorted(set(indices))
    if len(xs) == 1:
        return str(xs[0])
    steps = {b - a for a, b in zip(xs, xs[1:])}
    if steps == {1}:
        return f"{xs[0]}..{xs[-1]}"
    if len(steps) == 1 and len(xs) > 3:
        return f"{xs[0]},{xs[1]},..,{xs[-1]}"
    runs, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            runs.append((start, a))
            start = b
    text = [str(a) if a == b else f"{a}..{b}" for a, b in runs]
    # The DeltaNet layers 0..2,4..6,...,44..46: equal runs at equal strides read better as a pattern.
    if len(runs) > 3 and len({b - a for a, b in runs}) == 1 and len({b[0] - a[0] for a, b in zip(runs, runs[1:])}) == 1:
        return f"{text[0]},{text[1]},..,{text[-1]}"
    return ",".join(text)


@dataclass
class Row:
    pattern: str
    indices: list[tuple[int, ...]]  # the numbers each member has where the pattern has {}
    kind: str                 # operator class, or "kept <class>"
    rule: int | None
    prefill: str
    generate: str
    out: str
    bytes: int = 0

    @property
    def name(self) -> str:
        parts = self.pattern.split("{}")
        out = parts[0]
        for i, rest in enumerate(parts[1:]):
            out += "{" + compress([ix[i] for ix in self.indices]) + "}" + rest
        return out

    def to_json(self) -> dict:
        return {"module": self.name, "count": len(self.indices), "class": self.kind, "rule": self.rule,
                "prefill": self.prefill, "generate": self.generate, "out_device": self.out, "bytes": self.bytes}


@dataclass
class Report:
    rules: str
    config: str
    default_device: str
    weight_dtype: str
    kv_dtype: str
    cache_lens: int
    max_batch_size: int
    page_size: int = 16
    snapshot_slots: int = 0
    rows: list[Row] = field(default_factory=list)
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> {weights, kv, state}
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        mem = {d: {**m, "total": sum(m.values())} for d, m in self.memory.items()}
        return {"rules": self.rules, "config": self.config, "default_device": self.default_device,
                "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype, "cache_lens": self.cache_lens,
                "max_batch_size": self.max_batch_size, "page_size": self.page_size,
                "snapshot_slots": self.snapshot_slots, "kv_tokens": kv_tokens(self.cache_lens, self.page_size),
                "state_slots": state_slots(self.max_batch_size, self.snapshot_slots),
                "modules": [r.to_json() for r in self.rows],
                "memory": mem, "warnings": self.warnings, "notes": self.notes}

    def text(self) -> str:
        head = ("rule", "module", "class", "prefill", "generate", "out", "weights")
        body = [(str(r.rule) if r.rule else "-", r.name, r.kind, r.prefill, r.generate, r.out, human(r.bytes))
                for r in self.rows]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        lines = [f"rules: {self.rules}", f"model: {self.config}", f"default device: {self.default_device}", "",
                 fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body), ""]
        weights = (f"as stored in {self.config}" if self.weight_dtype == FROM_FILE else
                   f"matrices {self.weight_dtype}, norms/routers/conv f32")
        slots = state_slots(self.max_batch_size, self.snapshot_slots)
        lines.append(f"memory (weights: {weights}; KV cache {self.kv_dtype} for --cache_lens {self.cache_lens} in "
                     f"pages of {self.page_size}: {kv_tokens(self.cache_lens, self.page_size)} tokens with the pad "
                     f"page; DeltaNet state {slots} slots: --max_batch_size {self.max_batch_size}, "
                     f"{self.snapshot_slots} prefix-cache snapshots, 1 pad):")
        for dev, m in self.memory.items():
            lines.append(f"  {dev:8} weights {human(m['weights']):>10}   kv {human(m['kv']):>10}   "
                         f"state {human(m['state']):>10}   total {human(sum(m.values())):>10}")
        lines += [f"note: {n}" for n in self.notes] + [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def _describe(p: Placed, phase: str) -> str:
    dev = str(p.devices[phase])
    op = p.operator
    if op is None or op.OPS is None:
        return dev
    name = op.op_names[phase]
    mark = "" if op.OPS.built(name) else "*"
    return f"{dev} {name}{mark}" + (" (streamed)" if op.streams(phase) else "")


def _float_weights(op, device) -> bool:
    """Whether the op(s) holding `op`'s weights on `device` keep them as floats in the model dtype (KLinearTorch,
    KExpertsTorch) rather than as the file stores them."""
    if op is None or op.OPS is None:
        return False
    names = {op.op_names[p] for p in (PREFILL, GENERATE) if op.devices[p] == device and not op.streams(p)}
    return any(getattr(op.OPS.info(n), "float_weights", False) for n in names if n)


@functools.lru_cache(maxsize=2)
def meta_model(config: ModelConfig):
    """The meta tree of `config`, kept for the next report: the 80B tree has ~99k modules and takes seconds to
    build, while a dry-run injection over it takes a fraction of a second and leaves it unchanged."""
    from ktrans.model.source import build_model

    return build_model(config)


def kv_tokens(cache_lens: int, page_size: int) -> int:
    """KV rows the engine allocates for --cache_lens: whole pages, plus the pad page that a padded decode batch's
    pad rows write (runtime.pools.KVPool); none without a cache."""
    return (-(-cache_lens // page_size) + 1) * page_size if cache_lens > 0 else 0


def state_slots(max_batch_size: int, snapshot_slots: int) -> int:
    """DeltaNet state slots the engine allocates: one per running request, the prefix cache's snapshots, and the pad
    slot of padded decode batches (runtime.pools.StatePool)."""
    return max_batch_size + snapshot_slots + 1


def placement_report(config: ModelConfig, rules: RuleSet, config_name: str = "", cache_lens: int = 4096,
                     max_batch_size: int = 1, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                     default_device: str | None = None, tensor_type: Callable[[str], str] | None = None,
                     page_size: int = 16, snapshot_slots: int = 0) -> Report:
    """The report; `tensor_type(hf_name)` gives a tensor's stored type (a GGUF file's) when weight_dtype is
    FROM_FILE. KV and state memory are what an engine with these --cache_lens, --page_size, --max_batch_size and
    prefix-cache snapshot slots allocates (kv_tokens, state_slots)."""
    bpe = bytes_per_element("bf16" if weight_dtype == FROM_FILE else weight_dtype)  # flag errors before the slow part
    if weight_dtype != FROM_FILE:
        tensor_type = None
    kv_bpe = bytes_per_element(kv_dtype)
    inj = inject(meta_model(config), rules, default_device, dry_run=True)
    report = Report(rules.source, config_name, str(inj.default_device), weight_dtype, kv_dtype, cache_lens,
                    max_batch_size, page_size, snapshot_slots)
    rows_kv, slots = kv_tokens(cache_lens, page_size), state_slots(max_batch_size, snapshot_slots)
    mem: dict[str, dict[str, int]] = {}

    def add(device, what: str, n: int) -> None:
        mem.setdefault(str(device), {"weights": 0, "kv": 0, "state": 0})[what] += n

    plain = {}
    for spec, dev in plain_specs(inj):
        plain.setdefault(spec.name.rpartition(".")[0], []).append(spec)
    groups: dict[tuple, Row] = {}
    staged: dict[str, int] = {}  # device -> one layer's experts (KExpertsSplit streams at most two layers' shares)
    for p in inj.placed:
        op = p.operator
        if op is not None:
            devices, specs = op.resident_devices(), op.param_specs()
        else:
            specs = plain.get(p.name, [])
            devices = [p.module._ktrans_device]
            if p.rule is None and not specs and not p.module._buffers:
                continue  # a container (decoder layer, ModuleList): nothing of its own to place
        per_dev = [sum(spec_bytes(s, bpe, None if _float_weights(op, dev) else tensor_type) for s in specs)
                   for dev in devices]
        for dev, n in zip(devices, per_dev):
            add(dev, "weights", n)
        kind = type(op).__name__ if op is not None else f"kept {p.orig_class}"
        out = (str(op.out_devices[GENERATE]) if op is not None and op.explicit_out else
               str(p.out_devices[GENERATE]) if op is None and p.rule is not None and "out_device" in p.rule.kwargs
               else "caller")
        idx = tuple(int(m) for m in _INDEX.findall(p.name))
        pattern = _INDEX.sub(".{}", p.name)
        key = (pattern, kind, p.rule.index if p.rule else None, _describe(p, PREFILL), _describe(p, GENERATE), out)
        row = groups.get(key)
        if row is None:
            row = groups[key] = Row(pattern, [], kind, key[2], key[3], key[4], out)
        row.indices.append(idx)
        row.bytes += sum(per_dev)
        gpu_n = int(p.rule.kwargs.get("gpu_experts") or 0) if p.rule is not None and op is not None else 0
        if gpu_n and op.op_names.get(GENERATE) == "KExpertsCPU" and getattr(op, "num_experts", 0):
            # KExpertsCPU's `gpu_experts`: those experts a second time, on the GPU (the file's bytes of them: the
            # packed planes differ by a few percent, e.g. 4.625 bits a Q4_K weight against 4.5)
            gpu_dev = canonical_device(p.rule.kwargs.get("gpu_device") or "cuda")
            add(gpu_dev, "weights", sum(per_dev) * min(gpu_n, op.num_experts) // op.num_experts)
        if op is not None and op.op_names.get(PREFILL) == "KExpertsSplit":
            dev = str(op.devices[PREFILL])
            staged[dev] = max(staged.get(dev, 0), sum(per_dev))
    report.rows = list(groups.values())

    for p in inj.placed:
        m = p.module
        attn = isinstance(m, (KQwen3NextAttention, Qwen3NextAttention))
        gdn = isinstance(m, (KQwen3NextGatedDeltaNet, Qwen3NextGatedDeltaNet))
        if not (attn or gdn):
            continue
        dev = p.devices[GENERATE]
        if attn:
            add(dev, "kv", int(2 * config.num_key_value_heads * config.head_dim * kv_bpe * rows_kv))
        else:
            conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * kv_bpe
            ssm = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
            add(dev, "state", int((conv + ssm) * slots))
    report.memory = dict(sorted(mem.items()))
    report.warnings = [f"rule {r.index}{f' (line {r.line})' if r.line else ''} {why}"
                       for r, why in inj.unused_rules()]
    if any("*" in r.prefill or "*" in r.generate for r in report.rows):
        report.notes.append("* this op is not built in this install yet: building the model with these rules "
                            "fails until it is (the report still shows the placement)")
    if any("(streamed)" in r.prefill for r in report.rows):
        report.notes.append("(streamed): prefill runs on another device than decode and reads those weights from "
                            "the checkpoint per call; memory is planned for the decode placement")
    for dev, n in staged.items():
        report.notes.append(f"KExpertsSplit: long prefill steps stage at most two layers' GPU share of the experts on "
                            f"{dev} at once, up to {2 * n / 2**30:.1f} GiB, outside the figures above")
    return report


__all__ = ["Report", "Row", "placement_report", "compress", "bytes_per_element", "Injection"]
