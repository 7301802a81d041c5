"""Shared by the *_resources.py scripts: a Triton kernel compiled for sm_90 without a GPU, and what it takes."""
from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, signature: dict[str, str], consts: dict, warps: int, stages: int, maxnreg: int = 0,
                 divisible: tuple[str, ...] = ()):
    """(the compiled kernel, "REG:n STACK:m" from cuobjdump -res-usage) for `fn` with `consts` as constexprs;
    `maxnreg` (0: none) caps the registers a thread.

    Every pointer argument is specialised as 16-byte aligned, and the integer arguments named in `divisible` as
    multiples of 16, as a real launch specialises them (torch's allocations are aligned; Triton checks each integer
    argument at launch). Without these the compiler cannot vectorise the loads and picks other layouts: the one-row
    GEMV compiled unaligned held one code word a thread ([1, 1] per thread, its scales made once a weight) where
    the launched kernel holds four ([1, 4]), so registers, spills and instruction counts from an unaligned compile
    (before session 31) do not describe the launched kernels."""
    aligned = [n for n, t in signature.items() if t.startswith("*")] + list(divisible)
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":  # a Gluon kernel (ktrans.kernels.triton.quant_gemv_reg)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn, signature={**signature, **{k: "constexpr" for k in consts}},
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages,
                                                                       **({"maxnreg": maxnreg} if maxnreg else {})})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()
                     if w.startswith(("REG:", "STACK:")))
    return k, usage
