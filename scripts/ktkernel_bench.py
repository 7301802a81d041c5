#!/usr/bin/env python3
"""Time KTransformers' own CPU MoE kernel (kt-kernel, llamafile backend) on the same random GGUF blocks as
`ktrans bench moe`, for the comparison asked in issue 5.

Runs in an environment where `kt_kernel` is importable (not the system python: kt-kernel 0.7.2 pins torch 2.9.1),
e.g. the venv /opt/ktk-venv made by

    python3 -m venv /opt/ktk-venv && /opt/ktk-venv/bin/pip install kt-kernel==0.7.2

or, on a machine without network, the wheel's kt_kernel/ package and kt_kernel.libs/ put on PYTHONPATH (see
scripts/device_ktkernel.sh). Only kt_kernel's compiled extension is used, loaded the way kt_kernel/__init__.py loads
it (kt_kernel._cpu_detect: best variant for this CPU, KT_KERNEL_CPU_VARIANT overrides); the extension does not
link libtorch, so any recent torch serves for the buffers.

What is timed, per (threads, tokens): one `cpu_infer.submit(moe.forward_task(...)); cpu_infer.sync()`, exactly
the call KTransformers' LlamafileMoEWrapper makes (kt_kernel/utils/llamafile.py and experts_base.py in 0.7.2):
MOEConfig(expert_num, num_experts_per_tok, hidden, intermediate, gpu_experts_mask_ptr) with m_block 32,
group_min_len 10 (fewer tokens take forward_one, more forward_many), max_len = group_max_len = the largest token
count, gate/up/down = Q4_K (ggml type 12) blocks stacked [E, rows, row_bytes] as in a GGUF ffn_*_exps tensor,
hidden_type BF16 (30): input and output activations are bf16 [T, hidden], ids int64 [T, k], weights f32 [T, k].
Threads: a CPUInfer over WorkerPoolConfig(subpool_count 1, subpool_thread_count [N]): N is kt-kernel's compute
thread count; its dispatcher thread comes on top (os_threads_added counts the threads the CPUInfer started;
cores_busy is the process's CPU time over wall time during the timed calls, busy-waiting included).

Weights: random Q4_K blocks with small finite fp16 scales (the logic of ktrans.bench.moe.random_experts; same
seed and generator calls, so the same bytes as `ktrans bench moe`, which uses seed 0). Every timed call gets a fresh random
top-k routing (distinct experts per token, weights summing to 1), so touched experts are mostly not in cache.
Warm-up call, then enough calls for ~--min-time seconds (5..200); the median is reported (ms_min too).

Each thread count runs in its own subprocess (a CPUInfer's threads busy-wait and would disturb the next one).
One JSON line per (threads, tokens). --check compares the output with the torch reference
(ktrans.kernels.torch.moe.moe_experts on weights dequantized by ktrans.weights.quants, float32) on a small shape
and on the full shape, and prints the relative errors; it needs the repo root importable (added here).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # n_experts, hidden, intermediate, top_k (as ktrans.bench.moe.SHAPES)
    "qwen3-next": (512, 2048, 512, 10),
    "small": (16, 512, 256, 4),  # for --check: kt-kernel's llamafile path needs intermediate % 256 == 0
}
QUANTS = {"q4_k": ("Q4_K", 12, 256, 144, (0, 2))}  # name, ggml type id, block elems, block bytes, fp16 scale offsets
GGML_BF16 = 30


def load_ext():
    """kt_kernel's compiled extension for this CPU, chosen as kt_kernel/__init__.py chooses it
    (kt_kernel._cpu_detect.initialize(): the best variant the CPU's flags allow, falling back to lower ones whose
    .so is missing; KT_KERNEL_CPU_VARIANT overrides), but without running kt_kernel/__init__.py, which imports
    the wrappers and their dependencies (gguf, safetensors, triton, the torch version they were built against).
    Only the extension is used here. Returns (module, variant, .so file name)."""
    import importlib.util
    if "kt_kernel_ext" in sys.modules:
        ext = sys.modules["kt_kernel_ext"]
        return ext, getattr(ext, "__cpu_variant__", "?"), os.path.basename(getattr(ext, "__file__", "?"))
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("kt_kernel not found: install kt-kernel or put its unpacked wheel on PYTHONPATH")
    pkg_dir = list(spec.submodule_search_locations)[0]
    det_spec = importlib.util.spec_from_file_location("_ktk_cpu_detect", os.path.join(pkg_dir, "_cpu_detect.py"))
    det = importlib.util.module_from_spec(det_spec)
    det_spec.loader.exec_module(det)  # load_extension() looks for the .so files next to this file
    ext, variant = det.initialize()
    sys.modules["kt_kernel_ext"] = ext
    return ext, variant, os.path.basename(ext.__file__)


def random_experts(torch, qname: str, n_experts: int, rows: int, cols: int, gen):
    """Stacked [E, rows, cols] ggml blocks as a flat uint8 tensor: random bytes with small finite fp16 scales
    (ktrans.bench.moe.random_experts)."""
    _, _, belems, bbytes, fields = QUANTS[qname]
    nbytes = n_experts * rows * (cols // belems * bbytes)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    blocks = raw.view(-1, bbytes)
    for off in fields:
        scale = (torch.rand(len(blocks), generator=gen) * 0.01 + 0.001).half()
        blocks[:, off:off + 2] = scale.view(torch.uint8).view(-1, 2)
    return raw


def routings(torch, n_experts: int, top_k: int, tokens: int, n: int, gen):
    out = []
    for _ in range(n):
        logits = torch.rand(tokens, n_experts, generator=gen)
        w, ids = logits.topk(top_k, dim=-1)
        out.append((ids.to(torch.int64).contiguous(), (w / w.sum(-1, keepdim=True)).float().contiguous()))
    return out


class KTMoE:
    """One kt-kernel llamafile MOE layer over stacked ggml blocks, called as LlamafileMoEWrapper calls it."""

    def __init__(self, torch, ext, threads, E, H, I, K, qtype_id, gate, up, down, max_len):
        self.torch, self.ext, self.K, self.H = torch, ext, K, H
        cfg = ext.WorkerPoolConfig()
        cfg.subpool_count = 1
        cfg.subpool_numa_map = [0]
        cfg.subpool_thread_count = [threads]
        self.cpu_infer = ext.CPUInfer(cfg)
        self.mask = torch.zeros(E, dtype=torch.bool)  # gpu_experts_mask: no expert on a GPU
        self.weights = (gate, up, down)  # kept alive for the layer's lifetime
        c = ext.moe.MOEConfig(E, K, H, I, self.mask.data_ptr())
        c.layer_idx = 0
        c.pool = self.cpu_infer.backend_
        c.m_block = 32
        c.group_min_len = 10
        c.max_len = max_len
        c.group_max_len = max_len
        c.swiglu_limit = 0.0
        c.swiglu_alpha = 0.0
        c.gate_proj, c.up_proj, c.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        c.gate_type = c.up_type = c.down_type = qtype_id
        c.hidden_type = GGML_BF16
        self.config = c
        self.moe = ext.moe.MOE(c)
        self.p2l = torch.arange(E, dtype=torch.int64)  # identity physical->logical expert map
        self.cpu_infer.submit(self.moe.load_weights_task(self.p2l.data_ptr()))
        self.cpu_infer.sync()
        self.bsz = {}

    def forward(self, x_bf16, ids, w, out_bf16):
        T = x_bf16.shape[0]
        bsz = self.bsz.get(T)
        if bsz is None:
            bsz = self.bsz[T] = self.torch.full((1,), T, dtype=self.torch.int32)
        self.cpu_infer.submit(self.moe.forward_task(bsz.data_ptr(), self.K, ids.data_ptr(), w.data_ptr(),
                                                    x_bf16.data_ptr(), out_bf16.data_ptr(), False))
        self.cpu_infer.sync()
        return out_bf16


def _cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _n_threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def bench_one(args, threads: int):
    import torch
    ext, variant, how = load_ext()
    E, H, I, K = SHAPES[args.shape]
    qname, qid, belems, bbytes, _ = QUANTS[args.quant]
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    gate = random_experts(torch, args.quant, E, I, H, gen)
    up = random_experts(torch, args.quant, E, I, H, gen)
    down = random_experts(torch, args.quant, E, H, I, gen)
    n_os0 = _n_threads()
    moe = KTMoE(torch, ext, threads, E, H, I, K, qid, gate, up, down, max_len=max(max(tokens), 1))
    setup_s = time.perf_counter() - t0
    os_threads_added = _n_threads() - n_os0
    expert_bytes = (2 * I * (H // belems) + H * (I // belems)) * bbytes
    weights_gb = 3 * E * I * H // belems * bbytes / 1e9
    for T in tokens:
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        out = torch.empty(T, H, dtype=torch.bfloat16)
        moe.forward(x, *routings(torch, E, K, T, 1, gen)[0], out)  # warm-up
        probe = routings(torch, E, K, T, 2, gen)
        t = time.perf_counter()
        for ids, w in probe:
            moe.forward(x, ids, w, out)
        per_call = (time.perf_counter() - t) / 2
        n_iter = max(5, min(200, int(args.min_time / max(per_call, 1e-6))))
        routes = routings(torch, E, K, T, n_iter, gen)
        times, touched = [], []
        cpu0, wall0 = _cpu_seconds(), time.perf_counter()
        for ids, w in routes:
            t = time.perf_counter()
            moe.forward(x, ids, w, out)
            times.append(time.perf_counter() - t)
        wall = time.perf_counter() - wall0
        cpu_used = _cpu_seconds() - cpu0
        for ids, _ in routes:
            touched.append(int(torch.unique(ids).numel()))
        ms = statistics.median(times) * 1e3
        n_exp = statistics.median(touched)
        nbytes = int(n_exp * expert_bytes)
        row = {"bench": "moe", "impl": "kt-kernel", "kt_kernel_version": _ktk_version(), "backend": "llamafile",
               "cpu_variant": variant, "shape": args.shape, "quant": args.quant, "tokens": T, "threads": threads,
               "os_threads_added": os_threads_added,
               "path": "forward_one" if T < 10 else "forward_many",
               "ms": round(ms, 4), "ms_min": round(min(times) * 1e3, 4),
               "tokens_per_s": round(T / (ms * 1e-3), 1), "experts_touched": n_exp, "bytes_touched": nbytes,
               "gb_per_s": round(nbytes / (ms * 1e-3) / 1e9, 2), "iters": n_iter,
               "cores_busy": round(cpu_used / wall, 2),  # process CPU time / wall: busy-waiting threads count
               "load_avg": round(os.getloadavg()[0], 2), "weights_gb": round(weights_gb, 3),
               "setup_s": round(setup_s, 2), "torch": torch.__version__, "ext": how}
        print(json.dumps(row), flush=True)


def _ktk_version():
    try:
        from importlib.metadata import version
        return version("kt-kernel")
    except Exception:
        return os.environ.get("KTK_VERSION", "unknown")


def check(args):
    """kt-kernel output vs the torch reference on weights dequantized from the same blocks.

    Two kinds of weights: the random blocks the benchmark times (random 4-bit codes and 6-bit sub-scales: weights
    with a large common offset, so gate/up outputs are small differences of large sums and any kernel that rounds
    the activations to 8 bits, as ggml's Q4_K x Q8_K dot products do, lands a few % off; ktrans's CPUMoE shows the
    same), and blocks that ktrans.weights.quants.quantize made from N(0, 0.02) weights, which look like a model's
    and give ~1% (rounding of the activations to Q8_K plus bf16 output). A wrong pointer, layout or type would be
    ~100% off. The error is ||out - ref|| over the norm of sum_k |w_k y_k| (the scale of the summed terms; with
    random weights the k outputs can cancel, which would inflate a plain relative error)."""
    import numpy as np
    import torch
    sys.path.insert(0, REPO)
    from ktrans.kernels.torch.moe import moe_experts
    from ktrans.weights.quants import dequantize, quantize
    ext, variant, how = load_ext()
    ok = True
    cases = [("small", "random", (1, 3, 16, 40)), ("small", "gaussian", (1, 3, 16, 40)),
             ("qwen3-next", "random", (1, 2, 16)), ("qwen3-next", "gaussian", (1, 2, 16))]
    for shape, kind, tokens in cases:
        E, H, I, K = SHAPES[shape]
        qname, qid, belems, bbytes, _ = QUANTS[args.quant]
        gen = torch.Generator().manual_seed(args.seed + 1)
        gate = random_experts(torch, args.quant, E, I, H, gen)
        up = random_experts(torch, args.quant, E, I, H, gen)
        down = random_experts(torch, args.quant, E, H, I, gen)
        per_gu, per_d = I * (H // belems) * bbytes, H * (I // belems) * bbytes
        routes = {T: routings(torch, E, K, T, 1, gen)[0] for T in tokens}
        if kind == "gaussian":  # replace every expert the routings use by quantized N(0, 0.02) weights
            rng = np.random.default_rng(args.seed)
            for e in sorted(set(torch.cat([r[0].flatten() for r in routes.values()]).tolist())):
                for raw, per, rows, cols in ((gate, per_gu, I, H), (up, per_gu, I, H), (down, per_d, H, I)):
                    q = quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), qname)
                    raw[e * per:(e + 1) * per] = torch.from_numpy(q.reshape(-1))
        moe = KTMoE(torch, ext, args.check_threads, E, H, I, K, qid, gate, up, down, max_len=max(tokens))
        deq = {}

        def expert(e):
            if e not in deq:
                deq[e] = tuple(torch.from_numpy(dequantize(raw[e * per:(e + 1) * per].numpy(), qname, shp))
                               for raw, per, shp in ((gate, per_gu, (I, H)), (up, per_gu, (I, H)), (down, per_d, (H, I))))
            return deq[e]

        for T in tokens:
            ids, w = routes[T]
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
            out = moe.forward(x, ids, w, torch.empty(T, H, dtype=torch.bfloat16)).float()
            gd = torch.zeros(E, I, H)
            ud = torch.zeros(E, I, H)
            dd = torch.zeros(E, H, I)
            for e in set(ids.flatten().tolist()):
                gd[e], ud[e], dd[e] = expert(e)
            xf = x.float()  # the bf16-rounded input kt-kernel sees, in float32
            ref = moe_experts(xf, ids, w, gd, ud, dd)
            terms = torch.zeros(T, H)
            for t in range(T):
                for j in range(K):
                    g, u, d = expert(int(ids[t, j]))
                    terms[t] += (w[t, j] * (d @ (torch.nn.functional.silu(g @ xf[t]) * (u @ xf[t])))).abs()
            err = ((out - ref).norm() / terms.norm()).item()
            good = err < (0.03 if kind == "gaussian" else 0.15) and bool(torch.isfinite(out).all())
            ok &= good
            print(json.dumps({"check": "kt-kernel vs torch reference", "shape": shape, "weights": kind, "tokens": T,
                              "threads": args.check_threads, "cpu_variant": variant, "rel_err": round(err, 5),
                              "rel_err_plain": round(((out - ref).norm() / ref.norm()).item(), 5),
                              "ok": good, "ext": how}), flush=True)
            del gd, ud, dd
        del moe
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-next", choices=sorted(SHAPES))
    p.add_argument("--quant", default="q4_k", choices=sorted(QUANTS))
    p.add_argument("--tokens", default="1,256")
    p.add_argument("--threads", default="1,2", help="comma list of kt-kernel compute thread counts")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per token count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="only the correctness check against the torch reference")
    p.add_argument("--check-threads", type=int, default=2)
    p.add_argument("--_one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.check:
        sys.exit(0 if check(args) else 1)
    if args._one is not None:
        bench_one(args, args._one)
        return
    rc = 0
    for n in [int(t) for t in args.threads.split(",")]:
        cmd = [sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--quant", args.quant,
               "--tokens", args.tokens, "--min-time", str(args.min_time), "--seed", str(args.seed), "--_one", str(n)]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        for line in r.stdout.splitlines():  # kt-kernel prints its own lines too; pass on only the JSON rows
            if line.startswith("{"):
                print(line, flush=True)
        if r.returncode:
            print(json.dumps({"error": f"threads={n}: exit {r.returncode}"}), flush=True)
            rc = 1
    sys.exit(rc)


if __name__ == "__main__":
    main()
