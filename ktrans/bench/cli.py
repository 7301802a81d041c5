"""The `ktrans bench ...` subcommands: their flags, and handlers that check them and call the benchmark modules.

ktrans.cli calls `add_bench_parsers` for the `bench` group and dispatches to the handlers through each subparser's
`func`, as for its own subcommands. What every subcommand shares (CliError, the model flags, id lists) is defined
here and imported by ktrans.cli, because bench is the floor below cli and may not import from it. The benchmark
modules are imported inside the handlers, so building the parser loads none of them.
"""
from __future__ import annotations

import argparse


class CliError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_path", help="HF directory: config.json, *.safetensors, tokenizer files "
                                        "(with --gguf_path, optional: only its tokenizer files are used)")
    p.add_argument("--gguf_path", help="GGUF file (first shard of a split file); config, weights and, without "
                                       "--model_path, tokenizer and chat template come from it")
    p.add_argument("--optimize_config_path", help="YAML injection rules")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="compute dtype (default: bfloat16 where the rules or --device use CUDA, else float32)")
    p.add_argument("--device", default="cpu", help="device for the plain model (no rules): cpu or cuda")


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated token ids, got {text!r}") from None


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ktrans.bench.serve import main as bench_serve

    try:
        return bench_serve(args)
    except (ValueError, ConnectionError) as e:
        raise CliError(str(e)) from None


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    from ktrans.bench.e2e import main as bench_e2e

    args.batch_sizes = _parse_ids(args.batch_sizes, "--batch_sizes")
    args.prefill_lens = _parse_ids(args.prefill_lens, "--prefill_lens") if args.prefill_lens else []
    try:
        return bench_e2e(args)
    except ValueError as e:
        raise CliError(str(e)) from None


