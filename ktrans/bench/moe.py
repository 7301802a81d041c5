"""`ktrans bench moe`: time the C++ CPU experts of one MoE layer against the memory-bandwidth limit.

Weights are random ggml blocks for every expert of one layer (Qwen3-Next: 512 experts, hidden 2048, intermediate
512, top-10; about 0.9 GB at Q4_K). Each timed call gets a fresh random routing, so the experts it touches are
mostly not in cache. Per token count one JSON line: ms (median; ms_min too), tokens/s, the distinct experts
touched and their weight bytes, the effective GB/s (bytes / median time), the read bandwidth of this machine
measured in the same run, and their ratio.

The read bandwidth is a multi-threaded streaming read (the pool's threads, the kernels' widest loads) over the
expert weights themselves, right before and right after the timed calls, the larger of the two: on a VM the
bandwidth drifts with the host's load and can differ between a process's pages, so only the same pages at the
same time give a fair ratio. read_gb_per_s_fresh is the same read over a fresh 1 GiB buffer at the start.
cpu_util is the CPU time the process got during the timed calls over wall time x threads: well below 1 means the
cores were shared with other work (a thread stalled on memory still counts as busy). --reference also times the
torch reference (ktrans.kernels.torch.moe on float32 weights dequantized from the same blocks).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import dataclass

import torch

from ktrans.kernels import cpu
from ktrans.kernels.torch.moe import moe_experts


@dataclass(frozen=True)
class MoEShape:
    n_experts: int
    hidden: int
    intermediate: int
    top_k: int


SHAPES = {
    "qwen3-next": MoEShape(512, 2048, 512, 10),  # configs/qwen3-next-80b-a3b.json
    "tiny": MoEShape(16, 64, 32, 4),  # configs/tiny-qwen3next.json
}
QUANTS = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "q8_0": "Q8_0", "bf16": "BF16", "f16": "F16", "f32": "F32"}
# byte offsets of the fp16 scales in each block; the rest of a block may be any bits
_SCALE_FIELDS = {"Q8_0": (34, [0]), "Q4_K": (144, [0, 2]), "Q5_K": (176, [0, 2]), "Q6_K": (210, [208])}
_FLOAT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def random_experts(qtype: str, n_experts: int, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Stacked [E, rows, cols] weights: random blocks with small finite scales, or normal floats."""
    if qtype in _FLOAT:
        w = torch.empty(n_experts, rows, cols, dtype=_FLOAT[qtype])
        for e in range(n_experts):
            w[e].normal_(0.0, 0.02, generator=gen)
        return w
    block, fields = _SCALE_FIELDS[qtype]
    nbytes = n_experts * rows * cpu.row_bytes(qtype, cols)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    blocks = raw.view(-1, block)
    for off in fields:
        scale = (torch.rand(len(blocks), generator=gen) * 0.01 + 0.001).half()
        blocks[:, off:off + 2] = scale.view(torch.uint8).view(-1, 2)
    return raw


def _dequantize_experts(raw: torch.Tensor, qtype: str, rows: int, cols: int, experts: list[int], n_experts: int):
    """float32 [E, rows, cols] with only `experts` filled (the others never touched, so never resident)."""
    from ktrans.weights.quants import dequantize

    out = torch.empty(n_experts, rows, cols, dtype=torch.float32)
    if qtype in _FLOAT:
        for e in experts:
            out[e] = raw[e].float()
        return out
    per = rows * cpu.row_bytes(qtype, cols)
    for e in experts:
        out[e] = torch.from_numpy(dequantize(raw[e * per:(e + 1) * per].numpy(), qtype, (rows, cols)))
    return out


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _routings(shape: MoEShape, tokens: int, n: int, gen: torch.Generator, share: float = 1.0):
    """n random top-k routings (distinct experts per token, weights summing to 1); with share < 1 only the pairs
    routed to experts [0, share * E) are kept (the others -1, skipped), as split prefill hands the CPU its share."""
    out = []
    keep = round(share * shape.n_experts)
    for _ in range(n):
        logits = torch.rand(tokens, shape.n_experts, generator=gen)
        w, ids = logits.topk(shape.top_k, dim=-1)
        if keep < shape.n_experts:
            ids = torch.where(ids < keep, ids, -1)
        out.append((ids.contiguous(), (w / w.sum(-1, keepdim=True)).contiguous()))
    return out


