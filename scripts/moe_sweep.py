"""The few-token routed-expert path (ktrans.kernels.triton.moe_quant's lanes kernel) under a grid of launch shapes,
on the GPU: one 80B MoE layer (512 experts, hidden 2048, intermediate 512, top-10, Q4_K gate/up, --down type) per
token count, device time by CUDA-graph replay with a cold L2 (ktrans.bench.kernels.time_cuda), as a fraction of the
HBM bandwidth measured in the same run over the distinct routed experts' packed bytes. Prints one line per launch
shape and, last, the shape with the best total over the token counts: the one to write into moe_quant.LANES.

    python3 scripts/moe_sweep.py [--reps 20] [--tokens 1,4,16,64] [--down Q4_K] [--bn 32,64] [--warps 4,8]
                                 [--per_sm 2,4,8] [--split 0] [--maxnreg 80,0] [--pipe 0,3]
                                 [--one_loop 0,1] [--mma 0,1] [--reg 0,1] [--chains 1,2]

--split: gate/up's K splits (0: LANES' automatic choice from per_sm). --maxnreg: one cap for both launches (0:
none). --pipe: gate and up's pipelined super-block loops (their stages; 0: plain loops); --one_loop: gate's and up's
rows in one loop (LANES["one_loop"]). bn and warps apply to the lane-group form (GEMV["rows"] 0, the default).
--mma 1: the tensor-core row_dot (LANES["mma"]); --bn and --per_sm then set mma_bn and mma_per_sm (4 warps).
--reg 1: the register tensor-core kernel (LANES["reg"], quant_gemv_reg.moe_reg_kernel); --bn, --warps and --per_sm
then set reg_bn, reg_warps and reg_per_sm (shapes whose rows are not 16 x warps x a power of two are skipped),
--chains reg_chains.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from ktrans.bench.kernels import _l2_bytes, hbm_gb_per_s, time_cuda
from ktrans.bench.kernels_quant import E, H, TOP_K, random_moe_layer
from ktrans.kernels.triton import moe_quant as mq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--down", default="Q4_K")
    ap.add_argument("--bn", default="32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--per_sm", default="2,4,8")
    ap.add_argument("--split", default="0")
    ap.add_argument("--maxnreg", default="80,0")
    ap.add_argument("--pipe", default="0")
    ap.add_argument("--one_loop", default="0")
    ap.add_argument("--mma", default="0")
    ap.add_argument("--reg", default="0")
    ap.add_argument("--chains", default="1")
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    dev = torch.device("cuda")
    hbm = hbm_gb_per_s(dev)
    flush = torch.empty(2 * _l2_bytes(dev), dtype=torch.uint8, device=dev)
    print(f"HBM {hbm:.0f} GB/s (device-to-device copy)")
    gate_up, down = random_moe_layer(dev, args.down)
    per_expert = (gate_up.nbytes + down.nbytes) // E
    cases = []
    for t in ints(args.tokens):
        g = torch.Generator(device="cpu").manual_seed(t)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(t)]).to(dev)
        w = torch.rand(t, TOP_K, device=dev)
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16) * 0.1
        cases.append((t, x, ids, w, int(torch.unique(ids).numel()) * per_expert))
    mq.LANES.update(on=True, max_tokens=max(ints(args.tokens)))
    totals: dict[tuple, float] = {}
    for bn, warps, per_sm, split, cap, pipe, one, mma, reg, chains in itertools.product(
            ints(args.bn), ints(args.warps), ints(args.per_sm), ints(args.split), ints(args.maxnreg), ints(args.pipe),
            ints(args.one_loop), ints(args.mma), ints(args.reg), ints(args.chains)):
        if chains > 1 and not reg:
            continue
        if mma and (bn < 64 or warps != 4 or cap or pipe or one or reg):  # a wgmma is 64 rows; 4 warps, no cap
            continue
        reps = bn // (16 * warps)
        if reg and (cap or pipe or one or reps < 1 or bn % (16 * warps) or reps & (reps - 1)):
            continue
        mq.LANES.update(bn=bn, warps=warps, per_sm=per_sm, per_sm_pipe=per_sm, split=split or None,
                        maxnreg=(cap, cap), pipe=pipe, one_loop=bool(one), mma=mma, mma_bn=bn, mma_per_sm=per_sm,
                        reg=reg, reg_bn=bn, reg_warps=warps, reg_per_sm=per_sm, reg_chains=chains)
        key = (bn, warps, per_sm, split, cap, pipe, one, mma, reg, chains)
        line = []
        for t, x, ids, w, nbytes in cases:
            try:
                ms = statistics.median(time_cuda(lambda: mq.moe_quant(x, ids, w, gate_up, down), dev, args.reps,
                                                 flush))
            except Exception as e:  # a shape that does not compile (registers, shared memory) is reported
                line.append(f"B={t}=FAIL({type(e).__name__})")
                totals[key] = float("inf")
                break
            totals[key] = totals.get(key, 0.0) + ms
            line.append(f"B={t}={ms * 1e3:.1f}us/{nbytes / ms / 1e6 / hbm:.2f}")
        print(f"bn={bn} warps={warps} per_sm={per_sm} split={split} maxnreg={cap} pipe={pipe} one_loop={one} "
              f"mma={mma} reg={reg} chains={chains}: "
              + " ".join(line), flush=True)
    best = min((v, k) for k, v in totals.items())
    print(f"best: bn, warps, per_sm, split, maxnreg, pipe, one_loop, mma, reg, chains = {best[1]}, all token "
          f"counts {best[0] * 1e3:.1f} us")


if __name__ == "__main__":
    main()
