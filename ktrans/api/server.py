"""`ktrans serve`: load the model, size the KV cache and state pool, print what went where, run uvicorn.

ServeOptions holds the flags (KTransformers' names); `start_background` runs the same server in a thread on a
loopback port, for tests and benchmarks.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ktrans.runtime.batch import PHASES
from ktrans.runtime.pools import KVPool, StatePool
from ktrans.api.app import DEFAULT_MAX_REQUEST_BODY_BYTES, OpenAIServer
from ktrans.engine.engine import Engine, EngineConfig, default_chunk_size
from ktrans.engine.metrics import EngineMetrics

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    model_path: str | None = None
    gguf_path: str | None = None
    optimize_config_path: str | None = None
    backend_type: str = "balance_serve"
    host: str = "127.0.0.1"
    port: int = 10021
    served_model_name: str | None = None
    api_key: str | None = None
    max_new_tokens: int = 1024
    cache_lens: int = 32768
    cache_memory_fraction: float | None = None
    page_size: int = 16
    chunk_size: int | None = None  # None: engine.default_chunk_size(model)
    max_batch_size: int = 16
    max_model_len: int | None = None
    max_queued_requests: int = 1024
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    cpu_infer: int | None = None
    use_cuda_graph: bool | None = None  # None: on where the model's batches are on a GPU
    enable_prefix_cache: bool = True
    warmup: bool = True  # Engine.warm_up before listening
    prefix_cache_max_snapshots: int = 32
    prefix_cache_snapshot_interval: int = 0
    dtype: str | None = None  # None: bfloat16 where the rules (or --device) use CUDA, else float32
    device: str = "cpu"
    num_gpu_experts: int | None = None  # None: as the rules say; N: `gpu_experts: N` on their KExpertsCPU rules
    gpu_experts_from: str | None = None  # routing statistics: each layer's N hottest experts on the GPU
    routing_stats_out: str | None = None  # record the routing statistics of what is served, written at exit


def load(opts: ServeOptions, show_progress: bool = True):
    """(model, tokenizer, model name, injection) for the options.

    The model is built under --optimize_config_path, or under the CPU rules when neither rules nor a --device
    other than cpu are given (the embedded default model with no flags at all), else under the default rules on
    --device.
    """
    from ktrans.config import RULES_DIR
    from ktrans.inject import load_model
    from ktrans.inject.rules import load_rules, with_gpu_experts
    from ktrans.model.source import ModelSource, parse_dtype

    if opts.backend_type != "balance_serve":
        raise ValueError(f"--backend_type {opts.backend_type!r}: ktrans serves with 'balance_serve' only")
    if opts.optimize_config_path and opts.device != "cpu":
        raise ValueError("--device places the plain model; with --optimize_config_path the rules place every module")
    if opts.cpu_infer is not None and opts.cpu_infer <= 0:
        raise ValueError(f"--cpu_infer must be positive, got {opts.cpu_infer}")
    threads = opts.cpu_infer or default_cpu_infer()
    torch.set_num_threads(threads)
    from ktrans.kernels import cpu

    cpu.get_pool(threads)  # before the model is built: each KExpertsCPU layer binds the pool it is given
    opened = ModelSource(opts.model_path, opts.gguf_path).open()
    tokenizer = opened.tokenizer  # before the weights: a bad tokenizer fails fast
    rules_path = opts.optimize_config_path or (RULES_DIR / "Qwen3Next-cpu.yaml" if opts.device == "cpu" else None)
    if rules_path:
        rules = load_rules(rules_path)
        if opts.num_gpu_experts is not None or opts.gpu_experts_from:
            rules = with_gpu_experts(rules, opts.num_gpu_experts, stats=opts.gpu_experts_from)
        model, injection = load_model(opened, parse_dtype(opts.dtype, rules.uses_cuda), rules=rules,
                                      show_progress=show_progress)
    else:  # the default rules on --device
        dtype = parse_dtype(opts.dtype, opts.device.startswith("cuda"))
        model, injection = load_model(opened, dtype, opts.device, show_progress=show_progress)
    name = opts.served_model_name or opened.name
    return model, tokenizer, name, injection


def default_cpu_infer() -> int:
    """All cores but one: the HTTP loop, tokenization and detokenization need a core too, and torch's OpenMP
    threads slow down badly when one of them has to share (2 threads on a 2-core box serve at about half the
    speed of 1; see doc/benchmarks.md)."""
    from ktrans.kernels.cpu import default_threads

    return max(1, default_threads() - 1)  # the cores this process may use (affinity), not all the host has


def engine_config(opts: ServeOptions, model) -> EngineConfig:
    snapshots = opts.prefix_cache_max_snapshots if opts.enable_prefix_cache else 0
    cache_lens = opts.cache_lens
    if opts.cache_memory_fraction is not None:  # the state pool holds the snapshot slots too
        cache_lens = cache_lens_for_fraction(model, opts.cache_memory_fraction, opts.max_batch_size + snapshots)
    return EngineConfig(max_batch_size=opts.max_batch_size, chunk_size=opts.chunk_size or default_chunk_size(model),
                        page_size=opts.page_size,
                        cache_lens=cache_lens, max_model_len=opts.max_model_len, max_new_tokens=opts.max_new_tokens,
                        max_queued_requests=opts.max_queued_requests, enable_prefix_cache=opts.enable_prefix_cache,
                        prefix_cache_max_snapshots=opts.prefix_cache_max_snapshots,
                        prefix_cache_snapshot_interval=opts.prefix_cache_snapshot_interval,
                        use_cuda_graph=opts.use_cuda_graph)


def cache_lens_for_fraction(model, fraction: float, num_slots: int) -> int:
    """KV tokens that fit in `fraction` of the free memory of each device holding KV pages or DeltaNet slots, after
    its state slots: the least over those devices (a model split over GPUs has a pool part on each)."""
    from ktrans.inject import layer_devices

    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--cache_memory_fraction must be in (0, 1], got {fraction}")
    c = model.config
    p = next(model.parameters())
    where = layer_devices(model) or {0: p.device}
    tokens = None
    for dev in dict.fromkeys(where.values()):
        if dev.type == "cuda":
            free = torch.cuda.mem_get_info(dev)[0]
        else:
            meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            free = int(meminfo["MemAvailable"].split()[0]) * 1024
        n_attn = sum(where.get(i) == dev for i in c.full_attention_layers)
        n_lin = sum(where.get(i) == dev for i in c.linear_attention_layers)
        per_token = KVPool.bytes_per_token(c, p.dtype, n_attn)
        budget = fraction * free - num_slots * StatePool.bytes_per_slot(c, p.dtype, n_lin)
        fit = int(budget // per_token) if per_token else None
        if fit is not None:
            tokens = fit if tokens is None else min(tokens, fit)
    if tokens is None or tokens <= 0:
        raise ValueError(f"--cache_memory_fraction {fraction} leaves no memory for the KV cache")
    return tokens


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def placement_lines(injection) -> list[str]:
    """Operators grouped by class and where each phase runs: `12 x KQwen3NextAttention  prefill cpu ...`."""
    if injection is None:
        return []
    groups: dict[tuple, int] = {}
    for p in injection.operators():
        op = p.operator
        where = tuple(f"{dev}{' ' + name if name else ''}" for dev, name in (op.placement(ph) for ph in PHASES))
        key = (type(op).__name__, *where)
        groups[key] = groups.get(key, 0) + 1
    w_cls = max((len(k[0]) for k in groups), default=0)
    w_pre = max((len(k[1]) for k in groups), default=0)
    return [f"    {n:>3} x {cls:<{w_cls}}  prefill {pre:<{w_pre}}  generate {gen}"
            for (cls, pre, gen), n in groups.items()]


def summary(engine: Engine, name: str, opts: ServeOptions, injection=None, rules: str | None = None) -> str:
    c, model = engine.model_config, engine.model
    weights: dict[str, int] = {}
    for p in (*model.parameters(), *model.buffers()):  # buffers: the quantized GPU ops' packed planes
        weights[str(p.device)] = weights.get(str(p.device), 0) + p.numel() * p.element_size()
    kv, st = engine.kv, engine.states
    n_attn, n_lin = len(c.full_attention_layers), len(c.linear_attention_layers)
    memory = {d: [f"weights {_mib(b)}"] for d, b in weights.items()}
    for part in kv.parts:  # one part per device under a split by layer range
        memory.setdefault(str(part.device), []).append(f"KV cache {_mib(part.nbytes)} ({len(part.k)} layers)")
    for part in st.parts:
        memory.setdefault(str(part.device), []).append(f"DeltaNet states {_mib(part.nbytes)} "
                                                       f"({len(part.conv)} layers)")
    for d in memory:
        if d.startswith("cuda"):
            memory[d].append(f"{_mib(torch.cuda.memory_allocated(d))} allocated by torch in all")
    placement = f"rules {rules}" if rules else f"every module on {opts.device} (the default rules)"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    lines = [
        f"ktrans serve: {name}: {c.num_hidden_layers} layers ({n_attn} full attention, {n_lin} Gated DeltaNet), "
        f"{c.num_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}",
        f"  placement  {placement}, dtype {dtype}, {torch.get_num_threads()} CPU threads (--cpu_infer)",
        *placement_lines(injection),
        "  memory     " + "; ".join(f"{d}: {', '.join(parts)}" for d, parts in memory.items()),
        f"  host RSS   {_rss_text()}",
        f"  KV cache   {kv.num_pages * kv.page_size} tokens = {kv.num_pages} pages of {kv.page_size}, "
        f"{n_attn} attention layer(s), {KVPool.bytes_per_token(c, kv.k[0].dtype) if kv.k else 0} B per token",
        f"  states     {engine.config.max_batch_size} slots (--max_batch_size), {_mib(engine.snapshot_bytes)} each",
        prefix_cache_line(engine),
        f"  batching   --chunk_size {engine.config.chunk_size} tokens/step, max_model_len {engine.max_model_len}, "
        f"default max_tokens {engine.config.max_new_tokens}",
    ]
    resident = gpu_experts_line(model)
    if resident:
        lines.append(resident)
    graphs = engine.runner.graphs
    lines.append(f"  decode     CUDA graphs for batch buckets {graphs.buckets} (captured on first use)" if graphs
                 else "  decode     eager (no CUDA graphs: --no-use_cuda_graph, the batches are not on a GPU, CPU "
                      "modules in decode, or the model spans several GPUs; the log says which)")
    return "\n".join(lines)


def gpu_experts_line(model) -> str | None:
    """The CPU experts' resident GPU copies (`gpu_experts`), or None where no layer has them."""
    from ktrans.operators.experts_cpu import KExpertsCPU

    ops = [m for m in model.modules() if isinstance(m, KExpertsCPU) and m.resident is not None]
    if not ops:
        return None
    n = sorted({len(op.resident_ids) for op in ops})
    which = f"each layer's most-routed in {ops[0].gpu_experts_from}" if ops[0].gpu_experts_from else "experts 0..N-1"
    size = sum(w.nbytes for op in ops for w in op.resident)
    return (f"  experts    {'/'.join(map(str, n))} of {ops[0].num_experts} a layer also on {ops[0].gpu_device} in "
            f"{len(ops)} layers ({which}; {_mib(size)}), the rest on the CPU (--num_gpu_experts)")


