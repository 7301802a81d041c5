"""The chunked DeltaNet's resources on sm_90 without a GPU: ktrans.kernels.triton.gated_delta._scan_kernel (--kernel
out: the split form's _output_kernel; --kernel prep, gated_delta_prep._prep_kernel; --kernel wu or qk, the FULL=3/4
later launches of gated_delta_wu) compiled by Triton
for GPUTarget("cuda", 90, 32) at Qwen3-Next's shapes (HK 16, HV 32, Dk = Dv = 128, bf16 operands), one line per
(normed, split or full, warps, stages, value columns): registers and spill stack (cuobjdump -res-usage), the shared
memory Triton asks for, and how many of the loads the pipeliner made asynchronous copies.

    python3 scripts/gdn_resources.py [--kernel scan|out|prep|wu|qk] [--normed 0,1] [--split 0,1]
                                     [--full 0,1,2,3,4,5]
                                     [--warps 4,8] [--stages 3] [--block_v 16,32] [--prep_cols 64]
                                     [--maxnreg 0,168]  (a register cap a thread; 0: none)
                                     [--inv 0,1]  (the prep's diagonal inverses row by row / by doubling)
"""
from __future__ import annotations

import argparse
import itertools

import triton.language as tl
from _sm90 import compile_sm90

from ktrans.kernels.triton import gated_delta as gd
from ktrans.kernels.triton import gated_delta_prep as gdp
from ktrans.kernels.triton import gated_delta_wu as gdw

_TABLES = ("chunk_start", "chunk_len", "first_chunk", "seq_slot", "seq_fresh", "emit_slot")
_FP32 = ("cum_ptr", "state_ptr", "alog_ptr", "dtb_ptr", "scr_ptr")


def _signature(fn) -> dict[str, str]:
    sig = {}
    for a in fn.arg_names:
        if a.endswith("_ptr"):
            sig[a] = "*fp32" if a in _FP32 else "*bf16"
        elif a in _TABLES:
            sig[a] = "*i64"
        elif a.startswith("stride"):
            sig[a] = "i32"
    return sig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("scan", "out", "prep", "wu", "qk"), default="scan")
    for name, default in (("normed", "0,1"), ("split", "0,1"), ("full", "0,1,2"), ("warps", "4,8"), ("stages", "3"),
                          ("block_v", "16,32"), ("prep_cols", "64"), ("maxnreg", "0"), ("inv", "0")):
        ap.add_argument(f"--{name}", default=default)
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    prep = args.kernel not in ("scan", "out")
    fn = {"scan": gd._scan_kernel, "out": gd._output_kernel, "prep": gdp._prep_kernel, "wu": gdw._wu_kernel,
          "qk": gdw._qk_kernel}[args.kernel]
    sig = _signature(fn)
    # the prep's second flag is FULL (none for FULL=3's second launch) and its column block PREP_COLS; the scan's
    # SPLIT and BV
    flags, widths = (args.full, args.prep_cols) if prep else (args.split, args.block_v)
    flags = {"wu": "3,4", "qk": "4"}.get(args.kernel, flags)
    invs = ints(args.inv) if args.kernel == "prep" else [0]  # the diagonal inverses' form: the first launch's
    for normed, flag, warps, stages, width, regs, inv in itertools.product(ints(args.normed), ints(flags),
                                                                           ints(args.warps), ints(args.stages),
                                                                           ints(widths), ints(args.maxnreg), invs):
        consts = {"HV": 32, "R": 2, "DK": 128, "DV": 128, "BK": 128, "DT": tl.bfloat16, "PREC": "tf32",
                  "NORMED": bool(normed)}
        if prep:
            if args.kernel == "wu":
                consts.update(BVF=128, BC=width, QK=flag == 3)
            else:
                consts.update(BVF=128, BC=width, FULL=flag, INV=inv)
            tag = f"{args.kernel} normed={normed} full={flag} warps={warps} stages={stages} prep_cols={width}"
            tag += f" inv={inv}" if args.kernel == "prep" else ""
        else:
            consts.update(BV=width, SPLIT=bool(flag))
            tag = f"{args.kernel} normed={normed} split={flag} warps={warps} stages={stages} block_v={width}"
        tag += f" maxnreg={regs}" if regs else ""
        try:
            consts = {name: value for name, value in consts.items() if name in fn.arg_names}
            k, usage = compile_sm90(fn, sig, consts, warps, stages, regs)
        except Exception as exc:  # noqa: BLE001  (a shape that does not compile is reported)
            print(f"{tag}: {type(exc).__name__}: {str(exc)[-600:]}")
            continue
        copies = k.asm["ttgir"].count("async_copy_global_to_local")
        print(f"{tag}: {usage} shared={k.metadata.shared} async_copies={copies}", flush=True)


if __name__ == "__main__":
    main()
