"""Parse and validate KTransformers-style YAML injection rules.

A rule file is a YAML list of rules:

    - match:   {name: REGEX, class: CLASS}     # at least one; with both, both must hold
      replace: {class: OPERATOR | default, kwargs: {prefill_device, generate_device, prefill_op, generate_op,
                                                    out_device, ...op-specific}}
      recursive: true                          # false: do not walk into the matched module's children

`name` is re.search-ed against the full dotted module path. Class names resolve by their last component
through ktrans' registry (HF model classes, torch.nn classes, operators and KTransformers' names for them),
so `ktransformers.operators.experts.KTransformersExpertsV2` and `KTransformersExperts` are the same thing;
other dotted paths are imported. Every error names the file, the rule (1-based, with its line) and the field.
Device availability is checked separately (`check_devices`), so a file for a GPU machine can be validated
and reported on a machine without one.
"""
from __future__ import annotations

import difflib
import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from ktrans.config import RULES_DIR
from ktrans.operators import OPERATORS, BaseOperator
from ktrans.operators.base import COMMON_KWARGS, canonical_device, device_type

DEFAULT = "default"
RULE_KEYS = ("match", "replace", "recursive")
MATCH_KEYS = ("name", "class")
REPLACE_KEYS = ("class", "kwargs")
DEVICE_KWARGS = ("prefill_device", "generate_device", "out_device")
CPU_RULES = "optimize_rules/Qwen3Next-cpu.yaml"
# Prefixes under which a dotted class path is looked up by its last component instead of being imported.
KNOWN_PREFIXES = ("ktransformers", "ktrans", "torch", "transformers")


class RuleError(ValueError):
    """An invalid rule file; the message names the file, the rule and the field."""


def model_classes() -> dict[str, type]:
    """Module classes a rule can match: the HF Qwen3-Next classes and the torch.nn layers the tree uses."""
    from ktrans.model import qwen3_next

    classes = {n: c for n, c in vars(qwen3_next).items()
               if n.startswith("Qwen3Next") and isinstance(c, type) and issubclass(c, nn.Module)}
    classes.update(Linear=nn.Linear, Embedding=nn.Embedding, Conv1d=nn.Conv1d, ModuleList=nn.ModuleList,
                   Module=nn.Module)
    return classes


def resolve_class(text: str) -> type:
    """A class from a short name, a KTransformers/torch dotted path (by last component) or an importable path.

    Raises LookupError with a suggestion when it cannot.
    """
    short = text.rsplit(".", 1)[-1]
    known = {**model_classes(), **OPERATORS}
    if "." not in text or text.split(".", 1)[0] in KNOWN_PREFIXES:
        if short in known:
            return known[short]
        close = difflib.get_close_matches(short, list(known), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(known))}"
        raise LookupError(f"unknown class {text!r}{hint}")
    module_name, _, attr = text.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise LookupError(f"cannot import class {text!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise LookupError(f"{text!r} is not a torch.nn.Module class")
    return cls


@dataclass
class Rule:
    index: int                    # 1-based position in the file
    line: int                     # 1-based line of the rule in the file (0 when unknown)
    name: str | None              # the regex text
    match_class: type | None
    replace: type[BaseOperator] | None   # None: `class: default` (keep the module, apply kwargs)
    kwargs: dict[str, Any] = field(default_factory=dict)
    recursive: bool = True
    source: str = "<rules>"
    match_class_name: str | None = None
    replace_name: str = DEFAULT

    def __post_init__(self) -> None:
        self.pattern = re.compile(self.name) if self.name is not None else None

    @property
    def where(self) -> str:
        line = f" (line {self.line})" if self.line else ""
        return f"{self.source}: rule {self.index}{line}"

    def matches(self, name: str, module: nn.Module) -> bool:
        if self.pattern is not None and not self.pattern.search(name):
            return False
        return self.match_class is None or isinstance(module, self.match_class)

    def device(self, kwarg: str) -> str | None:
        value = self.kwargs.get(kwarg)
        return canonical_device(value) if value is not None else None


@dataclass
class RuleSet:
    source: str
    rules: list[Rule]

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def first_match(self, name: str, module: nn.Module) -> Rule | None:
        for rule in self.rules:
            if rule.matches(name, module):
                return rule
        return None

    def devices(self) -> set[str]:
        return {rule.device(k) for rule in self.rules for k in DEVICE_KWARGS if rule.device(k)}

    @property
    def uses_cuda(self) -> bool:
        return any(str(d).startswith("cuda") for d in self.devices())


# ---- parsing -------------------------------------------------------------------------------------------------------


def with_gpu_experts(rules: RuleSet, n: int | None, flag: str = "--num_gpu_experts",
                     stats: str | None = None) -> RuleSet:
    """`rules` with `gpu_experts: n` on every rule whose decode op is KExpertsCPU (experts 0..n-1 of each such
    layer also on the GPU; 0: none; None: as the rules say) and, with `stats` (--gpu_experts_from), each layer's n
    most-routed experts in that routing statistics file instead; ValueError naming the flag when n is negative, a
    stats file is given without n > 0, or no rule decodes on KExpertsCPU."""
    import dataclasses

    if n is not None and n < 0:
        raise ValueError(f"{flag} must be >= 0, got {n}")
    if stats is not None and not n:
        raise ValueError(f"--gpu_experts_from needs {flag} N > 0 (how many of each layer's hottest experts)")
    if stats is not None and not Path(stats).is_file():
        raise ValueError(f"--gpu_experts_from: no such file: {stats}")
    extra = ({} if n is None else {"gpu_experts": n}) | ({} if stats is None else {"gpu_experts_from": str(stats)})
    out, hit = [], False
    for rule in rules.rules:
        if rule.kwargs.get("generate_op") == "KExpertsCPU":
            rule = dataclasses.replace(rule, kwargs={**rule.kwargs, **extra})
            hit = True
        out.append(rule)
    if not hit:
        raise ValueError(f"{flag}: no rule of {rules.source} decodes the experts on KExpertsCPU")
    return dataclasses.replace(rules, rules=out)


def load_rules(path: str | Path, check: bool = False) -> RuleSet:
    """Read and validate a rule file; with check=True also require its devices to exist on this machine."""
    path = Path(path)
    if not path.is_file() and (RULES_DIR / path.name).is_file() and path.parent.name in ("optimize_rules", ""):
        # `optimize_rules/Qwen3Next-serve.yaml` as in the docs, run from outside the checkout: the shipped file
        path = RULES_DIR / path.name
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in RULES_DIR.glob("*.yaml")))
        raise RuleError(f"{path}: no such rule file (shipped rules, usable as optimize_rules/NAME: {shipped})")
    rules = parse_rules(path.read_text(), source=str(path))
    if check:
        check_devices(rules)
    return rules


