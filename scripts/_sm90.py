"""Shared by the *_resources.py scripts: a Triton kernel compiled for sm_90 without a GPU, and what it takes."""
from __future__ import annotations

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, signature: dict[str, str], consts: dict, warps: int, stages: int, maxnreg: int = 0):
    """(the compiled kernel, "REG:n STACK:m" from cuobjdump -res-usage) for `fn` with `consts` as constexprs;
    `maxnreg` (0: none) caps the registers a thread."""
    src = ASTSource(fn, signature={**signature, **{k: "constexpr" for k in consts}},
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
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
