"""The one-row quantized GEMV (ktrans.kernels.triton.quant_gemv) under a grid of tilings, on the GPU: device time by
CUDA-graph replay with a cold L2 (ktrans.bench.kernels.time_cuda), as a fraction of the HBM bandwidth measured in the
same run. Prints one line per (tiling, shape) and, last, the tiling with the best total over the shapes: the one
to write into ktrans.kernels.triton.quant.GEMV.

    python3 scripts/gemv_sweep.py [--reps 20] [--types Q4_K,Q6_K] [--bn 32,64,128] [--warps 2,4,8]
                                  [--per_sm 4,8,16] [--fused 0,1] [--stages 0,1,3] [--rows 0,1]
                                  [--maxnreg 0,96,80] [--pipe 0,3] [--mma 0,1] [--reg 0,1] [--chains 1,2]

--stages: the launch's num_stages (0: Triton's default). --maxnreg: register caps (0: none). --rows: the
lane-group kernel (0) or the row-owning one (GEMV["rows"]; --bn and --warps then set rows_bn and rows_warps, and
tilings with fewer rows than threads are skipped). --pipe: the lane-group body's pipelined super-block loop (its
stages; 0: the plain loop; --per_sm then sets GEMV["per_sm_pipe"]). --mma: the tensor-core body (1, or 2 its
transposed dot; Q4_K and Q6_K): --bn, --warps, --per_sm and --pipe then set GEMV's mma_bn, mma_warps, mma_per_sm and
mma_pipe. --reg: the register tensor-core body (ktrans.kernels.triton.quant_gemv_reg, Q4_K; 2: its code words loaded a
super-block ahead): --bn, --warps and --per_sm then set GEMV's reg_bn, reg_warps and reg_per_sm (tilings whose rows
are not 16 x warps x a power of two are skipped); --chains then sets reg_chains (its dots' independent mma chains).
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from ktrans.bench.kernels import _l2_bytes, hbm_gb_per_s, time_cuda
from ktrans.bench.kernels_quant import ATTENTION, DELTANET, SHARED, _packed
from ktrans.kernels.triton import quant, quant_gemv_reg

SHAPES = DELTANET + ATTENTION + SHARED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--bn", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--per_sm", default="4,8,16")
    ap.add_argument("--fused", default="0,1", help="the split-K sum in the GEMV's last program (1) or a second kernel")
    ap.add_argument("--stages", default="0")
    ap.add_argument("--rows", default="0")
    ap.add_argument("--maxnreg", default="0", help="register caps to try (0: none)")
    ap.add_argument("--pipe", default="0", help="stages of the pipelined super-block loop to try (0: none)")
    ap.add_argument("--mma", default="0", help="the tensor-core body (1; 2 transposed) or the CUDA-core ones (0)")
    ap.add_argument("--chains", default="1", help="the register body's independent mma chains a dot")
    ap.add_argument("--reg", default="0", help="the register tensor-core body (1; 2 its words loaded ahead) or not (0)")
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    dev = torch.device("cuda")
    hbm = hbm_gb_per_s(dev)
    flush = torch.empty(2 * _l2_bytes(dev), dtype=torch.uint8, device=dev)
    print(f"HBM {hbm:.0f} GB/s (device-to-device copy)")
    totals: dict[tuple, float] = {}
    for qtype in args.types.split(","):
        ws = {name: _packed(qtype, n, k, dev, s) for s, (name, n, k) in enumerate(SHAPES)}
        xs = {k: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for _, _, k in SHAPES}
        for bn, warps, per_sm, fused, stages, rows, maxnreg, pipe, mma, reg, chains in itertools.product(
                ints(args.bn), ints(args.warps), ints(args.per_sm), ints(args.fused), ints(args.stages),
                ints(args.rows), ints(args.maxnreg), ints(args.pipe), ints(args.mma), ints(args.reg),
                ints(args.chains)):
            if chains > 1 and not reg:
                continue
            reps = bn // (16 * warps)
            if reg and (qtype not in quant_gemv_reg.TYPES or rows or mma or maxnreg or pipe or not fused
                        or reps < 1 or bn % (16 * warps) or reps & (reps - 1)):
                continue
            if rows and (mma or bn * rows < 32 * warps):  # the tile is [bn, rows, 4]: fewer elements than threads
                continue
            if mma and (qtype not in quant.MMA_TYPES or maxnreg or bn < 16 * warps):  # a wgmma is 64 rows a warpgroup
                continue
            if reg:
                tiling = {"reg_bn": bn, "reg_bn6": bn, "reg_warps": warps, "reg_per_sm": per_sm, "reg_chains": chains}
            elif mma:
                tiling = {"mma_bn": bn, "mma_warps": warps, "mma_per_sm": per_sm, "mma_pipe": pipe}
            else:
                tiling = {"rows_bn": bn, "rows_warps": warps} if rows else {"bn": bn, "warps": warps}
            quant.GEMV.update(per_sm=per_sm, per_sm_pipe=per_sm, fused_sum=bool(fused), stages=stages or None,
                              rows=rows, maxnreg=maxnreg or None, pipe=0 if mma else pipe, mma=mma, reg=reg,
                              **tiling)
            key = (bn, warps, per_sm, fused, stages, rows, maxnreg, pipe, mma, reg, chains)
            line = []
            for name, n, k in SHAPES:
                w, x = ws[name], xs[k]
                try:
                    ms = statistics.median(time_cuda(lambda: quant.qlinear(x, w), dev, args.reps, flush))
                except Exception as e:  # a tiling that does not compile (registers, shared memory) is reported
                    line.append(f"{name}=FAIL({type(e).__name__})")
                    totals[(qtype, key)] = float("inf")
                    break
                frac = (w.nbytes + 2 * (k + n)) / ms / 1e6 / hbm
                totals[(qtype, key)] = totals.get((qtype, key), 0.0) + ms
                line.append(f"{name}={ms * 1e3:.1f}us/{frac:.2f}")
            print(f"{qtype} bn={bn} warps={warps} per_sm={per_sm} fused={fused} stages={stages} rows={rows} "
                  f"maxnreg={maxnreg} pipe={pipe} mma={mma} reg={reg} chains={chains}: "
                  + " ".join(line), flush=True)
    for qtype in args.types.split(","):
        best = min((v, k) for (t, k), v in totals.items() if t == qtype)
        print(f"best {qtype}: bn, warps, per_sm, fused, stages, rows, maxnreg, pipe, mma, reg, chains = "
              f"{best[1]}, all shapes {best[0] * 1e3:.1f} us")


if __name__ == "__main__":
    main()
