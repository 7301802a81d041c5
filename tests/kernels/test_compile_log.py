"""ktrans.kernels.triton.CompileLog: what bench e2e reports as the Triton compiles of its measured phases. Without a
GPU nothing compiles (the interpreter runs kernels as Python), so the hook Triton calls on a kernel-cache miss is
called here as Triton calls it: by keyword."""
from __future__ import annotations

import inspect

import pytest

knobs = pytest.importorskip("triton").knobs


def test_records_misses_chains_and_restores(monkeypatch):
    from ktrans.kernels.triton import CompileLog

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["repr"]) or False)
    before = knobs.runtime.jit_cache_hook
    with CompileLog() as log:
        assert knobs.runtime.jit_cache_hook is not before
        skip = knobs.runtime.jit_cache_hook(key=1, repr="gemv_kernel[num_warps=4](x_ptr: *bf16, N: i32)", fn=None,
                                            compile={}, is_manual_warmup=False, already_compiled=False)
    assert skip is False  # False: Triton goes on and compiles
    assert knobs.runtime.jit_cache_hook is before and seen == ["gemv_kernel[num_warps=4](x_ptr: *bf16, N: i32)"]
    assert log.kernels == ["gemv_kernel"] and len(log.compiled) == 1


def test_watched_autotuners_report_new_keys():
    from ktrans.kernels.triton import CompileLog

    class Tuner:  # what CompileLog reads of a triton Autotuner: its fn and its cache of tuned keys
        def __init__(self):
            self.fn = type("fn", (), {"__name__": "_prefill_kernel"})()
            self.cache = {(64, 256): "config"}

    tuner = Tuner()
    with CompileLog([tuner]) as log:
        tuner.cache[(512, 256)] = "config"
    assert log.tuned == ["_prefill_kernel(512, 256)"] and log.compiled == []


def test_describes_the_specialization():
    """The entry names what the kernel was specialized on, from the specialization data Triton's own serializer
    writes for the hook: the constexprs, integers equal to 1, and the arguments taken as multiples of 16."""
    from triton.runtime.jit import serialize_specialization_data
    import triton.language as tl

    from ktrans.kernels.triton import describe_compile

    params = list(inspect.signature(serialize_specialization_data).parameters)
    if params != ["name", "signature", "constants", "attrs", "options", "key", "target"]:
        pytest.skip(f"this Triton's serializer takes {params}")
    options = type("Options", (), {})()
    options.__dict__.update(num_warps=4, num_stages=3)
    target = type("Target", (), {})()
    data = serialize_specialization_data(
        "k", {"x_ptr": "*bf16", "n": "i32", "rows": "i32", "BN": "constexpr"},
        {(2,): 1, (3,): tl.constexpr(32)}, {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
        options, "key", target)
    got = describe_compile({"repr": "gemv_kernel[num_warps=4](x_ptr: ()", "compile": {"specialization_data": data}})
    assert got == "gemv_kernel[4w 3s] const: rows=1, BN=32 div16: x_ptr, n"
    assert describe_compile({"repr": "r[x]", "compile": {}}) == "r[x]"  # no data: Triton's repr
