"""Where a 1-token MoE call's wall time goes (diagnostics): Python wrapper, C++ submit, the pool's work, the tail.

Usage: python3 scripts/decode_overhead.py [--threads N]  -> one JSON line of medians in microseconds:
  forward_us   CPUMoE.forward as the model calls it
  raw_us       the pybind submit + pool.wait alone (no Python wrapper)
  submit_us    the pybind submit call alone (routing, buffers, activation quantization, posting the job)
  work_end_us  from posting the job to the end of its last task (the pool trace)
  inputs_us, run_us  forward's two parts (Python checks and buffers; the extension's submit + wait), and the run
               call's timeline: run_to_post_us (into C++, routing, buffers, posted), first/last_start_us and
               first/last_end_us (threads, from posting), end_to_complete_us, complete_to_return_us
  empty_us     submit + wait of a call whose every expert id is -1 (no work: the fixed cost of a job)
  pattern_read_us  one pool job reading the bytes a step reads, in the step's task split, with no arithmetic
  flat_read_us     the same number of bytes and tasks over one contiguous stretch of the weights
The two reads bound what the step's access pattern and a perfect layout could reach (memory side only).
"""
import os
import argparse
import json
import statistics
import time

import torch

from ktrans.bench.moe import SHAPES, _routings, random_experts
from ktrans import _cpu
from ktrans.kernels import cpu


