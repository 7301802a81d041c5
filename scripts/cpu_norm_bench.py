"""The CPU placement's residual add + RMSNorm of one row, as the flat decode step calls it (engine.cpu_decode._Norm)
and as the module forward does (KRMSNormCPU): us a call, best of 5 rounds of 2,000, and whether the two agree bitwise.

    python3 scripts/cpu_norm_bench.py GGUF [--rows 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from ktrans.api.server import ServeOptions, load
from ktrans.config import RULES_DIR
from ktrans.engine.cpu_decode import _Norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    model, _, _, _ = load(ServeOptions(gguf_path=args.gguf, optimize_config_path=str(RULES_DIR / "Qwen3Next-cpu.yaml"),
                                       cpu_infer=2), show_progress=False)
    norm = _Norm(model.model.layers[0].input_layernorm)
    n = norm.w.numel()
    x, r = torch.randn(args.rows, n), torch.randn(args.rows, n)
    for name, f in (("KRMSNormCPU (module forward)", norm.op), ("flat step", norm)):
        for _ in range(200):
            f(x, r)
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                f(x, r)
            best.append((time.perf_counter() - t0) / 2000 * 1e6)
        print(f"{name}: {min(best):.2f} us a call (add + norm of [{args.rows}, {n}])")
    a, b = norm.op(x, r), norm(x, r)
    print("bitwise equal:", torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))


if __name__ == "__main__":
    main()