def _add_engine_bench_flags(b: argparse.ArgumentParser) -> None:
    """The flags of the benchmarks that drive the engine in-process (e2e, prefix-cache)."""
    _add_model_flags(b)
    b.add_argument("--chunk_size", type=int, help="token budget of one step, as ktrans serve's (and its default)")
    b.add_argument("--cpu_infer", type=int, help="CPU threads for compute (default: all cores but one)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    b.add_argument("--json", action="store_true", help="print one JSON object")


def _add_bench_e2e_parser(bench_sub) -> None:
    b = bench_sub.add_parser("e2e", help="the whole model through the engine: prefill and decode tok/s per batch "
                                         "size, TTFT/TPOT, one decode token split into GPU / CPU experts / host")
    _add_engine_bench_flags(b)
    b.add_argument("--num_gpu_experts", type=int, default=None, help="as ktrans serve's")
    b.add_argument("--gpu_experts_from", metavar="PATH", help="as ktrans serve's")
    b.add_argument("--routing_stats_out", metavar="PATH", help="as ktrans serve's (the measured runs' routing)")
    b.add_argument("--prompt_len", type=int, default=512, help="prompt tokens per request (random ids)")
    b.add_argument("--gen_len", type=int, default=64, help="new tokens per request (greedy, EOS ignored)")
    b.add_argument("--batch_sizes", default="1,4,16", help="comma-separated numbers of requests run together")
    b.add_argument("--prefill_lens", default="",
                   help="comma-separated prompt lengths whose time to first token is also measured, one request "
                        "each (e.g. 512,4096,16384)")
    b.add_argument("--itl_prefill_len", type=int, default=0,
                   help="also send a prompt this long while --itl_decodes requests decode, and report their "
                        "inter-token latency (p50, p99) beside the time of a step carrying its chunks")
    b.add_argument("--itl_decodes", type=int, default=4, help="requests decoding while --itl_prefill_len prefills")
    b.add_argument("--profile_steps", type=int, default=8,
                   help="extra batch-1 decode steps run under the profiler for the GPU's kernel time")
    b.add_argument("--profile_batch", type=int, default=0,
                   help="also profile --profile_steps decode steps of this many requests together (the JSON's "
                        "profiled_batch: wall, GPU busy, kernels by time); 0: batch 1 only")
    b.add_argument("--use_cuda_graph", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps replay CUDA graphs (default: on where the model's batches are on a GPU)")
    b.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine's warm-up (what `ktrans serve` runs before it listens) before measuring; "
                        "each measured step size is run once beforehand either way")
    for flag, what in (("--max_batch_size", "running requests and DeltaNet slots"),
                       ("--cache_lens", "KV cache tokens"),
                       ("--prefix_cache_max_snapshots", "DeltaNet snapshot slots of the prefix cache (serve's default 32)")):
        b.add_argument(flag, type=int, help=f"{what}, as ktrans serve's (default: what the runs need; more where "
                                             "they need more): the memory figures depend on them")
    b.set_defaults(func=cmd_bench_e2e)


def cmd_bench_limits(args: argparse.Namespace) -> int:
    from ktrans.bench.limits import main as bench_limits

    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    return bench_limits(args)


def cmd_bench_prefix_cache(args: argparse.Namespace) -> int:
    from ktrans.bench.prefix_cache import main as bench_prefix_cache

    try:
        return bench_prefix_cache(args)
    except ValueError as e:
        raise CliError(str(e)) from None


def _add_bench_prefix_cache_parser(bench_sub) -> None:
    b = bench_sub.add_parser("prefix-cache", help="the prefix cache: hit vs miss TTFT, miss overhead, a chat's "
                                                 "computed prefill tokens")
    _add_engine_bench_flags(b)
    b.add_argument("--prefix_len", type=int, default=8192, help="tokens of the shared prefix")
    b.add_argument("--suffix_len", type=int, default=32, help="tokens after it, different per request")
    b.add_argument("--repeats", type=int, default=3, help="measurements per number (the median is reported)")
    b.add_argument("--turns", type=int, default=10, help="turns of the chat")
    b.add_argument("--reply_len", type=int, default=64, help="tokens of each reply")
    b.set_defaults(func=cmd_bench_prefix_cache)


def _add_bench_limits_parser(bench_sub) -> None:
    b = bench_sub.add_parser("limits", help="the machine's ceilings: CPU read, pinned host<->GPU and HBM bandwidth")
    b.add_argument("--threads", type=int, help="CPU threads of the read (default: KTRANS_CPU_INFER or all cores)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_limits)


def _add_bench_serve_parser(bench_sub) -> None:
    b = bench_sub.add_parser("serve", help="latency and throughput of a running server (TTFT, TPOT, ITL)")
    b.add_argument("--url", default="http://127.0.0.1:10021")
    b.add_argument("--model", help="model id (default: the server's first)")
    b.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    b.add_argument("--prompt_len", type=int, default=256)
    b.add_argument("--gen_len", type=int, default=64)
    b.add_argument("--num_prompts", type=int, default=0, help="requests per level (default: 4 per client, >= 8)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.set_defaults(func=cmd_bench_serve)


def cmd_bench_moe(args: argparse.Namespace) -> int:
    from ktrans.bench.moe import run

    tokens = _parse_ids(args.tokens, "--tokens")
    if not tokens or min(tokens) < 1:
        raise CliError(f"--tokens must be positive token counts, got {args.tokens!r}")
    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    try:
        run(args.shape, args.quant, tokens, threads=args.threads, reference=args.reference, isa=args.isa,
            as_json=args.json, tiles=args.tiles, trace=args.trace, hugepages=args.hugepages == "on",
            repack=args.repack == "on", cpu_share=args.cpu_share)
    except ValueError as e:
        raise CliError(str(e)) from None
    return 0


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from ktrans.bench.kernels import run

    if args.reps < 1:
        raise CliError(f"--reps must be >= 1, got {args.reps}")
    families = [f for f in (args.family or "").split(",") if f] or None
    run(families, args.match, args.reps, args.json, device=args.device)
    return 0


def _add_bench_kernels_parser(bench_sub) -> None:
    b = bench_sub.add_parser("kernels", help="device time of the GPU layer kernels (CUDA-graph replay, cold L2) "
                                             "against the bytes they move and this GPU's HBM bandwidth")
    b.add_argument("--family", help="comma-separated families (gdn, attention, quant, flashinfer: where it "
                                    "imports); default all")
    b.add_argument("--match", help="only cases whose name contains this (A|B: either)")
    b.add_argument("--reps", type=int, default=50, help="timed replays per case")
    b.add_argument("--device", help="default: cuda when present, else cpu (a smoke run: the timings mean nothing)")
    b.add_argument("--json", action="store_true", help="one JSON line per case")
    b.set_defaults(func=cmd_bench_kernels)


def _add_bench_moe_parser(bench_sub) -> None:
    bm = bench_sub.add_parser("moe", help="C++ CPU experts of one MoE layer vs the machine's read bandwidth")
    bm.add_argument("--shape", default="qwen3-next", choices=["qwen3-next", "tiny"])
    bm.add_argument("--quant", default="q4_k", choices=["q4_k", "q5_k", "q6_k", "q8_0", "bf16", "f16", "f32"])
    bm.add_argument("--tokens", default="1,4,16,64,256,1024", help="comma-separated token counts")
    bm.add_argument("--threads", type=int, default=None, help="CPU threads (default: KTRANS_CPU_INFER or all cores)")
    bm.add_argument("--isa", default="auto", choices=["auto", "avx512", "avx2", "scalar"], help="kernel path")
    bm.add_argument("--reference", action="store_true", help="also time the torch reference on the same inputs")
    bm.add_argument("--tiles", default="auto", choices=["auto", "amx", "vnni", "off"],
                    help="Q4_K/Q5_K prefill tiles: AMX where present (auto), AVX-512 VNNI, or off (row kernels)")
    bm.add_argument("--cpu_share", type=float, default=1.0,
                    help="keep only the pairs routed to experts [0, F * E), as split prefill hands the CPU its share")
    bm.add_argument("--trace", action="store_true",
                    help="also report when the pool's threads start and end their share of a call (diagnostics)")
    bm.add_argument("--hugepages", default="on", choices=["on", "off"],
                    help="copy the expert weights into 2 MiB transparent huge pages (as KExpertsCPU does by default) "
                         "or read them where they are")
    bm.add_argument("--repack", default="on", choices=["on", "off"],
                    help="repack Q4_K and Q5_K 16 rows at a time where the kernel path reads that (Q4_K_X16, "
                         "Q5_K_X16, as KExpertsCPU does by default) or keep the GGUF blocks as they are")
    bm.add_argument("--json", action="store_true", help="one JSON line per token count")
    bm.set_defaults(func=cmd_bench_moe)


def add_bench_parsers(sub) -> None:
    """Add the `bench` group and its subcommands to the top-level subparsers `sub`."""
    if "bench" not in sub.choices:
        bench = sub.add_parser("bench", help="benchmarks")
        bench.add_subparsers(dest="bench_command", required=True)
    bench_sub = next(a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    _add_bench_serve_parser(bench_sub)
    _add_bench_moe_parser(bench_sub)
    _add_bench_kernels_parser(bench_sub)
    _add_bench_e2e_parser(bench_sub)
    _add_bench_limits_parser(bench_sub)
    _add_bench_prefix_cache_parser(bench_sub)