def run(shape_name: str = "qwen3-next", quant: str = "q4_k", tokens=(1, 4, 16, 64, 256, 1024),
        threads: int | None = None, reference: bool = False, isa: str = "auto", min_time_s: float = 1.0,
        seed: int = 0, emit=print, as_json: bool = True, tiles: str = "auto", trace: bool = False,
        hugepages: bool = True, repack: bool = True, cpu_share: float = 1.0) -> list[dict]:
    if shape_name not in SHAPES:
        raise ValueError(f"--shape must be one of {sorted(SHAPES)}, got {shape_name!r}")
    if quant.lower() not in QUANTS:
        raise ValueError(f"--quant must be one of {sorted(QUANTS)}, got {quant!r}")
    shape, qtype = SHAPES[shape_name], QUANTS[quant.lower()]
    block = {"Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}.get(qtype, 1)
    if shape.hidden % block or shape.intermediate % block:
        raise ValueError(f"--quant {quant} needs hidden and intermediate sizes that are multiples of {block}; "
                         f"--shape {shape_name} has {shape.hidden} and {shape.intermediate}")
    if not 0.0 < cpu_share <= 1.0:
        raise ValueError(f"--cpu_share must be in (0, 1], got {cpu_share}")
    if tiles not in _TILES:
        raise ValueError(f"--tiles must be one of {sorted(_TILES)}, got {tiles!r}")
    tile_min, amx = _TILES[tiles]
    config = cpu.CPUMoEConfig()  # the defaults (KTRANS_* tuning variables), with --tiles applied
    if tile_min:
        config = config.replace(tile_min_tokens=tile_min)
    if amx is not None:
        config = config.replace(amx=amx)
    return _run(shape_name, quant, tokens, threads, reference, isa, min_time_s, seed, emit, as_json, trace,
                hugepages, repack, config, cpu_share)


# --tiles: (tile_min_tokens to set or None, amx mode to set or None) in the layer's CPUMoEConfig
_TILES = {"auto": (None, None), "amx": (None, 1), "vnni": (None, 0), "off": (cpu.TILES_OFF, None)}


def _trace_summary(pool, moe, x, routes) -> dict:
    """Median over calls of: when the first and last thread started their share, when the first and last ended
    (microseconds from submit), and the wall time of the call."""
    starts, ends, walls = [], [], []
    pool.set_trace(True)
    try:
        for ids, w in routes:
            t = time.perf_counter()
            moe.forward(x, ids, w)
            walls.append((time.perf_counter() - t) * 1e6)
            tr = [r for r in pool.last_trace() if r[2] > 0]
            s = sorted(r[0] / 1e3 for r in tr)
            e = sorted(r[1] / 1e3 for r in tr)
            starts.append((s[0], s[len(s) // 2], s[-1], len(s)))
            ends.append((e[0], e[len(e) // 2], e[-1]))
    finally:
        pool.set_trace(False)
    med = lambda rows, i: round(statistics.median(r[i] for r in rows), 1)  # noqa: E731
    return {"threads_working": med(starts, 3), "start_us_min_med_max": [med(starts, i) for i in range(3)],
            "end_us_min_med_max": [med(ends, i) for i in range(3)], "wall_us": round(statistics.median(walls), 1)}


def _run(shape_name, quant, tokens, threads, reference, isa, min_time_s, seed, emit, as_json, trace, hugepages,
         repack, config, share=1.0):
    shape, qtype = SHAPES[shape_name], QUANTS[quant.lower()]
    gen = torch.Generator().manual_seed(seed)
    pool = cpu.make_pool(threads or cpu.default_threads())
    fresh_gbs = cpu.read_bandwidth(1 << 30, reps=5, pool=pool, isa=isa)

    t0 = time.perf_counter()
    E, H, I = shape.n_experts, shape.hidden, shape.intermediate
    gate = random_experts(qtype, E, I, H, gen)
    up = random_experts(qtype, E, I, H, gen)
    down = random_experts(qtype, E, H, I, gen)
    moe = cpu.CPUMoE(gate, up, down, n_experts=E, hidden=H, intermediate=I, types=(qtype,) * 3, pool=pool, isa=isa,
                     hugepages=hugepages, repack=repack, config=config)
    setup_s = time.perf_counter() - t0

    results = []
    for T in tokens:
        x = torch.randn(T, H, generator=gen)
        moe.forward(x, *_routings(shape, T, 1, gen, share)[0])  # warm up threads and allocator
        # enough calls for ~min_time_s, at least 5; each with its own routing
        probe = _routings(shape, T, 2, gen, share)
        t = time.perf_counter()
        for ids, w in probe:
            moe.forward(x, ids, w)
        per_call = (time.perf_counter() - t) / 2
        n_iter = max(5, min(200, int(min_time_s / max(per_call, 1e-6))))
        routes = _routings(shape, T, n_iter, gen, share)
        times, touched = [], []
        read_before = cpu.stream_bandwidth(moe.weights, reps=3, pool=pool, isa=isa)
        cpu0, wall0 = _cpu_seconds(), time.perf_counter()
        for ids, w in routes:
            t = time.perf_counter()
            moe.forward(x, ids, w)
            times.append(time.perf_counter() - t)
            touched.append(int(torch.unique(ids[ids >= 0]).numel()))
        cpu_util = (_cpu_seconds() - cpu0) / ((time.perf_counter() - wall0) * pool.size)
        # The bandwidth of the very pages the experts live on, just before and after the timed calls; the larger.
        read_gbs = max(read_before, cpu.stream_bandwidth(moe.weights, reps=3, pool=pool, isa=isa))
        ms = statistics.median(times) * 1e3
        n_exp = statistics.median(touched)
        nbytes = int(n_exp * moe.expert_bytes)
        gbs = nbytes / (ms * 1e-3) / 1e9
        row = {"bench": "moe", "shape": shape_name, "quant": quant.lower(), "tokens": T, "threads": pool.size,
               "path": moe.path, "ms": round(ms, 4), "ms_min": round(min(times) * 1e3, 4),
               "tokens_per_s": round(T / (ms * 1e-3), 1), "cpu_share": share, "experts_touched": n_exp,
               "bytes_touched": nbytes,
               "gb_per_s": round(gbs, 2), "read_gb_per_s": round(read_gbs, 2), "ratio": round(gbs / read_gbs, 3),
               "read_gb_per_s_fresh": round(fresh_gbs, 2),
               "iters": n_iter, "cpu_util": round(cpu_util, 2), "load_avg": round(os.getloadavg()[0], 2),
               "weights_gb": round(moe.nbytes / 1e9, 3), "hugepages": moe.hugepages, "layout": moe.layouts[0],
               "repack_s": round(moe.repack_s, 3), "setup_s": round(setup_s, 2)}
        if moe.layouts[0].endswith("_X16"):
            # repacked: the VNNI kernels, and AMX for experts with 16+ tokens in a call where present
            row["tiles"] = "x16, amx from 16 tokens per expert" if moe.config.amx_mode == 1 else "x16"
        elif qtype in ("Q4_K", "Q5_K"):
            # experts with at least that many tokens in a call run on the tiles, the others on the row kernels
            tiles = cpu.prefill_tiles(moe.path, cpu.isa_info(), moe.config)
            row["tiles"] = tiles["mode"]
            if "from_tokens_per_expert" in tiles:
                row["tile_min_tokens"] = tiles["from_tokens_per_expert"]
        if trace:
            row["trace"] = _trace_summary(pool, moe, x, routes[: min(len(routes), 50)])
        if reference:
            ref_routes = routes[:3]
            used = sorted(set(torch.cat([ids[ids >= 0] for ids, _ in ref_routes]).tolist()))
            gd = _dequantize_experts(gate, qtype, I, H, used, E)
            ud = _dequantize_experts(up, qtype, I, H, used, E)
            dd = _dequantize_experts(down, qtype, H, I, used, E)
            ref_times = []
            for ids, w in ref_routes:
                t = time.perf_counter()
                moe_experts(x, ids, w, gd, ud, dd)
                ref_times.append(time.perf_counter() - t)
            ref_ms = statistics.median(ref_times) * 1e3
            row["ref_ms"] = round(ref_ms, 3)
            row["speedup_vs_ref"] = round(ref_ms / ms, 2)
            del gd, ud, dd
        results.append(row)
        if as_json:
            emit(json.dumps(row))
        else:
            ref = f"  ref {row['ref_ms']:.2f} ms ({row['speedup_vs_ref']}x)" if reference else ""
            of = f" of the first {round(share * E)}" if share < 1 else ""
            emit(f"T={T:5d}  {ms:9.3f} ms  {row['tokens_per_s']:10.1f} tok/s  {n_exp:5.0f} experts{of}  "
                 f"{gbs:6.2f} GB/s of {read_gbs:.2f} read ({row['ratio'] * 100:.0f}%)  [{moe.path}, "
                 f"{pool.size} threads, cpu {cpu_util:.2f}]{ref}")
    return results
