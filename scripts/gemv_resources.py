"""The one-row quantized GEMV (ktrans.kernels.triton.quant_gemv.gemv_kernel) compiled for sm_90 without a GPU, as the
launch specialises it (pointers aligned, N a multiple of 16): registers, spill stack, shared memory, and the
instructions of its super-block loop per weight a thread handles (SASS from cuobjdump), by opcode. At one row the
GEMV's issue slots, not its bytes, set its pace once enough loads are in flight (ncu on the H100, doc/benchmarks.md,
session 31), so instructions per weight is the figure a new body must lower.

    python3 scripts/gemv_resources.py [--types Q4_K,Q6_K] [--pipe 0,3] [--maxnreg 0,80,96] [--warps 4] [--bn 32]
                                      [--rows 0,4] [--mma 0,1] [--reg 0,1,2]

--rows: the lane-group body (0) or the row-owning one with that many threads a row (quant.GEMV["rows"]; --bn is then
its rows a program). --mma: the tensor-core body (quant_gemv_mma.row_dot_mma, Q4_K and Q6_K; --bn its rows a program). --reg: the register tensor-core body (quant_gemv_reg, Gluon; Q4_K and Q6_K; --bn its rows a
program, 16 x warps x a power of two; 2: its code words loaded a super-block ahead); run it without
TRITON_INTERPRET (Gluon does not compile under the interpreter).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import tempfile

import triton
from _sm90 import compile_sm90

from ktrans.kernels.triton import quant_gemv, quant_gemv_reg
from ktrans.kernels.triton.quant import QT_CODE
from ktrans.kernels.triton.quant_layout import QK

SIGNATURE = {"x_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "lo_ptr": "*i32",
             "hi_ptr": "*i32", "d_ptr": "*fp16", "sc_ptr": "*i32", "N": "i32", "NSB": "i32", "SB_PER": "i32",
             "SPLIT": "i32", "TILES_A": "i32", "N_B": "i32", "b_lo": "i32", "b_hi": "i32", "b_d": "i32",
             "b_sc": "i32"}
REG_SIGNATURE = {"x_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "lo_ptr": "*i32",
                 "hi_ptr": "*i32", "d_ptr": "*fp16", "sc_ptr": "*u8", "N": "i32", "NSB": "i32", "SB_PER": "i32",
                 "SPLIT": "i32", "TILES_A": "i32", "N_B": "i32", "b_lo": "i32", "b_hi": "i32", "b_d": "i32",
                 "b_sc": "i32"}


def _sass(cubin: bytes) -> list[tuple[int, str]]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    lines = (re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line) for line in out.splitlines())
    return [(int(m.group(1), 16), m.group(2)) for m in lines if m]


def _loop(ins: list[tuple[int, str]]) -> list[str]:
    """The instructions of the widest backward branch's span (the super-block loop)."""
    spans = []
    for addr, text in ins:
        m = re.search(r"BRA 0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            spans.append((addr - int(m.group(1), 16), int(m.group(1), 16), addr))
    if not spans:
        return []
    _, lo, hi = max(spans)
    return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if lo <= a <= hi]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("types", "Q4_K,Q6_K"), ("pipe", "0,3"), ("maxnreg", "0,80,96"), ("warps", "4"),
                          ("bn", "32"), ("rows", "0"), ("mma", "0"), ("reg", "0"), ("chains", "1")):
        ap.add_argument(f"--{name}", default=default)
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    for qtype, pipe, cap, warps, bn, rows, mma, reg, chains in itertools.product(
            args.types.split(","), ints(args.pipe), ints(args.maxnreg), ints(args.warps), ints(args.bn),
            ints(args.rows), ints(args.mma), ints(args.reg), ints(args.chains)):
        if chains > 1 and not reg:  # the register body's alone
            continue
        if reg:
            if rows or mma or pipe or cap or qtype not in quant_gemv_reg.TYPES or bn % (16 * warps):
                continue
            _reg(qtype, warps, bn, reg, chains)
            continue
        if rows and (pipe or qtype == "Q8_0" or mma):  # the row-owning body has no pipelined loop, no Q8_0 form
            continue
        if mma and qtype not in ("Q4_K", "Q6_K"):
            continue
        consts = {"QT": QT_CODE[qtype], "BN": bn, "FUSED_SUM": True, "HAS_B": False, "ROWS": rows, "PDL": False,
                  "PIPE": pipe, "MMA": bool(mma)}
        k, usage = compile_sm90(quant_gemv.gemv_kernel, SIGNATURE, consts, warps, 3, cap, divisible=("N",))
        body = _loop(_sass(k.asm["cubin"]))
        per = bn * QK / (32 * warps)  # weights a thread handles an iteration (a super-block of the row tile)
        top = " ".join(f"{op}:{n}" for op, n in collections.Counter(body).most_common(8))
        print(f"{qtype} mma={mma} rows={rows} pipe={pipe} maxnreg={cap} warps={warps} bn={bn}: {usage} "
              f"shared={k.metadata.shared} loop {len(body)} instructions, {len(body) / per:.1f} a weight; {top}",
              flush=True)


def _reg(qtype: str, warps: int, bn: int, reg: int, chains: int) -> None:
    """One line for the register tensor-core body at this tiling (its one-matrix launch with the fused split sum).
    Every constexpr is given, defaults included: a Gluon compile from source leaves an omitted one unset."""
    sig = {**REG_SIGNATURE, "sc_ptr": "*i8" if qtype == "Q6_K" else "*u8"}
    consts = {"QT": QT_CODE[qtype], "FUSED_SUM": True, "HAS_B": False, "PDL": True,
              **quant_gemv_reg.tiling("--bn", bn, warps), "PF": reg == 2, "CH": chains}
    k, usage = compile_sm90(quant_gemv_reg.gemv_reg_kernel, sig, consts, warps, 1, 0, divisible=("N",))
    body = _loop(_sass(k.asm["cubin"]))
    per = bn * QK / (32 * warps)
    top = " ".join(f"{op}:{n}" for op, n in collections.Counter(body).most_common(8))
    print(f"{qtype} reg={reg} chains={chains} warps={warps} bn={bn}: {usage} shared={k.metadata.shared} "
          f"loop {len(body)} instructions, {len(body) / per:.2f} a weight; {top}", flush=True)


if __name__ == "__main__":
    main()
