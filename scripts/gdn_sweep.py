"""The chunked gated delta rule's launch shapes (ktrans.kernels.triton.gated_delta: PREP_WARPS, SCAN_WARPS,
SCAN_STAGES, SCAN_BLOCK_V; gated_delta_prep: the column block PREP_COLS of w and u) under a grid, on the GPU at
Qwen3-Next's shapes (HK 16, HV 32, d 128, one sequence): device time by
CUDA-graph replay with a cold L2 (ktrans.bench.kernels.time_cuda), the whole call and its first launch alone (the
per-chunk solve; the rest is the sequential scan), and fla-core's chunk_gated_delta_rule on the same inputs where it
imports. Prints one line per (shape, T) and, last, the best per T: what to write into gated_delta.py.

    python3 scripts/gdn_sweep.py [--t 8192,32768] [--prep_warps 4,8] [--scan_warps 2,4,8]
                                 [--scan_stages 2,3,4] [--block_v 16,32,64] [--split 0,1] [--prep_cols 32,64]
                                 [--normed 0,1] [--prep_full 0,1,2,3,4,5,6] [--prep_maxnreg 0,168] [--wu_warps 4,8]
                                 [--out_block_v 32,64,128] [--prep_inv 0,1]

--split 1: the outputs by a launch parallel over chunks (gated_delta.SPLIT, KTRANS_GDN_SPLIT); "scan" is then the
sequential launch and the output launch together, the latter --out_block_v value columns a program. --prep_cols: the
prep's column blocks for w and u. --normed 1: the prep stores the normalised q and k for the scan (gated_delta.NORMED,
KTRANS_GDN_NORMED). --prep_full 1: the prep's A as one product through scratch, 2: its inverse too
(gated_delta_prep.FULL, KTRANS_GDN_PREP_FULL). --prep_maxnreg: a register cap a thread for the prep
(gated_delta_prep.MAXNREG, KTRANS_GDN_PREP_MAXNREG; 0: none). --prep_full 3: q's products, w and u by a second launch
of --wu_warps warps (gated_delta_prep.WU_WARPS); 4: q's products once a key head by a second, w and u by a third;
5: one launch as 2, q, k and v loaded early and w and u made at their whole width (--prep_cols unused); 6: as 5 with a
program a key head for its value heads (needs --prep_inv 2).
--prep_inv 1: the FULL forms' diagonal inverses by doubling (gated_delta_prep.INV, KTRANS_GDN_PREP_INV).
"prep" times the launch before the scan.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from ktrans.bench.kernels import _l2_bytes, time_cuda
from ktrans.bench.kernels_gdn import _fla_peer, _prefill_inputs, _shape
from ktrans.kernels.triton import gated_delta as gd
from ktrans.kernels.triton import gated_delta_prep as gdp


class _Skipped:
    """Stands in for a kernel to leave out of a timing: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", default="8192,32768")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prep_warps", default="4,8")
    ap.add_argument("--scan_warps", default="2,4,8")
    ap.add_argument("--scan_stages", default="3", help="the scan loop's pipelining stages")
    ap.add_argument("--block_v", default="16,32,64")
    ap.add_argument("--split", default="0,1")
    ap.add_argument("--prep_cols", default="64", help="the prep's column blocks for w and u")
    ap.add_argument("--normed", default="0", help="1: the scan reads the prep's normalised q and k")
    ap.add_argument("--prep_full", default="0",
                    help="1: the prep's A as one product through scratch, 2: its inverse too, 3: as 2 with q's "
                         "products, w and u by a second launch, 4: q's products a key head by a second, w and u by a "
                         "third, 5: as 2 with q, k and v loaded early")
    ap.add_argument("--prep_maxnreg", default="0", help="the prep's register cap a thread (0: none)")
    ap.add_argument("--prep_inv", default="0", help="1: the diagonal inverses by doubling (FULL forms)")
    ap.add_argument("--wu_warps", default="8", help="warps of --prep_full 3's and 4's later launches")
    ap.add_argument("--out_block_v", default="0", help="--split 1's output launch's value columns (0: --block_v)")
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    dev = torch.device("cuda")
    flush = torch.empty(2 * _l2_bytes(dev), dtype=torch.uint8, device=dev)
    sh = _shape(dev)
    best: dict[int, tuple[float, tuple]] = {}
    median = lambda fn: statistics.median(time_cuda(fn, dev, args.reps, flush)) * 1e3  # noqa: E731
    for t in ints(args.t):
        q, k, v, a, b, A_log, dt_bias, pool = _prefill_inputs(t, sh, dev)
        plan = gd.plan_chunks([(0, t, 0, False)], dev, [0])
        out = torch.empty(t, sh.hv, sh.d, dtype=torch.bfloat16, device=dev)
        peer = _fla_peer(q, k, v, a, b, A_log, dt_bias, pool)
        fla = f"fla-core {median(peer):.1f} us" if peer else "fla-core: not importable"
        print(f"T={t}: {fla}", flush=True)
        for prep_w, scan_w, stages, bv, split, cols, normed, full, regs, wu_w, obv, inv in itertools.product(
                ints(args.prep_warps), ints(args.scan_warps), ints(args.scan_stages), ints(args.block_v),
                ints(args.split), ints(args.prep_cols), ints(args.normed), ints(args.prep_full),
                ints(args.prep_maxnreg), ints(args.wu_warps), ints(args.out_block_v), ints(args.prep_inv)):
            if (wu_w != ints(args.wu_warps)[0] and full < 3) or (obv != ints(args.out_block_v)[0] and not split):
                continue  # the later launches' warps matter to FULL=3 and 4 only, the output launch's to the split
            gd.PREP_WARPS, gd.SCAN_WARPS, gd.SCAN_STAGES = prep_w, scan_w, stages
            gdp.PREP_COLS, gdp.WU_WARPS, gdp.INV = cols, wu_w, inv
            name = (f"T={t} prep_cols={cols} prep_warps={prep_w} scan_warps={scan_w} scan_stages={stages} "
                    f"block_v={bv} split={split} normed={normed} full={full} prep_maxnreg={regs} wu_warps={wu_w} "
                    f"out_block_v={obv} inv={inv}")
            call = lambda: gd.chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan,  # noqa: E731
                                                            out=out, block_v=bv, split=bool(split),
                                                            normed=bool(normed), full=full,
                                                            prep_maxnreg=regs, out_block_v=obv)
            key = (cols, prep_w, scan_w, stages, bv, split, normed, full, regs, wu_w, obv, inv)
            try:
                whole = median(call)
                later = {k_: getattr(gd, k_) for k_ in ("_scan_kernel", "_output_kernel")}  # the prep's stay
                for k_ in later:
                    setattr(gd, k_, _Skipped())
                try:
                    prep = median(call)
                finally:
                    for k_, kernel in later.items():
                        setattr(gd, k_, kernel)
            except Exception as e:  # a shape that does not compile (registers, shared memory) is reported
                print(f"{name}: FAIL {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            print(f"{name}: {whole:.1f} us (prep {prep:.1f}, scan {whole - prep:.1f})", flush=True)
            if t not in best or whole < best[t][0]:
                best[t] = (whole, key)
    for t, (us, key) in best.items():
        print(f"best T={t}: prep_cols, prep_warps, scan_warps, scan_stages, block_v, split, normed, full, "
              f"prep_maxnreg, wu_warps, out_block_v, inv = {key}, {us:.1f} us")


if __name__ == "__main__":
    main()