def parse_rules(text: str, source: str = "<rules>") -> RuleSet:
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise RuleError(f"{source}: not valid YAML: {e}") from None
    if data is None:
        raise RuleError(f"{source}: the file has no rules (expected a YAML list of rules)")
    if not isinstance(data, list):
        raise RuleError(f"{source}: expected a YAML list of rules, got a {type(data).__name__}")
    lines = [node.start_mark.line + 1 for node in root.value] if isinstance(root, yaml.SequenceNode) else []
    rules = []
    for i, item in enumerate(data):
        node = root.value[i] if isinstance(root, yaml.SequenceNode) else None
        rules.append(_parse_rule(item, i + 1, lines[i] if i < len(lines) else 0, source, node))
    return RuleSet(source, rules)


def _duplicate_keys(node: Any) -> list[str]:
    """Keys given twice in any mapping under node: YAML keeps only the last, which would hide a mistake."""
    if isinstance(node, yaml.MappingNode):
        keys = [k.value for k, _ in node.value]
        dups = sorted({k for k in keys if keys.count(k) > 1})
        return dups + [d for _, v in node.value for d in _duplicate_keys(v)]
    if isinstance(node, yaml.SequenceNode):
        return [d for v in node.value for d in _duplicate_keys(v)]
    return []


def _parse_rule(item: Any, index: int, line: int, source: str, node: Any) -> Rule:
    where = f"{source}: rule {index}" + (f" (line {line})" if line else "")

    def fail(fld: str, msg: str) -> RuleError:
        return RuleError(f"{where}: {fld}: {msg}")

    if not isinstance(item, dict):
        raise RuleError(f"{where}: a rule must be a mapping with keys {', '.join(RULE_KEYS)}")
    dups = _duplicate_keys(node)
    if dups:
        raise fail(dups[0], "key given twice (YAML would silently keep the last)")
    _check_keys(item, RULE_KEYS, "", fail)
    match = item.get("match")
    if not isinstance(match, dict) or not match:
        raise fail("match", "required: a mapping with 'name' (regex) and/or 'class'")
    _check_keys(match, MATCH_KEYS, "match.", fail)
    name = match.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise fail("match.name", f"must be a regex string, got {name!r}")
        try:
            re.compile(name)
        except re.error as e:
            raise fail("match.name", f"bad regex {name!r}: {e}") from None
    match_class = None
    if match.get("class") is not None:
        try:
            match_class = resolve_class(str(match["class"]))
        except LookupError as e:
            raise fail("match.class", str(e)) from None
    if name is None and match_class is None:
        raise fail("match", "give 'name', 'class' or both")

    replace = item.get("replace", {"class": DEFAULT})
    if not isinstance(replace, dict):
        raise fail("replace", "must be a mapping with 'class' and optional 'kwargs'")
    _check_keys(replace, REPLACE_KEYS, "replace.", fail)
    replace_name = str(replace.get("class") or DEFAULT)
    op_class = None
    if replace_name != DEFAULT:
        try:
            op_class = resolve_class(replace_name)
        except LookupError as e:
            raise fail("replace.class", str(e)) from None
        if not issubclass(op_class, BaseOperator):
            raise fail("replace.class", f"{replace_name!r} is a model class, not an operator; use an operator "
                                        f"(e.g. KTransformersLinear) or 'default'")
    kwargs = replace.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise fail("replace.kwargs", f"must be a mapping, got {kwargs!r}")
    _check_kwargs(op_class, kwargs, fail)

    recursive = item.get("recursive", True)
    if not isinstance(recursive, bool):
        raise fail("recursive", f"must be true or false, got {recursive!r}")
    return Rule(index, line, name, match_class, op_class, dict(kwargs), recursive, source,
                match_class_name=match.get("class"), replace_name=replace_name)


