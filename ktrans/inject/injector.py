"""Apply a rule set to a module tree built on the meta device, then let every operator load its own weights.

The walk is pre-order over HF module names. For each module the first rule (in file order) that matches wins:
an operator replaces the module under the same name, `class: default` keeps it and only places it, and
`recursive: false` stops rules from reaching the module's children (they stay as they are, on its device).
A module no rule matches inherits the device of its nearest placed ancestor; the root has the default device
(cuda:0 if any rule uses CUDA, else cpu, unless given). The tree's layers with math (norms, RoPE, attention,
DeltaNet, MoE block, MLPs, experts) are skeletons whose math lives only in their operators: one that no rule
replaces (or that a `default` rule keeps) gets its operator with the default op on the device it would have had.

Every placed module hands its output back on its caller's device unless its rule sets out_device, so the
residual stream stays on the device of the plain code that adds to it. Operators move tensors themselves; kept
(plain) modules get forward hooks that do the same, installed only when the placement spans several devices.

`build_injected_model` does it all: validate devices (a rule that needs a missing GPU fails here, never falls
back), build on meta, inject, build the ops (an op not built yet fails here, before any weight is read), load.
`ktrans.inject.load_model` calls it for a ModelSource, with the default rules when none are given.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ktrans.config import ModelConfig
from ktrans.inject.rules import Rule, RuleError, RuleSet, check_devices, load_rules, missing_device, phase_devices
from ktrans.model.qwen3_next import Qwen3NextAttention, Qwen3NextForCausalLM, Qwen3NextGatedDeltaNet, is_skeleton
from ktrans.operators import OPERATORS, BaseOperator, Op, OpNotBuiltError, ParamSpec
from ktrans.operators.attention import KQwen3NextAttention
from ktrans.operators.base import canonical_device, move
from ktrans.operators.gdn import KQwen3NextGatedDeltaNet
from ktrans.runtime.batch import GENERATE, PHASES, PREFILL, current_phase
from ktrans.weights.source import WeightSource

log = logging.getLogger(__name__)


@dataclass
class Placed:
    """Where the injector put one module (pre-order; one entry per module of the tree except the root)."""

    name: str
    module: nn.Module                  # the module now in the tree
    orig_class: str                    # class of the module the rule saw
    rule: Rule | None                  # the rule that won, None when inherited
    devices: dict[str, torch.device]   # phase -> where it runs
    out_devices: dict[str, torch.device]

    @property
    def operator(self) -> BaseOperator | None:
        return self.module if isinstance(self.module, BaseOperator) else None


@dataclass
class Injection:
    rules: RuleSet
    default_device: torch.device
    placed: list[Placed] = field(default_factory=list)
    hits: dict[int, int] = field(default_factory=dict)   # rule index -> modules it matched
    wins: dict[int, int] = field(default_factory=dict)   # rule index -> modules it placed (first match)

    def operators(self) -> list[Placed]:
        return [p for p in self.placed if p.operator is not None]

    def unused_rules(self) -> list[tuple[Rule, str]]:
        """Rules that placed no module, with why: they match nothing, or only what earlier rules took."""
        out = []
        for rule in self.rules:
            if not self.wins.get(rule.index):
                why = ("matches only modules an earlier rule already placed" if self.hits.get(rule.index)
                       else "matches no module")
                out.append((rule, why))
        return out

    def layer_devices(self) -> dict[int, torch.device]:
        """Layer index -> where its attention or DeltaNet runs (so where its pool part goes), also for a dry run."""
        return {p.module.layer_idx: p.devices[GENERATE] for p in self.placed
                if isinstance(p.module, (KQwen3NextAttention, Qwen3NextAttention, KQwen3NextGatedDeltaNet,
                                         Qwen3NextGatedDeltaNet))}

    def devices(self) -> list[torch.device]:
        seen = {self.default_device}
        for p in self.placed:
            seen.update(p.devices.values())
            seen.update(p.out_devices.values())
        return sorted(seen, key=str)


def default_device_for(rules: RuleSet) -> str:
    return "cuda:0" if any(d.startswith("cuda") for d in rules.devices()) else "cpu"


def inject(model: Qwen3NextForCausalLM, rules: RuleSet, default_device: str | None = None,
           dry_run: bool = False) -> Injection:
    """Replace and place modules of `model` (on meta or real) in place. No weights are read.

    dry_run: decide and record the placement (operators are constructed) but leave the tree unchanged, so one meta
    tree can be reported on under several rule files.
    """
    default = torch.device(canonical_device(default_device or default_device_for(rules)))
    injection = Injection(rules, default)
    root = {p: default for p in PHASES}
    model._ktrans_device, model._ktrans_out = default, dict(root)
    _walk(model, "", root, model.config, injection, match=True, replace=not dry_run)
    if len(injection.devices()) > 1 and not dry_run:
        _install_hooks(model, injection)
    return injection


def _walk(module: nn.Module, prefix: str, parent: dict, config: ModelConfig, inj: Injection, match: bool,
          replace: bool) -> None:
    for cname, child in list(module.named_children()):
        if isinstance(child, Op):
            continue  # an operator's own implementation, not part of the model tree
        name = f"{prefix}.{cname}" if prefix else cname
        rule = None
        if match:
            for r in inj.rules:
                if r.matches(name, child):
                    inj.hits[r.index] = inj.hits.get(r.index, 0) + 1
                    rule = rule or r
            if rule is not None:
                inj.wins[rule.index] = inj.wins.get(rule.index, 0) + 1
        orig_class = type(child).__name__
        if rule is not None and rule.replace is not None:
            new = _make_operator(rule, name, child, config, parent)
            if replace:
                setattr(module, cname, new)
            inj.placed.append(Placed(name, new, orig_class, rule, dict(new.devices), dict(new.out_devices)))
            _walk(new, name, dict(new.devices), config, inj, match=rule.recursive, replace=replace)
            continue
        # Kept as it is: by a `default` rule (with its devices) or by no rule (inheriting its parent's).
        kw = rule.kwargs if rule is not None else {}
        # A kept module has one device; under a parent that differs by phase, the decode placement wins.
        pre, gen = phase_devices(kw, str(parent[GENERATE]))
        dev = torch.device(gen)
        out = kw.get("out_device")
        outs = {p: torch.device(canonical_device(out)) if out else parent[p] for p in PHASES}
        stand_in = default_operator(child)
        if stand_in is not None:
            # A skeleton (its math is its operator's) that no rule replaced: its default operator, placed there.
            new = stand_in(name, child, config, prefill_device=str(dev), generate_device=str(dev))
            new.out_devices = outs
            if replace:
                setattr(module, cname, new)
            inj.placed.append(Placed(name, new, orig_class, rule, dict(new.devices), dict(outs)))
            _walk(new, name, dict(new.devices), config, inj, match=match and (rule is None or rule.recursive),
                  replace=replace)
            continue
        child._ktrans_device, child._ktrans_out = dev, outs
        inj.placed.append(Placed(name, child, orig_class, rule, {p: dev for p in PHASES}, outs))
        _walk(child, name, {p: dev for p in PHASES}, config, inj, match=match and (rule is None or rule.recursive),
              replace=replace)


def default_operator(module: nn.Module) -> type[BaseOperator] | None:
    """The operator that stands in for a skeleton module of the tree (one whose math exists only in its operator),
    with its default op, when no rule replaces it; None for modules that run as they are (torch.nn layers, the
    decoder layer's plumbing)."""
    if not is_skeleton(module):
        return None
    found = {op for op in OPERATORS.values() if type(module) in op.REPLACES}
    return found.pop() if len(found) == 1 else None


def _make_operator(rule: Rule, name: str, orig: nn.Module, config: ModelConfig, parent: dict) -> BaseOperator:
    op_class = rule.replace
    if not isinstance(orig, op_class.REPLACES):
        wants = ", ".join(c.__name__ for c in op_class.REPLACES)
        raise RuleError(f"{rule.where}: replace.class: {op_class.__name__} replaces {wants} modules, but {name} "
                        f"is a {type(orig).__name__}; narrow match.name or add match.class")
    kwargs = dict(rule.kwargs)
    pre, gen = phase_devices(kwargs, None)
    kwargs["prefill_device"] = pre or str(parent[PREFILL])
    kwargs["generate_device"] = gen or str(parent[GENERATE])
    try:
        op = op_class(name, orig, config, **kwargs)
    except (ValueError, TypeError) as e:
        raise RuleError(f"{rule.where}: {name}: {e}") from None
    if not op.explicit_out:
        op.out_devices = dict(parent)  # hand the output back to the caller
    return op


# ---- device moves for kept modules ---------------------------------------------------------------------------------


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    return move(args, module._ktrans_device), move(kwargs, module._ktrans_device)


def _post_hook(module: nn.Module, args: tuple, out):
    return move(out, module._ktrans_out[current_phase()])


def _install_hooks(model: nn.Module, inj: Injection) -> None:
    for m in [model] + [p.module for p in inj.placed if p.operator is None]:
        if hasattr(m, "_ktrans_hooks"):
            continue
        m._ktrans_hooks = (m.register_forward_pre_hook(_pre_hook, with_kwargs=True),
                           m.register_forward_hook(_post_hook))


# ---- weights -------------------------------------------------------------------------------------------------------


def plain_specs(inj: Injection) -> list[tuple[ParamSpec, torch.device]]:
    """Parameters of kept modules (their own, not their children's), with the device each goes to."""
    out = []
    for p in inj.placed:
        if p.operator is None:
            for pname, param in p.module.named_parameters(recurse=False):
                out.append((ParamSpec(f"{p.name}.{pname}", tuple(param.shape)), p.module._ktrans_device))
    return out


def progress(items, total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr when enabled."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="module", dynamic_ncols=True, leave=False)


def load_weights(model: nn.Module, inj: Injection, source: WeightSource, dtype: torch.dtype,
                 show_progress: bool = False) -> None:
    for p in inj.operators():
        try:
            p.operator.build_ops(source)  # before any tensor is read: a missing op fails fast
        except OpNotBuiltError as e:
            raise RuleError(f"{p.rule.where}: {p.name}: {e}") from None
    ops = inj.operators()
    for p in progress(ops, len(ops), f"loading {source.description}", show_progress):
        p.operator.load(source, dtype)
    for spec, device in plain_specs(inj):
        module_name, _, attr = spec.name.rpartition(".")
        module = model.get_submodule(module_name)
        module._parameters[attr] = nn.Parameter(source.require(spec.name, spec.shape, spec.load_dtype(dtype), device),
                                                requires_grad=False)
    for p in inj.placed:
        if p.operator is None:
            for bname, buf in list(p.module._buffers.items()):
                if buf is not None:
                    if buf.is_meta:
                        raise RuleError(f"buffer {p.name}.{bname} was left on the meta device")
                    p.module._buffers[bname] = buf.to(p.module._ktrans_device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuleError(f"{len(left)} tensors were left on the meta device, e.g. {left[:3]}")
    wanted = {s.name for p in ops for s in p.operator.param_specs()} | {s.name for s, _ in plain_specs(inj)}
    extra = source.unused(wanted)
    if extra:
        log.warning("%s: %d tensors not used by the model, e.g. %s", source.description, len(extra), extra[:3])


def build_injected_model(config: ModelConfig, rules: RuleSet | str | Path, source: WeightSource,
                dtype: torch.dtype = torch.float32, default_device: str | None = None,
                show_progress: bool = False) -> tuple[Qwen3NextForCausalLM, Injection]:
    """The injected, loaded model. Devices are checked first: no silent fallback to the CPU."""
    from ktrans.model.source import build_model as build_meta

    rules = rules if isinstance(rules, RuleSet) else load_rules(rules)
    check_devices(rules)
    if default_device is not None and missing_device(default_device):
        raise RuleError(f"default device: {missing_device(default_device)}")
    model = build_meta(config)
    injection = inject(model, rules, default_device)
    load_weights(model, injection, source, dtype, show_progress)
    return model.eval(), injection


def layer_devices(model: nn.Module) -> dict[int, torch.device]:
    """Layer index -> the device its attention or DeltaNet runs on, hence where that layer's KV pages or DeltaNet
    slots live (ktrans.runtime.pools.make_kv_pool / make_state_pool build a pool per device from it)."""
    out: dict[int, torch.device] = {}
    for m in model.modules():
        if isinstance(m, (KQwen3NextAttention, Qwen3NextAttention, KQwen3NextGatedDeltaNet, Qwen3NextGatedDeltaNet)):
            dev = m.devices[GENERATE] if isinstance(m, BaseOperator) else getattr(m, "_ktrans_device", None)
            if dev is None:
                dev = next((p.device for p in m.parameters()), torch.device("cpu"))
            out[m.layer_idx] = dev
    return out


def pool_devices(model: nn.Module) -> tuple[torch.device, torch.device]:
    """(KV pool device, DeltaNet state pool device) of a model whose attention layers share one device and whose
    DeltaNet layers share one; a model split over devices by layer has a pool per device (`layer_devices`)."""
    config = getattr(model, "config", None)
    found = layer_devices(model)
    picked = []
    for kind, layers in (("attention", config.full_attention_layers), ("deltanet", config.linear_attention_layers)):
        devs = {found[i] for i in layers if i in found}
        if len(devs) > 1:
            raise RuleError(f"{kind} layers are placed on several devices ({', '.join(sorted(map(str, devs)))}): "
                            f"their pools are per device, see ktrans.inject.layer_devices")
        picked.append(devs.pop() if devs else torch.device("cpu"))
    return picked[0], picked[1]


def compute_devices(model: nn.Module) -> list[torch.device]:
    """Every device a module of the model computes on in either phase (its operators' and kept modules'), in the
    order of the module tree: the devices a step's batch needs its index tensors on."""
    seen: list[torch.device] = []
    for m in model.modules():
        if isinstance(m, BaseOperator):
            devs = list(m.devices.values())
        elif getattr(m, "_ktrans_device", None) is not None:
            devs = [m._ktrans_device]
        else:
            continue
        for d in devs:
            if d not in seen:
                seen.append(d)
    return seen