def _rss_text() -> str:
    from ktrans.kernels.cpu import host_rss

    now, peak = host_rss()
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    return "unknown (no /proc)" if now is None else f"{gib(now)} now, {gib(peak)} at peak while loading"


def prefix_cache_line(engine: Engine) -> str:
    """The prefix cache's budgets: snapshot slots and their memory; pages come from the KV cache, on demand."""
    if engine.prefix_cache is None:
        return "  prefix     off (--no-enable_prefix_cache): every prompt is computed from token 0"
    n, each = engine.config.prefix_cache_max_snapshots, engine.snapshot_bytes
    return (f"  prefix     cache on: {n} DeltaNet snapshots (--prefix_cache_max_snapshots) x {_mib(each)} = "
            f"{_mib(n * each)}; KV pages: any of the {engine.kv.num_pages} no request needs, evicted LRU on demand")


def run(opts: ServeOptions) -> None:
    """Load, print the summary and the URL, serve until Ctrl-C."""
    import uvicorn

    from ktrans.operators.routing_stats import ROUTING

    t0 = time.perf_counter()
    if opts.max_request_body_bytes <= 0:
        raise ValueError(f"--max_request_body_bytes must be positive, got {opts.max_request_body_bytes}")
    check_routing_stats_out(opts.routing_stats_out)
    sock = listen_socket(opts.host, opts.port)  # a busy port is found now, not after minutes of loading
    print("ktrans serve: loading the model ...", file=sys.stderr, flush=True)
    try:
        model, tokenizer, name, injection = load(opts, show_progress=True)
    except BaseException:
        sock.close()
        raise
    metrics = EngineMetrics(name)
    engine = Engine(model, tokenizer, engine_config(opts, model), metrics)
    app = OpenAIServer(engine, tokenizer, name, opts.api_key, metrics,
                       max_request_body_bytes=opts.max_request_body_bytes).build_app()
    url = f"http://{opts.host}:{opts.port}"
    rules = opts.optimize_config_path or ("Qwen3Next-cpu.yaml (the default on the CPU)" if opts.device == "cpu" else
                                          f"Qwen3Next-default.yaml (every module on {opts.device}, reference ops)")
    print(summary(engine, name, opts, injection, rules), file=sys.stderr)
    if opts.warmup:
        done = engine.warm_up()
        print(f"  warm-up    {done['steps']} throw-away steps in {done['seconds']:.1f} s (every kind of step once, so "
              f"no user waits for a first compile or graph capture; --no-warmup skips it)", file=sys.stderr,
              flush=True)
    print(f"  loaded in {time.perf_counter() - t0:.1f} s; serving the OpenAI API at {url}/v1 (model {name!r})\n"
          f"  try: curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}], \"stream\": true}}'",
          file=sys.stderr, flush=True)
    if opts.routing_stats_out:  # after the warm-up: its throw-away steps are not users' routing
        ROUTING.start()
    engine.start()
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
        if opts.routing_stats_out:
            save_routing_stats(opts.routing_stats_out)


