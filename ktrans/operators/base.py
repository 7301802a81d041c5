"""The operator contract: what an injection rule swaps into the module tree, and the ops that do its math.

An **operator** (BaseOperator) replaces one HF module (`model.layers.7.self_attn`) and keeps its name. It knows,
per phase, a device and an op: a batch with any prefill chunk runs `prefill_op` on `prefill_device`, a pure decode
batch runs `generate_op` on `generate_device`. It moves its inputs to that device when called and hands its output
back on `out_device`, which defaults to its caller's device; tensors cross devices only there.

An **op** (Op) is one implementation on one device, holding its own weights: KLinearTorch, KExpertsTorch, later
KLinearMarlin or the C++ KExpertsCPU. Each operator family has an OpRegistry. An op may be *declared* before it
exists (its devices and the module that will define it): rules naming it validate, and building the model then
imports that module or fails with "not built yet". When both phases use the same op on the same device, one
instance (one copy of the weights) serves both.

Operators load their own weights from a WeightSource under HF names; `param_specs()` lists them, which also
lets `ktrans rules show` count bytes per device on a meta model without building any op.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ktrans.config import ModelConfig
from ktrans.runtime.batch import GENERATE, PHASES, PREFILL, ForwardBatch, current_phase
from ktrans.weights.source import WeightSource

# ---- devices -------------------------------------------------------------------------------------------------------


def canonical_device(device: str | torch.device) -> str:
    """'cpu' or 'cuda:N' ('cuda' means cuda:0, as in KTransformers' rule files). ValueError for anything else."""
    text = str(device).strip().lower()
    if text == "cpu":
        return "cpu"
    if text == "cuda":
        return "cuda:0"
    if text.startswith("cuda:") and text[5:].isdigit():
        return f"cuda:{int(text[5:])}"
    raise ValueError(f"unknown device {str(device)!r}: use 'cpu', 'cuda' or 'cuda:N'")


def use_device(device: torch.device) -> None:
    """Make the GPU `device` the current CUDA device unless it is already (cudaGetDevice is cheap; setting the
    device only where it changes keeps a one-GPU step, and its graph capture, free of the call)."""
    if torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def device_type(device: str) -> str:
    return canonical_device(device).split(":")[0]


def move(obj: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples and lists) to `device`; a ForwardBatch becomes its copy there. No-op when there.

    A copy from one GPU to another does not block the host (it is ordered on both devices' streams); a copy that
    involves the CPU stays blocking, since the host may read what arrives (or the source may be pageable)."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        return obj.to(device, non_blocking=obj.device.type == "cuda" and device.type == "cuda")
    if isinstance(obj, ForwardBatch):
        return obj.on(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple (the rotary tables) keeps its type
        return type(obj)(*(move(o, device) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(move(o, device) for o in obj)
    return obj


# ---- weights -------------------------------------------------------------------------------------------------------

# Tensors a GGUF file keeps in F32 whatever the quant (llama.cpp never quantizes 1-D tensors, routers or the conv);
# only the byte estimates of `ktrans rules show` use this.
_GGUF_FLOAT_SUFFIXES = ("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight", "A_log", "dt_bias")
# HF computes with these in float32 whatever the model dtype, so they are loaded in float32.
_FP32_SUFFIXES = ("A_log", "dt_bias")


@dataclass(frozen=True)
class ParamSpec:
    """One checkpoint tensor an operator (or a plain module) needs, under its HF name."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def gguf_float(self) -> bool:
        return len(self.shape) <= 1 or self.name.endswith(_GGUF_FLOAT_SUFFIXES)

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.name.endswith(_FP32_SUFFIXES) else dtype


def load_param(source: WeightSource, spec: ParamSpec, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(source.require(spec.name, spec.shape, spec.load_dtype(dtype), device), requires_grad=False)


# ---- ops and their registries --------------------------------------------------------------------------------------


class OpNotBuiltError(RuntimeError):
    """A rule names an op ktrans knows of but that is not available in this build (yet)."""


class Op(nn.Module):
    """One implementation of an operator's math on one device. Subclasses add forward (or submit/sync).

    Constructed from the operator (read what you need from it; keep no reference: it would become a submodule
    cycle) and a device; `load` fills the weights. `streaming` ops keep no weights resident and read them from the
    source on each call (the prefill experts when prefill runs on another device than decode).
    """

    def __init__(self, operator: "BaseOperator", device: torch.device, streaming: bool = False):
        super().__init__()
        self.key = operator.key
        self.device = device
        self.streaming = streaming
        self._planned: ForwardBatch | None = None  # the step plan() last ran for (on this op's device)

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        """Take this op's tensors from `source` onto self.device. Ops without weights need not override."""

    def plan(self, batch: ForwardBatch) -> None:
        """Called once per step before the forward: derive from the batch's host lists (seq_lens, cached_lens,
        slots, ...) whatever the forward needs, so that the forward reads nothing back from the device. Ops that
        need nothing need not override. An op whose forward depends on its plan checks `planned_for(batch)` and
        plans itself when the caller did not (a direct model call in a test)."""

    def planned_for(self, batch: ForwardBatch) -> bool:
        """True when plan() last ran for this step (`batch` or its copy on another device)."""
        return self._planned is not None and self._planned is batch.on(self.device)

    def mark_planned(self, batch: ForwardBatch) -> ForwardBatch:
        """Record that plan() ran for this step; returns the batch on this op's device (what forward receives)."""
        self._planned = batch.on(self.device)
        return self._planned


@dataclass
class OpInfo:
    name: str
    devices: tuple[str, ...]        # device types it runs on: "cpu", "cuda"
    cls: type[Op] | None = None     # None while only declared
    module: str | None = None       # the module that defines (registers) a declared op
    provided_by: str = ""           # what brings it, for the "not built yet" message
    float_weights: bool = False     # holds its weights as floats in the model dtype whatever the file stores


class OpRegistry:
    """The ops of one operator family by name (plus KTransformers' aliases)."""

    def __init__(self, family: str):
        self.family = family
        self._ops: dict[str, OpInfo] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, devices: tuple[str, ...], aliases: tuple[str, ...] = (),
                 float_weights: bool = False) -> Callable:
        """Class decorator: `@EXPERT_OPS.register("KExpertsCPU", devices=("cpu",))`. Replaces a declaration.
        float_weights: the op dequantizes a quantized checkpoint into the model dtype (`ktrans rules show` then
        counts its weights at that dtype, not at the file's types)."""

        def deco(cls: type[Op]) -> type[Op]:
            info = self._ops.get(name)
            if info is not None and info.cls is not None and info.cls is not cls:
                raise ValueError(f"{self.family} op {name!r} is registered twice ({info.cls} and {cls})")
            self._ops[name] = OpInfo(name, tuple(devices), cls, info.module if info else None,
                                     info.provided_by if info else "", float_weights)
            for a in aliases:
                self._aliases[a] = name
            cls.op_name = name
            return cls

        return deco

    def declare(self, name: str, devices: tuple[str, ...], module: str, provided_by: str,
                aliases: tuple[str, ...] = ()) -> None:
        """An op that a later module registers: known to validation, built only once `module` imports."""
        if name not in self._ops:
            self._ops[name] = OpInfo(name, tuple(devices), None, module, provided_by)
        for a in aliases:
            self._aliases[a] = name

    def canonical(self, name: str) -> str | None:
        name = self._aliases.get(name, name)
        return name if name in self._ops else None

    def info(self, name: str) -> OpInfo | None:
        c = self.canonical(name)
        return self._ops[c] if c else None

    def names(self) -> list[str]:
        return list(self._ops)

    def built(self, name: str) -> bool:
        try:
            self.get(name)
            return True
        except OpNotBuiltError:
            return False

    def get(self, name: str) -> type[Op]:
        info = self.info(name)
        if info is None:
            raise KeyError(f"unknown {self.family} op {name!r}; known: {', '.join(self.names())}")
        if info.cls is None and info.module:
            try:
                importlib.import_module(info.module)  # registering is the module's side effect
            except ImportError as e:
                missing = getattr(e, "name", None) == info.module
                why = "" if missing else f" (importing {info.module} failed: {e})"
                raise OpNotBuiltError(f"{self.family} op {info.name} is not built yet{why}: it comes with "
                                      f"{info.provided_by}. Use one of the built ops: "
                                      f"{', '.join(n for n, i in self._ops.items() if i.cls)}") from None
            info = self._ops[info.name]
        if info.cls is None:
            raise OpNotBuiltError(f"{self.family} op {info.name} is not built yet: it comes with {info.provided_by}")
        return info.cls


# ---- operators -----------------------------------------------------------------------------------------------------

OPERATORS: dict[str, type["BaseOperator"]] = {}   # short name (and KTransformers alias) -> operator class


def register_operator(*aliases: str) -> Callable:
    """Class decorator making an operator resolvable by its short name and by KTransformers' names for it."""

    def deco(cls):
        for name in (cls.__name__, *aliases):
            if name in OPERATORS and OPERATORS[name] is not cls:
                raise ValueError(f"operator name {name!r} is taken by {OPERATORS[name]}")
            OPERATORS[name] = cls
        return cls

    return deco


COMMON_KWARGS = ("prefill_device", "generate_device", "prefill_op", "generate_op", "out_device")


class BaseOperator(nn.Module):
    """Base of every injected operator. Subclass contract:

    - REPLACES: the module classes it can stand in for (checked at injection).
    - OPS / DEFAULT_OP: its op registry and default op; None for composites that only call their children.
    - ADOPT: children of the replaced module it keeps (rules then walk into them, e.g. attention's q_proj).
    - ONE_DEVICE: set to the reason when both phases must share a device (a pool pins it).
    - EXTRA_KWARGS: op-specific rule kwargs it accepts, name -> type.
    - param_specs(): checkpoint tensors its ops load (its own, not its adopted children's).
    - forward: `phase, dev = self.phase_device()`, move inputs with `move`, run `self.op_for(phase)`, and return
      `self.leave(out, phase)`.
    """

    REPLACES: ClassVar[tuple[type, ...]] = (nn.Module,)
    OPS: ClassVar[OpRegistry | None] = None
    DEFAULT_OP: ClassVar[str | None] = None
    ADOPT: ClassVar[tuple[str, ...]] = ()
    ONE_DEVICE: ClassVar[str | None] = None
    EXTRA_KWARGS: ClassVar[dict[str, type]] = {}
    STREAM_PREFILL: ClassVar[bool] = False  # prefill op on another placement streams its weights (experts)

    def __init__(self, key: str, orig: nn.Module, config: ModelConfig, prefill_device: str = "cpu",
                 generate_device: str = "cpu", prefill_op: str | None = None, generate_op: str | None = None,
                 out_device: str | None = None, **kwargs: Any):
        nn.Module.__init__(self)  # explicitly: subclasses may also derive from the HF class they replace
        unknown = set(kwargs) - set(self.EXTRA_KWARGS)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown kwargs {sorted(unknown)}")
        self.key = key
        self.config = config
        self.options = kwargs
        self.devices = {PREFILL: torch.device(canonical_device(prefill_device)),
                        GENERATE: torch.device(canonical_device(generate_device))}
        if self.ONE_DEVICE and self.devices[PREFILL] != self.devices[GENERATE]:
            raise ValueError(f"{type(self).__name__} runs on one device ({self.ONE_DEVICE}), but prefill_device "
                             f"{prefill_device!r} differs from generate_device {generate_device!r}")
        self.op_names = {PREFILL: None, GENERATE: None}
        if self.OPS is None and (prefill_op or generate_op):
            raise ValueError(f"{type(self).__name__} has no ops to choose (it runs its children)")
        for phase, name in ((PREFILL, prefill_op), (GENERATE, generate_op)) if self.OPS else ():
            info = self.OPS.info(name or self.DEFAULT_OP)
            if info is None:
                raise ValueError(f"unknown {self.OPS.family} op {name!r} (known: {', '.join(self.OPS.names())})")
            if self.devices[phase].type not in info.devices:
                raise ValueError(f"{info.name} cannot run on {self.devices[phase]}: it runs on "
                                 f"{', '.join(info.devices)} only")
            self.op_names[phase] = info.name
        # Until the injector says who calls us, hand outputs back where they were computed.
        out = torch.device(canonical_device(out_device)) if out_device else None
        self.out_devices = {p: out or self.devices[p] for p in PHASES}
        self.explicit_out = out is not None
        for name in self.ADOPT:
            child = orig._modules.get(name)
            if child is not None:
                self.add_module(name, child)
        self.impl: dict[str, Op] = {}  # phase -> op, filled by build_ops (the ops are also child modules)

    # ---- placement ----
    def placement(self, phase: str) -> tuple[torch.device, str | None]:
        return self.devices[phase], self.op_names[phase]

    def streams(self, phase: str) -> bool:
        """True for the prefill op of a STREAM_PREFILL operator placed apart from its generate op."""
        return self.STREAM_PREFILL and phase == PREFILL and self.placement(PREFILL) != self.placement(GENERATE)

    def resident_devices(self) -> list[torch.device]:
        """Devices holding a copy of this operator's weights (param_specs)."""
        out = []
        for p in PHASES:
            if not self.streams(p) and self.devices[p] not in out:
                out.append(self.devices[p])
        return out

    def param_specs(self) -> list[ParamSpec]:
        return []

    # ---- building and loading ----
    def build_ops(self, source: WeightSource | None = None) -> None:
        """Instantiate the op of each phase (one instance when both phases agree). Raises OpNotBuiltError."""
        if self.OPS is None:
            return
        made: dict[tuple, Op] = {}
        for p in PHASES:
            dev, name = self.placement(p)
            streaming = self.streams(p)
            if (dev, name, streaming) not in made:
                cls = self.OPS.get(name)
                op = cls(self, dev, streaming=True) if streaming else cls(self, dev)
                if streaming:
                    op.source = source  # plain attribute: read on each call
                made[(dev, name, streaming)] = op
            self.impl[p] = made[(dev, name, streaming)]
        # Children named for what they serve: `op` when one instance serves both phases.
        if self.impl[PREFILL] is self.impl[GENERATE]:
            self.add_module("op", self.impl[PREFILL])
        else:
            self.add_module("prefill_op", self.impl[PREFILL])
            self.add_module("generate_op", self.impl[GENERATE])

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        seen = set()
        for op in self.impl.values():
            if id(op) not in seen and not op.streaming:
                seen.add(id(op))
                op.load(source, dtype)
            op.dtype = dtype

    # ---- running ----
    def phase_device(self) -> tuple[str, torch.device]:
        """The running phase and this operator's device for it. On a GPU that device is also made the current one:
        kernels that launch on the current device (Triton's) then run where their tensors are when the model spans
        several GPUs (a no-op on one GPU)."""
        phase = current_phase()
        dev = self.devices[phase]
        if dev.type == "cuda":
            use_device(dev)
        return phase, dev

    def op_for(self, phase: str) -> Op:
        if phase not in self.impl:
            raise RuntimeError(f"{self.key}: {type(self).__name__} has no ops; build the model with "
                               f"ktrans.inject.build_injected_model (or call build_ops and load first)")
        return self.impl[phase]

    def leave(self, out: Any, phase: str) -> Any:
        return move(out, self.out_devices[phase])

    def plan(self, batch: ForwardBatch) -> None:
        """Plan this step's op (the one of the batch's phase); see Op.plan. Composites have nothing to plan."""
        op = self.impl.get(batch.phase)
        if op is not None:
            op.plan(batch)

    def extra_repr(self) -> str:
        p, g = self.placement(PREFILL), self.placement(GENERATE)
        show = lambda dev, op: f"{dev} {op}" if op else str(dev)  # noqa: E731
        if p == g:
            return f"{show(*p)}"
        return f"prefill={show(*p)}, generate={show(*g)}"


def plan_model(model: nn.Module, batch: ForwardBatch) -> None:
    """Call plan(batch) once on every operator of `model`, before its forward of `batch`."""
    for m in model.modules():
        if isinstance(m, BaseOperator):
            m.plan(batch)
