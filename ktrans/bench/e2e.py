"""`ktrans bench e2e`: the whole model, loaded once, measured through the engine's own step.

The benchmark submits requests to an `Engine` and calls `engine.poll()` itself (what the serving thread does), so
every step is timed from this thread with nothing idle in between. For each batch size it submits that many
random prompts of `--prompt_len` tokens with greedy sampling, `ignore_eos` and `--gen_len` new tokens each:

- `prefill_tok_s`: prompt tokens over the time to the first token, batch 1;
- `decode_tok_s`: tokens generated in the steps where the whole batch decodes (every request has its first token
  and none has finished), over those steps' time;
- `ttft_ms` / `tpot_ms`: per request, from submit to the end of the step that produced its first token, and the
  mean step time between its later tokens (means over the batch);
- `split_ms`: one batch-1 decode token split into `gpu` (the GPU's kernel time: the union of its kernels' own
  start and end stamps, read by torch.profiler over `--profile_steps` extra steps), `cpu_experts` (the CPU pool's
  own busy time: the union of its jobs' posted-to-complete spans, counted in C++), and `host`: the rest of the
  step's wall time (wall - gpu - cpu_experts; where the GPU and the CPU experts overlap it is an undercount).
  The flag path's poll for the CPU experts (a one-program kernel, KTRANS_STREAM_FLAGS=1) is waiting, not GPU
  work: it is left out of `gpu` and reported as `cpu_wait` (ms).
  `gpu_span` is the step's span on the stream between two CUDA events; `device_ops_per_token` counts the kernels,
  copies and memsets the profiler saw on the device per batch-1 decode step, `host_launches_per_token` the CUDA
  runtime calls the host made to put them there (equal without CUDA graphs; one graph launch stands for a replayed
  step's kernels). `gpu_kernels_us`: the busiest kernels, (us, calls) a step, by span; `gpu_kernels_own_us`: by own
  time, the part of a kernel's span after everything before it has ended, so a kernel launched early under
  programmatic dependent launch does not count its wait for its predecessor (these add up to `gpu` with the poll).
  `cuda_graphs`: graphs captured and replays (`--no-use_cuda_graph`: eager steps).

Also reported: load time, host RSS (now and peak), and each GPU's memory (allocated, peak, reserved).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ktrans.bench.measure import TOP_KERNELS, busy_union, cuda_devices, gpu_memory, host_memory, top_kernels
from ktrans.engine.sampler import SamplingParams
from ktrans.kernels import cpu
from ktrans.kernels.triton import CompileLog


@dataclass
class E2EOptions:
    gguf_path: str | None = None
    model_path: str | None = None
    optimize_config_path: str | None = None
    prompt_len: int = 512
    gen_len: int = 64
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    chunk_size: int | None = None  # None: as ktrans serve's default for the model (engine.default_chunk_size)
    cpu_infer: int | None = None
    dtype: str | None = None  # as ktrans serve: bfloat16 where the rules use CUDA, else float32
    seed: int = 0
    profile_steps: int = 8
    # also profile steps of this many requests decoding together (0: only batch 1): where a batch's step goes, by
    # kernel, beside the batch-1 split
    profile_batch: int = 0
    use_cuda_graph: bool | None = None  # as ktrans serve: on where the model's batches are on a GPU
    prefill_lens: tuple[int, ...] = ()  # more prompt lengths whose time to first token is measured (batch 1)
    itl_prefill_len: int = 0  # a prompt this long arrives while itl_decodes requests decode: their ITL (0: skip)
    itl_decodes: int = 4
    warmup: bool = True  # the engine's warm-up (what ktrans serve runs before it listens) before measuring
    # the engine as ktrans serve sizes it (None: what the runs need); a run that needs more gets more, and the JSON's
    # "engine" says what it got. The memory figures depend on these: a serve placement's GPU memory is mostly the
    # KV cache (cache_lens) and the DeltaNet slots (max_batch_size + prefix_cache_max_snapshots)
    max_batch_size: int | None = None
    cache_lens: int | None = None
    prefix_cache_max_snapshots: int | None = None
    num_gpu_experts: int | None = None  # as ktrans serve's --num_gpu_experts
    gpu_experts_from: str | None = None  # as ktrans serve's
    routing_stats_out: str | None = None  # as ktrans serve's: the measured runs' routing (after the warm-up)

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"--prompt_len must be >= 1, got {self.prompt_len}")
        if self.gen_len < 2:
            raise ValueError(f"--gen_len must be >= 2 (decode is measured after the first token), got {self.gen_len}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch_sizes must be positive integers, got {self.batch_sizes}")
        if self.prefill_lens and min(self.prefill_lens) < 1:
            raise ValueError(f"--prefill_lens must be positive integers, got {self.prefill_lens}")
        if self.profile_steps < 0:
            raise ValueError(f"--profile_steps must be >= 0, got {self.profile_steps}")
        if self.profile_batch < 0:
            raise ValueError(f"--profile_batch must be >= 0, got {self.profile_batch}")
        for name in ("max_batch_size", "cache_lens", "prefix_cache_max_snapshots"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.itl_prefill_len < 0 or self.itl_decodes < 1:
            raise ValueError(f"--itl_prefill_len must be >= 0 and --itl_decodes >= 1, got {self.itl_prefill_len} "
                             f"and {self.itl_decodes}")


WAIT_KERNEL = "_cpu_wait_kernel"  # ktrans.kernels.triton.stage: polls for the CPU experts, counted as waiting
_ITL_BEFORE = 16  # decode-only steps in the ITL sample before the long prompt arrives

# CUDA runtime calls that put work on a stream, as torch.profiler names them.
_LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                           "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy", "cudaMemset"})


@dataclass
class _Step:
    wall_s: float
    cpu_busy_s: float
    tokens: int  # new tokens the step produced
    decode: bool  # every request of the batch had its first token before the step began, and none had finished
    gpu_span_s: float = 0.0


@dataclass
class _Run:
    steps: list[_Step] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


class _Bench:
    def __init__(self, engine, pool, devices: list[torch.device], seed: int):
        self.engine, self.pool, self.devices = engine, pool, devices
        self.gen = torch.Generator().manual_seed(seed)
        tok_vocab = getattr(engine.tokenizer, "vocab_size", None) or engine.model_config.vocab_size
        self.vocab = min(engine.model_config.vocab_size, tok_vocab)

    def _busy_s(self) -> float:
        return self.pool.busy()[1] / 1e9 if self.pool is not None else 0.0

    def _sync(self) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)

    def run(self, batch: int, prompt_len: int, gen_len: int) -> _Run:
        params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
        prompts = [torch.randint(0, self.vocab, (prompt_len,), generator=self.gen).tolist() for _ in range(batch)]
        run = _Run()
        self._sync()
        t_submit = time.perf_counter()
        streams = [self.engine.submit(p, params) for p in prompts]
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        counts = [0] * batch
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in self.devices]
        while True:
            decode = len(first) == batch and max(counts) < gen_len
            busy0, t0 = self._busy_s(), time.perf_counter()
            for d, (e0, _) in zip(self.devices, events):
                e0.record(torch.cuda.current_stream(d))
            if not self.engine.poll():
                break
            for d, (_, e1) in zip(self.devices, events):
                e1.record(torch.cuda.current_stream(d))
            self._sync()
            t1 = time.perf_counter()
            step = _Step(t1 - t0, self._busy_s() - busy0, 0, decode,
                         max((e0.elapsed_time(e1) / 1e3 for e0, e1 in events), default=0.0))
            for i, s in enumerate(streams):
                for out in s.drain():
                    if out.error:
                        raise RuntimeError(f"request failed in the engine: {out.error}")
                    n = len(out.token_ids)
                    if n:
                        step.tokens += n
                        counts[i] += n
                        first.setdefault(i, t1)
                        last[i] = t1
            run.steps.append(step)
        if any(c != gen_len for c in counts):
            raise RuntimeError(f"expected {gen_len} tokens per request, got {counts}")
        run.ttft_s = [first[i] - t_submit for i in range(batch)]
        run.tpot_s = [(last[i] - first[i]) / (gen_len - 1) for i in range(batch)]
        return run

    def itl_during_prefill(self, decodes: int, prompt_len: int, long_len: int, gen_len: int) -> dict:
        """The inter-token latency of `decodes` requests while a `long_len`-token prompt arrives and is prefilled in
        chunks beside them (each step carries their decode tokens and a chunk of it; every step's wall time is kept,
        in order, as chunk_walls_ms). The sample is every ITL of the
        decoders from _ITL_BEFORE decode-only steps before the long prompt is submitted until its first token; the
        chunk time is the median wall time of the steps that carried its chunks. Chunked prefill keeps the decodes
        flowing when ITL p99 <= chunk time + 2 ITL p50 (`holds`)."""
        params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
        streams = [self.engine.submit(torch.randint(0, self.vocab, (prompt_len,), generator=self.gen).tolist(),
                                      params) for _ in range(decodes)]
        times: list[list[float]] = [[] for _ in streams]
        long_stream, t_long, t_long_first, chunk_walls, decode_steps = None, None, None, [], 0
        chunk_tokens: list[int] = []

        def step() -> bool:
            t0 = time.perf_counter()
            alive = self.engine.poll()
            self._sync()
            t1 = time.perf_counter()
            for i, s in enumerate(streams):
                for out in s.drain():
                    if out.error:
                        raise RuntimeError(f"request failed in the engine: {out.error}")
                    times[i] += [t1] * len(out.token_ids)
            if t_long is not None and t_long_first is None:
                chunk_walls.append(t1 - t0)
                chunk_tokens.append(self.engine.last_step_tokens)
            return alive

        while min(len(t) for t in times) == 0 or decode_steps < _ITL_BEFORE:  # the decoders' prefill, then steady
            if min(len(t) for t in times) > 0:
                decode_steps += 1
            if not step():
                raise RuntimeError("the decoders finished before the long prompt came")
        t_start = max(t[0] for t in times)  # every decoder past its first token: the decode-only steps follow
        long_stream = self.engine.submit(torch.randint(0, self.vocab, (long_len,), generator=self.gen).tolist(),
                                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        t_long = time.perf_counter()
        while t_long_first is None:
            if not step():
                raise RuntimeError("the engine went idle before the long prompt's first token")
            for out in long_stream.drain():
                if out.error:
                    raise RuntimeError(f"the long prompt failed in the engine: {out.error}")
                if out.token_ids and t_long_first is None:
                    t_long_first = time.perf_counter()
        if min(len(t) for t in times) >= gen_len:
            raise RuntimeError("the decoders finished before the long prompt's first token: raise their tokens")
        for s in streams:
            self.engine.abort(s.request_id)
        while self.engine.poll():
            pass
        long_stream.drain()
        itl = sorted(b - a for t in times for a, b in zip(t, t[1:]) if a >= t_start and b <= t_long_first)
        pct = lambda q: itl[min(len(itl) - 1, int(q * len(itl)))]  # noqa: E731
        chunk = sorted(chunk_walls)[len(chunk_walls) // 2]
        return {"decodes": decodes, "prompt_len": long_len, "ttft_ms": 1e3 * (t_long_first - t_long),
                "chunk_steps": len(chunk_walls), "chunk_ms": 1e3 * chunk, "chunk_ms_max": 1e3 * max(chunk_walls),
                "chunk_walls_ms": [round(1e3 * w, 2) for w in chunk_walls],  # in order: which chunk is slow
                "chunk_tokens": chunk_tokens,  # each of those steps' tokens (decode rows plus the chunk)
                "itl_count": len(itl), "itl_p50_ms": 1e3 * pct(0.5), "itl_p99_ms": 1e3 * pct(0.99),
                "itl_max_ms": 1e3 * itl[-1], "holds": pct(0.99) <= chunk + 2 * pct(0.5)}

    def gpu_busy_per_step(self, steps: int, prompt_len: int, batch: int = 1, max_tokens: int = 0
                          ) -> tuple[float, float, float, dict, dict, float] | None:
        """(mean GPU busy seconds, device operations, host launches, the TOP_KERNELS kernels by device time: name ->
        (us, calls) a step, the same by own time: measure.own_times, mean wall seconds) of a decode step of `batch`
        requests, from the profiler (None without CUDA). A device operation is one kernel, copy or memset on the
        device; a host launch is one CUDA runtime call that puts work on a stream (a kernel, copy, memset or whole
        graph): without CUDA graphs the two counts are about equal, with them one graph launch carries the step's
        kernels. The requests are all past their prefill before the profiled steps start, and none ends in them
        (each asks for max_tokens, at least steps + 2: the first to start must outlast the others' prefills; a
        request that produced other than one token a profiled step raises)."""
        if not self.devices or steps == 0:
            return None
        from torch.profiler import ProfilerActivity, profile

        params = SamplingParams(temperature=0.0, max_tokens=max(steps + 2, max_tokens), ignore_eos=True)
        streams = [self.engine.submit(torch.randint(0, self.vocab, (prompt_len,), generator=self.gen).tolist(),
                                      params) for _ in range(batch)]
        started = [False] * batch
        while not all(started) and self.engine.poll():  # prefills and the first decode steps, unprofiled
            started = [s or bool(st.drain()) for s, st in zip(started, streams)]
        if not all(started):
            raise RuntimeError(f"bench e2e: the engine stopped before the {batch} profiled requests decoded")
        self._sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                self.engine.poll()
            self._sync()
            wall = (time.perf_counter() - t0) / steps
        made = [sum(len(o.token_ids) for o in st.drain()) for st in streams]
        while self.engine.poll():
            pass
        if made != [steps] * batch:
            raise RuntimeError(f"bench e2e: the {steps} profiled steps were not all {batch}-request decode steps "
                               f"(tokens each request made in them: {made}); a longer --gen_len lets the first "
                               "requests outlast the others' prefills")
        device_ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        # the flag path's poll for the CPU experts is the stream waiting, not the GPU working (see `cpu_wait` in
        # the split: it is in the top kernels' list, out of the busy union). A kernel launched with programmatic
        # dependent launch (KTRANS_PDL) starts before its predecessor ends and waits for it: only the part of its
        # span after everything before it has ended counts, so the kernel after the poll is not counted as busy
        # while the poll runs
        busy_us = busy_union([(e.time_range.start, e.time_range.end, WAIT_KERNEL in e.name) for e in device_ops])
        launches = [e for e in prof.events() if e.name in _LAUNCH_CALLS]
        return (busy_us / 1e6 / steps, len(device_ops) / steps, len(launches) / steps, top_kernels(device_ops, steps),
                top_kernels(device_ops, steps, own=True), wall)


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _summary(run: _Run, batch: int) -> dict:
    dec = [s for s in run.steps if s.decode]
    dec_s = sum(s.wall_s for s in dec)
    n = sum(s.tokens for s in dec)  # batch tokens per decode step
    out = {
        "batch_size": batch,
        "decode_tok_s": n / dec_s if dec_s > 0 else None,
        "ttft_ms": 1e3 * _mean(run.ttft_s),
        "tpot_ms": 1e3 * _mean(run.tpot_s),
        "steps": len(run.steps),
        "decode_steps": len(dec),
    }
    if dec:
        out["step_ms"] = {"wall": 1e3 * dec_s / len(dec), "cpu_experts": 1e3 * sum(s.cpu_busy_s for s in dec) / len(dec),
                          "gpu_span": 1e3 * sum(s.gpu_span_s for s in dec) / len(dec)}
        # a step that compiled a kernel or captured a graph moves the mean, not the median
        out["step_ms_median"] = 1e3 * statistics.median(s.wall_s for s in dec)
        # the CPU experts' time a step: min, median, max (a slow run slow in every step points at the memory or the
        # clocks, a few slow steps at a thread preempted on a worker's core)
        cpu = sorted(1e3 * s.cpu_busy_s for s in dec)
        out["cpu_experts_step_ms"] = [cpu[0], statistics.median(cpu), cpu[-1]]
        out["per_token_ms"] = {k: v * len(dec) / n for k, v in out["step_ms"].items()}
    return out


def run(opts: E2EOptions, show_progress: bool = True, log=print) -> dict:
    from ktrans.operators.experts_cpu import KExpertsCPU
    from ktrans.engine.engine import Engine, EngineConfig, default_chunk_size
    from ktrans.api.server import ServeOptions, check_routing_stats_out, load, save_routing_stats
    from ktrans.operators.routing_stats import ROUTING

    check_routing_stats_out(opts.routing_stats_out)
    t0 = time.perf_counter()
    serve = ServeOptions(model_path=opts.model_path, gguf_path=opts.gguf_path,
                         optimize_config_path=opts.optimize_config_path, cpu_infer=opts.cpu_infer, dtype=opts.dtype,
                         num_gpu_experts=opts.num_gpu_experts, gpu_experts_from=opts.gpu_experts_from)
    model, tokenizer, name, injection = load(serve, show_progress=show_progress)
    load_s = time.perf_counter() - t0
    devices = cuda_devices(model)
    max_b = max(*opts.batch_sizes, opts.profile_batch)
    per_req = opts.prompt_len + opts.gen_len + 1
    longest = max((n + 3 for n in opts.prefill_lens), default=0)  # a prefill-only request: prompt, 2 tokens
    chunk = opts.chunk_size or default_chunk_size(model)
    itl_gen = itl_cache = 0
    if opts.itl_prefill_len:  # the decoders' tokens must outlast the long prompt's chunks
        itl_gen = _ITL_BEFORE + -(-opts.itl_prefill_len // max(1, chunk - opts.itl_decodes)) + 16
        itl_cache = opts.itl_decodes * (opts.prompt_len + itl_gen + 1) + opts.itl_prefill_len + 3
        max_b = max(max_b, opts.itl_decodes + 1)
        longest = max(longest, opts.prompt_len + itl_gen + 1, opts.itl_prefill_len + 3)
    max_b = max(max_b, opts.max_batch_size or 0)
    needed = max(max_b * per_req, longest, itl_cache) + 16 * max_b
    engine = Engine(model, tokenizer, EngineConfig(
        max_batch_size=max_b, chunk_size=chunk, cache_lens=max(needed, opts.cache_lens or 0),
        max_new_tokens=opts.gen_len, max_model_len=max(per_req, longest) + 16, use_cuda_graph=opts.use_cuda_graph,
        prefix_cache_max_snapshots=opts.prefix_cache_max_snapshots or EngineConfig.prefix_cache_max_snapshots))
    pool = cpu.get_pool() if any(isinstance(m, KExpertsCPU) for m in model.modules()) else None
    bench = _Bench(engine, pool, devices, opts.seed)
    log(f"ktrans bench e2e: loaded {name} in {load_s:.1f} s; warming up")
    # What `ktrans serve` runs before it listens (every kind of step once: first calls, compiles, graph captures),
    # then each step size the measured prompts take (a whole chunk, and shorter prompts whole): ops switch kernels
    # by token count, and split prefill measures its rates per token bucket
    warmup = engine.warm_up() if opts.warmup else {"seconds": 0.0}
    for n in sorted({min(n, chunk) for n in (opts.prompt_len, *opts.prefill_lens)}):
        if n > 16:
            bench.run(1, n, 2)
    if opts.routing_stats_out:
        ROUTING.start()

    results = []
    prefill_tok_s = None
    split = None
    att = sys.modules.get("ktrans.kernels.triton.attention")  # imported where the model runs the Triton attention
    tuners = (att._prefill_tuned, att._decode_tuned) if att is not None else ()
    # what the measured phases compiled or autotuned: the warm-up's misses
    compiles = {"decode": CompileLog(tuners), "itl": CompileLog(tuners)}
    graphs = engine.runner.graphs
    for b in opts.batch_sizes:
        if graphs is not None:  # the shape once beforehand: the graphs of its (batch, KV length) buckets, which the
            bench.run(b, opts.prompt_len, opts.gen_len)  # warm-up's short prompts leave, captured outside the figure
        captures = graphs.num_captures if graphs is not None else 0
        with compiles["decode"]:
            r = bench.run(b, opts.prompt_len, opts.gen_len)
        s = _summary(r, b)
        s["graph_captures"] = (graphs.num_captures - captures) if graphs is not None else None
        if b == 1:
            prefill_tok_s = opts.prompt_len / r.ttft_s[0]
            s["prefill_tok_s"] = prefill_tok_s
        results.append(s)
        log(f"  batch {b:>3}: decode {s['decode_tok_s'] or 0:.2f} tok/s, TTFT {s['ttft_ms']:.0f} ms, "
            f"TPOT {s['tpot_ms']:.1f} ms" + (f", median step {s['step_ms_median']:.1f} ms" if "step_ms_median" in s
                                             else ""))
    one = next((s for s in results if s["batch_size"] == 1), None)
    if one is None:  # prefill and the split are of one request: measure one if the list left it out
        r = bench.run(1, opts.prompt_len, opts.gen_len)
        one, prefill_tok_s = _summary(r, 1), opts.prompt_len / r.ttft_s[0]
    prefill = []
    for n in opts.prefill_lens:
        r = bench.run(1, n, 2)
        prefill.append({"tokens": n, "ttft_ms": 1e3 * r.ttft_s[0], "tok_s": n / r.ttft_s[0]})
        log(f"  prefill {n:>6} tokens: TTFT {1e3 * r.ttft_s[0]:.0f} ms, {n / r.ttft_s[0]:.1f} tok/s")
    itl = None
    if opts.itl_prefill_len:
        with compiles["itl"]:
            itl = bench.itl_during_prefill(opts.itl_decodes, opts.prompt_len, opts.itl_prefill_len, itl_gen)
        steps = ", ".join(f"{w:.0f} ms/{n}" for w, n in zip(itl["chunk_walls_ms"], itl["chunk_tokens"]))
        log(f"  {opts.itl_decodes} decodes while a {opts.itl_prefill_len}-token prompt prefills: ITL p50 "
            f"{itl['itl_p50_ms']:.1f} ms, p99 {itl['itl_p99_ms']:.1f} ms, chunk {itl['chunk_ms']:.1f} ms "
            f"x {itl['chunk_steps']} ({steps} tokens), TTFT {itl['ttft_ms']:.0f} ms")
    for phase, got in compiles.items():
        if got.compiled or got.tuned:
            log(f"  during the measured {phase} steps: {len(got.compiled)} Triton compiles "
                f"({', '.join(got.kernels)}), {len(got.tuned)} autotunings ({', '.join(got.tuned)})")
    profiled = bench.gpu_busy_per_step(opts.profile_steps, opts.prompt_len)
    gpu_s, device_ops, launches, top, own, _ = profiled if profiled is not None else (None,) * 6
    profiled_batch = None
    if opts.profile_batch:
        got = bench.gpu_busy_per_step(opts.profile_steps, opts.prompt_len, opts.profile_batch, opts.gen_len)
        if got is not None:
            busy, ops, _, top_b, own_b, wall_b = got
            profiled_batch = {"batch_size": opts.profile_batch, "wall_ms": 1e3 * wall_b, "gpu_ms": 1e3 * busy,
                              "device_ops": ops, "gpu_kernels_us": top_b, "gpu_kernels_own_us": own_b}
            log(f"  a {opts.profile_batch}-request decode step (profiled): wall {1e3 * wall_b:.2f} ms, GPU busy "
                f"{1e3 * busy:.2f} ms, {ops:.0f} device ops; own time by kernel (us, calls): " +
                "; ".join(f"{k} {us:.0f} ({n:g})" for k, (us, n) in list(own_b.items())[:10]))
    if "step_ms" in one:
        wall, cpu_ms = one["step_ms"]["wall"], one["step_ms"]["cpu_experts"]
        gpu_ms = 1e3 * gpu_s if gpu_s is not None else 0.0
        split = {"wall": wall, "gpu": gpu_ms, "cpu_experts": cpu_ms, "host": max(0.0, wall - gpu_ms - cpu_ms),
                 "gpu_span": one["step_ms"]["gpu_span"], "gpu_measured": gpu_s is not None,
                 "device_ops_per_token": device_ops, "host_launches_per_token": launches, "gpu_kernels_us": top,
                 "gpu_kernels_own_us": own,
                 "cpu_wait": sum(us for k, (us, _) in (top or {}).items() if WAIT_KERNEL in k) / 1e3,
                 "cpu_experts_step_ms": one.get("cpu_experts_step_ms")}
        if top:
            log("  GPU time of a batch-1 decode step by kernel (us, calls): " +
                "; ".join(f"{k} {us:.0f} ({n:g})" for k, (us, n) in list(top.items())[:6]))
            log("  the same, each kernel's own time (its span after all before it ended: no wait for a predecessor): " +
                "; ".join(f"{k} {us:.0f} ({n:g})" for k, (us, n) in list((own or {}).items())[:8]))

    result = {
        "model": name,
        "gguf_path": opts.gguf_path,
        "rules": str(opts.optimize_config_path) if opts.optimize_config_path else None,
        "options": {k: v for k, v in asdict(opts).items() if k not in ("gguf_path", "model_path")},
        "chunk_size": chunk,
        "engine": {"max_batch_size": engine.config.max_batch_size, "cache_lens": engine.config.cache_lens,
                   "prefix_cache_max_snapshots": engine.config.num_snapshot_slots},
        "layers": model.config.num_hidden_layers,
        "threads": pool.size if pool is not None else torch.get_num_threads(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads_per_core": len(cpu.core_siblings(0)), "pool_pinned": pool.pinned if pool else None,
                    "gpus": [torch.cuda.get_device_name(d) for d in devices]},
        "load_s": load_s,
        "warmup_s": warmup["seconds"],
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": {str(s["batch_size"]): s["decode_tok_s"] for s in results},
        "ttft_ms": {str(s["batch_size"]): s["ttft_ms"] for s in results},
        "tpot_ms": {str(s["batch_size"]): s["tpot_ms"] for s in results},
        "split_ms": split,
        "profiled_batch": profiled_batch,
        "prefill": prefill,
        "itl_during_prefill": itl,
        "triton_compiles": {phase: got.compiled for phase, got in compiles.items()},
        "triton_autotuned": {phase: got.tuned for phase, got in compiles.items()},
        "split_prefill": _split_prefill(model),
        "cuda_graphs": (None if engine.runner.graphs is None else
                        {"captured": engine.runner.graphs.num_captures, "replays": engine.runner.graphs.num_replays}),
        "batches": results,
        **host_memory(),
        "numa_nodes": len(cpu.numa_nodes()),  # two or more: the CPU experts' workers may read remote memory
        "gpu_memory": gpu_memory(devices),
    }
    if opts.routing_stats_out:
        save_routing_stats(opts.routing_stats_out)
    return result


def _split_prefill(model) -> dict | None:
    """The split-prefill experts' measured rates and last split, where the rules use KExpertsSplit."""
    if "ktrans.operators.experts_split" not in sys.modules:  # never imported: not in these rules (and no triton)
        return None
    from ktrans.operators.experts_split import summary

    return summary(model)


