"""The GPU layer kernels, in Triton. Each has its oracle in `ktrans/kernels/torch/` and sits behind an op that
rules select by name (the operators' registries), so a placement without Triton still builds with the reference ops.

Triton's interpreter (`TRITON_INTERPRET=1`) runs the same kernels on CPU tensors: CI has no GPU and tests them that
way at small shapes (tests marked `triton`). The device image has Triton 3.6, a CPU-only machine installs 3.9; the
kernels use only what both have.
"""
from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason() -> str | None:
    """Why the Triton ops cannot run here, or None when they can (a GPU that Triton compiles for, or the
    interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a dependency of the GPU placements and the tests
        return f"triton does not import ({exc}); `pip install triton`"
    if interpreting():
        return None
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on the CPU, slowly, for tests)"
    return None


def unaligned(*names: str) -> dict:
    """@triton.jit options that keep Triton from specializing pointer arguments `names` on their 16-byte alignment,
    where this Triton has the option (3.2+): for a pointer whose alignment follows the caller's buffers (a view into
    the runner's packed step tensors) while the kernel only reads a scalar from it, one compile serves every caller."""
    import inspect

    import triton
    ok = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
    return {"do_not_specialize_on_alignment": list(names)} if ok else {}


def describe_compile(kw: dict) -> str:
    """One compile as `name[warps, stages] const: a=1, BN=32 div16: x_ptr, n`: the kernel, its launch options, the
    arguments it was specialized on (constexprs and integers equal to 1) and those it took as multiples of 16 (what
    made it compile where an earlier launch did not). Read from the hook's specialization data (Triton 3.2+); Triton's
    own `repr` where that is missing."""
    import json
    fallback = str(kw.get("repr", "?"))
    try:
        data = json.loads(kw["compile"]["specialization_data"])
        names = list(data["signature"])
        consts = []
        for k, v in zip(data["constant_keys"], data["constant_vals"]):
            if isinstance(v, dict) and "jit_function" in v:
                continue
            consts.append(f"{names[k[0]]}={v['constexpr'] if isinstance(v, dict) else v}")
        div = [names[k[0]] for k, v in zip(data["attrs_keys"], data["attrs_vals"])
               if k and any(a and a[0] == "tt.divisibility" for a in v)]
        opts = data.get("options", {})
        return (f"{fallback.split('[', 1)[0]}[{opts.get('num_warps')}w {opts.get('num_stages')}s] "
                f"const: {', '.join(consts)} div16: {', '.join(div)}")
    except (KeyError, TypeError, ValueError, IndexError):
        return fallback


class CompileLog:
    """The Triton kernels compiled (or loaded from Triton's disk cache) while entered, one `repr` each (the kernel,
    its launch options and its arguments' specialization): a measured phase that compiles pays ~0.1-1 s a kernel,
    which a warm-up should have paid. Uses `triton.knobs.runtime.jit_cache_hook` (called on a miss of the
    in-memory kernel cache) and chains any hook already set; records nothing where Triton lacks it. Autotuners
    given are watched too: a new key times every config (~1 s) even when each is compiled already (`tuned`)."""

    def __init__(self, autotuners=()) -> None:
        self.compiled: list[str] = []
        self.tuned: list[str] = []  # keys the given autotuners timed their configs for (no compile when cached)
        self._tuners = list(autotuners)
        self._runtime = None

    def __enter__(self) -> "CompileLog":
        self._before = [set(t.cache) for t in self._tuners]
        try:
            from triton import knobs
            self._runtime = knobs.runtime
            self._prev = self._runtime.jit_cache_hook
        except (ImportError, AttributeError):
            self._runtime = None
            return self

        def hook(**kw):
            self.compiled.append(describe_compile(kw))
            return self._prev(**kw) if self._prev is not None else False

        self._runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._prev
        for tuner, before in zip(self._tuners, self._before):
            name = getattr(getattr(tuner, "fn", None), "__name__", type(tuner).__name__)
            self.tuned += [f"{name}{key}" for key in tuner.cache if key not in before]

    @property
    def kernels(self) -> list[str]:
        """The compiled kernels' names, in order (one per compile)."""
        return [r.split("[", 1)[0] for r in self.compiled]