def _check_keys(d: dict, allowed: tuple[str, ...], prefix: str, fail) -> None:
    for key in d:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise fail(f"{prefix}{key}", f"unknown key (allowed: {', '.join(allowed)}){hint}")


def _check_kwargs(op_class: type[BaseOperator] | None, kwargs: dict, fail) -> None:
    name = op_class.__name__ if op_class else DEFAULT
    allowed = DEVICE_KWARGS if op_class is None else (*COMMON_KWARGS, *op_class.EXTRA_KWARGS)
    for key, value in kwargs.items():
        fld = f"replace.kwargs.{key}"
        if key not in allowed:
            extra = " ('default' keeps the module as it is: only its devices can be set)" if op_class is None else ""
            raise fail(fld, f"unknown kwarg for {name} (allowed: {', '.join(allowed)}){extra}")
        if key in DEVICE_KWARGS:
            try:
                canonical_device(value)
            except ValueError as e:
                raise fail(fld, str(e)) from None
        elif key in COMMON_KWARGS:  # an op name
            if not isinstance(value, str):
                raise fail(fld, f"must be an op name, got {value!r}")
        elif not isinstance(value, op_class.EXTRA_KWARGS[key]) or isinstance(value, bool) != (
                op_class.EXTRA_KWARGS[key] is bool):  # YAML's true is an int to isinstance: not a number here
            want = op_class.EXTRA_KWARGS[key]
            names = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
            raise fail(fld, f"must be a {names}, got {value!r}")

    pre, gen = phase_devices(kwargs, None)
    if op_class is None or op_class.ONE_DEVICE:
        if pre != gen:
            why = op_class.ONE_DEVICE if op_class else "a module kept as it is has one copy of its weights"
            raise fail("replace.kwargs.prefill_device", f"{name} runs on one device ({why}), but prefill_device "
                                                        f"{pre!r} differs from generate_device {gen!r}")
    if op_class is None:
        return
    for phase, device in (("prefill", pre), ("generate", gen)):
        op_name = kwargs.get(f"{phase}_op")
        fld = f"replace.kwargs.{phase}_op"
        if op_class.OPS is None:
            if op_name is not None:
                raise fail(fld, f"{name} has no ops to choose: it runs its children, which rules place themselves")
            continue
        op_name = op_name or op_class.DEFAULT_OP
        info = op_class.OPS.info(op_name)
        if info is None:
            ops = op_class.OPS.names()
            close = difflib.get_close_matches(op_name, ops, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise fail(fld, f"unknown {op_class.OPS.family} op {op_name!r} (known: {', '.join(ops)}){hint}")
        if device is not None and device_type(device) not in info.devices:
            dev_fld = f"replace.kwargs.{phase}_device"
            raise fail(dev_fld, f"{info.name} cannot run on {device!r}: it runs on {', '.join(info.devices)} only")


def phase_devices(kwargs: dict, default: str | None) -> tuple[str | None, str | None]:
    """(prefill, generate) device of a rule: one given device serves both phases; none given, the default."""
    pre, gen = kwargs.get("prefill_device"), kwargs.get("generate_device")
    pre, gen = pre or gen or default, gen or pre or default
    return (canonical_device(pre) if pre else None, canonical_device(gen) if gen else None)


# ---- devices -------------------------------------------------------------------------------------------------------


def missing_device(device: str) -> str | None:
    """Why `device` is not usable on this machine, or None when it is."""
    given, device = str(device), canonical_device(device)
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU was found"
        return f"{given!r} needs CUDA, but CUDA is missing on this machine ({why})"
    n = torch.cuda.device_count()
    index = int(device.split(":")[1])
    if index >= n:
        return f"{given!r} does not exist: this machine has {n} CUDA device(s)"
    return None


def check_devices(rules: RuleSet) -> None:
    """Fail, never fall back, when a rule places something on a device this machine lacks."""
    for rule in rules:
        for kwarg in DEVICE_KWARGS:
            value = rule.kwargs.get(kwarg)
            why = missing_device(value) if value is not None else None
            if why:
                raise RuleError(f"{rule.where}: replace.kwargs.{kwarg}: {why}. On a machine without a GPU use "
                                f"the CPU rules: --optimize_config_path {CPU_RULES}")