def main(args) -> int:
    fields = {k: v for k, v in vars(args).items() if k in E2EOptions.__dataclass_fields__}
    opts = E2EOptions(**{**fields, "batch_sizes": tuple(args.batch_sizes), "prefill_lens": tuple(args.prefill_lens)})
    quiet = args.json
    # with --json stdout is the JSON alone; the progress lines go to stderr as they come
    out = run(opts, show_progress=not quiet,
              log=(lambda *a: print(*a, file=sys.stderr, flush=True)) if quiet else print)
    if args.json:
        print(json.dumps(out))
    else:
        sp = out["split_ms"]
        print(f"prefill {out['prefill_tok_s'] or 0:.1f} tok/s; load {out['load_s']:.1f} s, "
              f"RSS {out['host_rss_gib'] or 0:.1f} GiB ({out['host_hugepages_gib'] or 0:.1f} GiB in huge pages)")
        if sp:
            # The pool runs the CPU experts, and on the CPU placement also every projection, lm_head and (with
            # more than one worker) the DeltaNet and attention steps: "CPU pool" then, not "CPU experts".
            pool = "CPU experts" if sp["gpu_span"] else "CPU pool"
            print(f"one decode token: {sp['wall']:.2f} ms = GPU {sp['gpu']:.2f} + {pool} {sp['cpu_experts']:.2f} "
                  f"+ host {sp['host']:.2f}" + ("" if sp["gpu_measured"] else " (no GPU)"))
    return 0