def check_routing_stats_out(path: str | None) -> None:
    """--routing_stats_out is written at exit: its directory must exist and be writable now, not after hours."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK) or Path(path).is_dir():
        raise ValueError(f"--routing_stats_out {path}: cannot write there (no such writable directory {parent}, or "
                         f"it is a directory)")


def save_routing_stats(path: str) -> None:
    """Stop recording and write what ROUTING recorded to `path` (--routing_stats_out), saying how much it holds; a
    failure is reported, not raised (it runs as the server stops, where another error may be on its way)."""
    from ktrans.operators.routing_stats import ROUTING

    ROUTING.stop()
    try:
        ROUTING.save(path)
    except Exception as e:  # noqa: BLE001 - reported; the stats are lost, the exit goes on
        print(f"ktrans: could not write the routing statistics to {path}: {e}", file=sys.stderr, flush=True)
        return
    tokens = max(ROUTING.tokens.values(), default=0)
    print(f"ktrans: routing statistics of {tokens} tokens over {len(ROUTING.counts)} MoE layers written to {path} "
          f"(use them with --num_gpu_experts N --gpu_experts_from {path})", file=sys.stderr, flush=True)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for --host/--port, or a ValueError naming the flag."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); is another server "
                         f"running on it? Pick another --port") from None
    return sock


class BackgroundServer:
    """The server in a thread on a free loopback port (tests, benchmarks). Use as a context manager."""

    def __init__(self, engine: Engine, tokenizer, name: str = "ktrans-test", api_key: str | None = None,
                 host: str = "127.0.0.1", max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES):
        import uvicorn

        self.engine, self.metrics = engine, EngineMetrics(name)
        engine.metrics = self.metrics
        self.name = name
        self.api = OpenAIServer(engine, tokenizer, name, api_key, self.metrics,
                                max_request_body_bytes=max_request_body_bytes)
        app = self.api.build_app()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> "BackgroundServer":
        self.engine.start()
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.engine.stop()
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