def _block_rows(total: int, threads: int, per_thread: int, cap: int) -> int:
    """The C++ MoE job's rows per task (moe.cpp block_rows)."""
    return max(16, min(total // (threads * per_thread), cap) & ~15)


def step_tasks(moe, experts: list[int], threads: int, down_by_expert: bool = True,
               fused_gate_up: bool = False) -> list[list[tuple[int, int]]]:
    """(address, bytes) ranges per task of a 1-token step over `experts`, split as moe.cpp splits it (down in
    per-expert row blocks, one stream per task); or down by blocks of output rows across the experts (as moe.cpp
    does for many tokens), or gate and up of a task as one stream."""
    H, I = moe.hidden, moe.intermediate
    g, u, d = (w.data_ptr() for w in moe.weights)
    grb, urb, drb = (_cpu.type_row_bytes(t, c) for t, c in zip(moe.types, (H, H, I)))
    gu_tasks, dn_tasks, dn_rows = _cpu.moe_split()
    rows_gu = _block_rows(len(experts) * I, threads, gu_tasks, I)
    rows_dn = _block_rows((len(experts) if down_by_expert else 1) * H, threads, dn_tasks,
                          dn_rows if down_by_expert else 256)
    tasks = []
    for e in experts:
        for r0 in range(0, I, rows_gu):
            m = min(rows_gu, I - r0)
            if fused_gate_up:  # the same bytes as one stream (as if gate and up rows were interleaved in memory)
                tasks.append([(g + e * I * grb + 2 * r0 * grb, 2 * m * grb)] if 2 * (r0 + m) <= I else
                             [(u + e * I * urb + (2 * r0 - I) * urb, 2 * m * urb)])
            else:
                tasks.append([(g + (e * I + r0) * grb, m * grb), (u + (e * I + r0) * urb, m * urb)])
    if down_by_expert:
        for e in experts:
            for c0 in range(0, H, rows_dn):
                tasks.append([(d + (e * H + c0) * drb, min(rows_dn, H - c0) * drb)])
    else:
        for c0 in range(0, H, rows_dn):
            m = min(rows_dn, H - c0)
            tasks.append([(d + (e * H + c0) * drb, m * drb) for e in experts])
    return tasks


def flat_tasks(moe, first_expert: int, nbytes: int, n_tasks: int) -> list[list[tuple[int, int]]]:
    """nbytes of the gate weights from first_expert on, in n_tasks equal contiguous pieces."""
    base = moe.weights[0].data_ptr() + first_expert * moe.weights[0].numel() // moe.n_experts
    piece = nbytes // n_tasks // 256 * 256
    return [[(base + i * piece, piece)] for i in range(n_tasks)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--patterns", action="store_true",
                    help="only the memory side: read times of the step's access pattern and of alternatives")
    ap.add_argument("--ab", nargs="+",
                    metavar="NAME=GU,DN,ROWS[,nohelp][,nohp][,norepack][,noclamp][,pfBYTES/HINT][,xpfBYTES][,checked]",
                    help="forward times of several work splits (moe_split) and caller modes, interleaved call by "
                         "call in one process, e.g. base=4,2,256 dn128=4,2,128 nohelp=4,2,256,nohelp; nohp: the "
                         "weights not in transparent huge pages; norepack: Q4_K kept as it is, not repacked into "
                         "Q4_K_X16; noclamp: prefetch past the end of a call's rows; pf4096/0: prefetch distance and "
                         "hint (0 t0, 1 t1, 2 nta); xpf1024: the Q4_K_X16 kernels' distance; checked: inputs through "
                         "CPUMoE._inputs_checked, not the flat check")
    args = ap.parse_args()
    shape = SHAPES["qwen3-next"]
    gen = torch.Generator().manual_seed(0)
    E, H, I = shape.n_experts, shape.hidden, shape.intermediate
    pool = cpu.make_pool(args.threads or cpu.default_threads())
    raw = [random_experts("Q4_K", E, r, c, gen) for r, c in ((I, H), (I, H), (H, I))]
    moe = cpu.CPUMoE(*raw, n_experts=E, hidden=H, intermediate=I, types=("Q4_K",) * 3, pool=pool)  # huge pages
    if args.patterns:
        return patterns(moe, pool, gen, args.iters)
    if args.ab:
        return ab(moe, raw, pool, gen, args.iters, args.ab)
    x = torch.randn(1, H, generator=gen)
    out = torch.empty(1, H)
    routes = _routings(shape, 1, args.iters, gen)
    routes2 = _routings(shape, 1, args.iters, gen)  # the raw calls get their own experts, also cold
    for ids, w in routes[:20]:
        moe(x, ids, w)
    res = {"inputs_us": [], "run_us": [], "run_to_post_us": [], "first_start_us": [], "last_start_us": [],
           "first_end_us": [], "last_end_us": [], "end_to_complete_us": [], "complete_to_return_us": [],
           "forward_us": [], "raw_us": [], "submit_us": [], "work_end_us": [], "empty_us": [],
           "pattern_read_us": [], "flat_read_us": []}
    step_bytes = 0
    raw = moe._moe
    none = torch.full((1, shape.top_k), -1, dtype=torch.int64)
    pool.set_trace(True)
    for (ids, w), (ids2, w2) in zip(routes, routes2):
        t0 = time.perf_counter()
        moe(x, ids, w)
        t1 = time.perf_counter()
        res["forward_us"].append((t1 - t0) * 1e6)
        res["work_end_us"].append(max(r[1] for r in pool.last_trace() if r[2] > 0) / 1e3)
        # the same call in its two parts, on other experts (the Python checks and buffers; the extension's run)
        ids4, w4 = _routings(shape, 1, 1, gen)[0]
        t0 = time.perf_counter_ns()
        xf, i4, w4, o4 = moe._inputs(x, ids4, w4, None)
        t1 = time.perf_counter_ns()
        raw.run(xf.data_ptr(), 1, H, i4.data_ptr(), w4.data_ptr(), shape.top_k, o4.data_ptr(), H)
        t2 = time.perf_counter_ns()
        res["inputs_us"].append((t1 - t0) / 1e3)
        res["run_us"].append((t2 - t1) / 1e3)
        # the run call's timeline (one clock): into C++ and posted, threads start and end, completed, back
        posted, completed = pool.last_job_times()
        tr = [r for r in pool.last_trace() if r[2] > 0]
        res["run_to_post_us"].append((posted - t1) / 1e3)
        res["first_start_us"].append(min(r[0] for r in tr) / 1e3)
        res["last_start_us"].append(max(r[0] for r in tr) / 1e3)
        res["first_end_us"].append(min(r[1] for r in tr) / 1e3)
        res["last_end_us"].append(max(r[1] for r in tr) / 1e3)
        res["end_to_complete_us"].append((completed - posted) / 1e3 - max(r[1] for r in tr) / 1e3)
        res["complete_to_return_us"].append((t2 - completed) / 1e3)
        t0 = time.perf_counter()
        ticket = raw.submit(x.data_ptr(), 1, H, ids2.data_ptr(), w2.data_ptr(), shape.top_k, out.data_ptr(), H)
        t1 = time.perf_counter()
        pool.wait(ticket)
        t2 = time.perf_counter()
        res["submit_us"].append((t1 - t0) * 1e6)
        res["raw_us"].append((t2 - t0) * 1e6)
        t0 = time.perf_counter()
        pool.wait(raw.submit(x.data_ptr(), 1, H, none.data_ptr(), w.data_ptr(), shape.top_k, out.data_ptr(), H))
        res["empty_us"].append((time.perf_counter() - t0) * 1e6)
        # the memory side alone, on experts not touched above (cold, like the steps)
        ids3 = _routings(shape, 1, 1, gen)[0][0]
        tasks = step_tasks(moe, sorted(ids3.flatten().tolist()), pool.size)
        step_bytes = sum(n for t in tasks for _, n in t)
        res["pattern_read_us"].append(_cpu.read_tasks(pool, tasks) * 1e6)
        first = int(torch.randint(0, E - 40, (1,), generator=gen))
        res["flat_read_us"].append(_cpu.read_tasks(pool, flat_tasks(moe, first, step_bytes, len(tasks))) * 1e6)
    pool.set_trace(False)
    med = {k: round(statistics.median(v), 1) for k, v in res.items()}
    gbs = {f"{k[:-3]}_gb_per_s": round(step_bytes / (med[k] * 1e3), 1)
           for k in ("forward_us", "work_end_us", "pattern_read_us", "flat_read_us")}
    probe = cpu.stream_bandwidth(moe.weights, reps=3, pool=pool)
    print(json.dumps(med | gbs | {"read_gb_per_s": round(probe, 1), "step_bytes": step_bytes, "threads": pool.size}))


def ab(moe, raw, pool, gen, iters: int, specs: list[str]) -> None:
    """Interleaved A/B of work splits: one forward per config per round, each on a fresh routing."""
    shape = SHAPES["qwen3-next"]
    configs = {}
    for spec in specs:
        name, _, val = spec.partition("=")
        parts = val.split(",")
        pf = next((tuple(int(x) for x in f[2:].split("/")) for f in parts[3:] if f.startswith("pf")), None)
        xpf = next((int(f[3:]) for f in parts[3:] if f.startswith("xpf")), None)
        variant = ("nohp" not in parts[3:], "norepack" not in parts[3:])  # (hugepages, repack)
        configs[name] = (tuple(int(v) for v in parts[:3]), "nohelp" not in parts[3:], variant,
                         "noclamp" not in parts[3:], pf, "checked" in parts[3:], xpf)
    # Per (hugepages, repack): the layer's weights held that way (without huge pages: 4 KiB pages unless THP is
    # "always").
    variants = {(True, True): moe}
    for v in {c[2] for c in configs.values()} - variants.keys():
        variants[v] = cpu.CPUMoE(*raw, n_experts=moe.n_experts, hidden=moe.hidden, intermediate=moe.intermediate,
                                 types=moe.types, pool=pool, hugepages=v[0], repack=v[1])
    flat = variants.get((False, True)) or next((m for v, m in variants.items() if not v[0]), None)
    x = torch.randn(1, moe.hidden, generator=gen)
    times = {k: [] for k in configs}
    old, old_pf, old_xpf = _cpu.moe_split(), _cpu.prefetch(), _cpu.x16_prefetch()
    probe0 = cpu.stream_bandwidth(moe.weights, reps=3, pool=pool)
    old_clamp = _cpu.set_prefetch_clamp(True)
    try:
        for i in range(iters + 20):
            for name, (split, helps, variant, clamp, pf, checked, xpf) in configs.items():
                _cpu.set_moe_split(*split)
                _cpu.set_prefetch(*(pf or old_pf))
                _cpu.set_x16_prefetch(old_xpf if xpf is None else xpf)
                _cpu.set_prefetch_clamp(clamp)
                pool.caller_helps = helps
                ids, w = _routings(shape, 1, 1, gen)[0]
                m = variants[variant]
                t0 = time.perf_counter()
                if checked:  # the general input path (every check, in helper functions) instead of the flat one
                    xf, i2, w2, o2 = m._inputs_checked(x, ids, w, None)
                    m._moe.run(xf.data_ptr(), xf.shape[0], m.hidden, i2.data_ptr(), w2.data_ptr(), i2.shape[1],
                               o2.data_ptr(), m.hidden)
                else:
                    m(x, ids, w)
                if i >= 20:
                    times[name].append(time.perf_counter() - t0)
    finally:
        _cpu.set_moe_split(*old)
        _cpu.set_prefetch(*old_pf)
        _cpu.set_x16_prefetch(old_xpf)
        _cpu.set_prefetch_clamp(old_clamp)
        pool.caller_helps = True
    probe = max(probe0, cpu.stream_bandwidth(moe.weights, reps=3, pool=pool))
    nbytes = 10 * moe.expert_bytes
    row = {}
    for k, v in times.items():
        us = statistics.median(v) * 1e6
        gbs = nbytes / us / 1e3
        row[k] = {"us": round(us, 1), "gb_per_s": round(gbs, 1), "ratio": round(gbs / probe, 3)}
    extra = {"hugepages": moe.hugepages, "layouts": moe.layouts}
    if flat is not None:
        try:
            rollup = open("/proc/self/smaps_rollup").read()
            anon_huge = next(int(l.split()[1]) for l in rollup.splitlines() if l.startswith("AnonHugePages"))
        except (OSError, StopIteration):
            anon_huge = None
        extra |= {"anon_huge_mb": anon_huge and anon_huge // 1024,
                  "read_gb_per_s_in_place": round(cpu.stream_bandwidth(flat.weights, reps=3, pool=pool), 1)}
    print(json.dumps(row | {"read_gb_per_s": round(probe, 1), "threads": pool.size} | extra))


def patterns(moe, pool, gen, iters: int) -> None:
    """Median read time (us) and GB/s of each access pattern, each read on fresh random experts."""
    shape = SHAPES["qwen3-next"]
    times, nbytes = {}, {}

    def fresh() -> list[int]:
        return sorted(_routings(shape, 1, 1, gen)[0][0].flatten().tolist())

    def read(name: str, tasks) -> None:
        nbytes[name] = sum(n for t in tasks for _, n in t)
        times.setdefault(name, []).append(_cpu.read_tasks(pool, tasks))

    n_gu = shape.top_k * -(-moe.intermediate // _block_rows(shape.top_k * moe.intermediate, pool.size,
                                                              _cpu.moe_split()[0], moe.intermediate))
    for _ in range(iters):
        step = step_tasks(moe, fresh(), pool.size)
        read("step", step)
        read("down_rows", step_tasks(moe, fresh(), pool.size, down_by_expert=False))
        read("fused_gate_up", step_tasks(moe, fresh(), pool.size, fused_gate_up=True))
        read("gate_up_only", step_tasks(moe, fresh(), pool.size)[:n_gu])
        read("down_only", step_tasks(moe, fresh(), pool.size)[n_gu:])
        read("down_rows_only", step_tasks(moe, fresh(), pool.size, down_by_expert=False)[n_gu:])
        first = int(torch.randint(0, moe.n_experts - 40, (1,), generator=gen))
        read("flat", flat_tasks(moe, first, nbytes["step"], len(step)))
    row = {}
    for k, v in times.items():
        us = statistics.median(v) * 1e6
        row[k] = {"us": round(us, 1), "gb_per_s": round(nbytes[k] / us / 1e3, 1)}
    row["read_gb_per_s"] = round(cpu.stream_bandwidth(moe.weights, reps=3, pool=pool), 1)
    print(json.dumps(row | {"threads": pool.size}))


if __name__ == "__main__":
    main()
