"""One thread, the raw Q4_K gemm kernel: row kernels vs AVX-512 VNNI tiles vs AMX tiles vs the fused kernels on
Q4_K repacked 16 rows at a time (x16) (tuning aid).

Usage: python3 scripts/gemm_tiles_bench.py [--isa avx512|avx2]  -> one JSON line per (M, k, N) with ms per mode and
the speedups over the row kernels (AMX only on the avx512 path of a CPU that has it, x16 where the path reads it).
"""
import argparse
import json

import torch

from ktrans import _cpu
from ktrans.bench.moe import random_experts
from ktrans.kernels import cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default="avx512", choices=["avx512", "avx2"])
    isa = ap.parse_args().isa
    gen = torch.Generator().manual_seed(0)
    modes = {"rows": (cpu.TILES_OFF, 0), "tiles" if isa == "avx2" else "vnni": (1, 0)}
    if isa == "avx512" and _cpu.isa_info().get("amx_int8"):
        modes["amx"] = (1, 1)
    x16 = _cpu.reads_x16(isa)
    if x16:
        modes["x16"] = (1, 0)
        if "amx" in modes:
            modes["x16_amx"] = (1, 1)
    pool = cpu.make_pool(1)
    for M, k in [(512, 2048), (2048, 512), (32, 512)]:
        w = random_experts("Q4_K", 1, M, k, gen)
        wx = torch.empty_like(w)
        if x16:
            _cpu.repack_x16(pool, cpu.type_id("Q4_K"), w.data_ptr(), wx.data_ptr(), M, k)
        for N in [1, 2, 3, 4, 6, 8, 16, 20, 24, 32, 64, 256]:
            row = {"isa": isa, "M": M, "k": k, "N": N}
            for name, (tmin, amx) in modes.items():
                old_min, old_amx = _cpu.set_tile_min_tokens(tmin), _cpu.set_amx_mode(amx)
                reps = max(3, int(2e8 / (M * k * N)))
                ty, ptr = (_cpu.Q4_K_X16, wx.data_ptr()) if name.startswith("x16") else (cpu.type_id("Q4_K"), w.data_ptr())
                row[name + "_ms"] = round(min(_cpu.bench_gemm(ty, ptr, M, k, N, reps, isa) for _ in range(5)) * 1e3, 4)
                _cpu.set_tile_min_tokens(old_min)
                _cpu.set_amx_mode(old_amx)
            for name in modes:
                if name != "rows":
                    row[name + "_speedup"] = round(row["rows_ms"] / row[name + "_ms"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
