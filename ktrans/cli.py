"""The `ktrans` command: serve | chat | generate | rules | bench serve|moe|e2e|limits|prefix-cache | make-tiny | doctor.

Flags follow KTransformers' spelling (--model_path, --gguf_path, --optimize_config_path, --max_new_tokens) so
users' scripts carry over. Errors are one line on stderr naming the flag or file, with exit status 2. The `bench`
subcommands are built and handled in ktrans.bench.cli.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from ktrans.bench.cli import CliError, _add_model_flags, _parse_ids, add_bench_parsers


def cmd_generate(args: argparse.Namespace) -> int:
    """One prompt through a one-request Engine, stepped on this thread (the server's own step, not a second loop)."""
    from ktrans.engine.engine import Engine
    from ktrans.engine.sampler import SamplingParams
    from ktrans.inject import load_model
    from ktrans.inject.rules import load_rules
    from ktrans.model.source import ModelSource, parse_dtype

    if args.optimize_config_path and args.device != "cpu":
        raise CliError("--device places the plain model; with --optimize_config_path the rules place every module")
    given = [x for x in (args.prompt, args.prompt_ids, args.chat) if x is not None]
    if len(given) != 1:
        raise CliError("give exactly one of --prompt, --prompt_ids, --chat")
    if args.max_new_tokens < 0:
        raise CliError(f"--max_new_tokens must be >= 0, got {args.max_new_tokens}")
    if args.chunk_size < 0:
        raise CliError(f"--chunk_size must be >= 0, got {args.chunk_size}")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                logprobs=args.logprobs, max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                                prompt_logprobs=args.logprobs if args.echo else None)
    except ValueError as e:
        raise CliError(f"--{str(e).split()[0]}: {e}") from None
    t0 = time.perf_counter()
    opened = ModelSource(args.model_path, args.gguf_path).open()
    tok = opened.tokenizer
    if args.optimize_config_path:
        rules = load_rules(args.optimize_config_path)
        model, _ = load_model(opened, parse_dtype(args.dtype, rules.uses_cuda), rules=rules,
                              show_progress=not args.json)
    else:
        model, _ = load_model(opened, parse_dtype(args.dtype, args.device.startswith("cuda")), args.device,
                              show_progress=not args.json)
    config = model.config
    load_s = time.perf_counter() - t0

    if args.prompt_ids is not None:
        prompt_ids = _parse_ids(args.prompt_ids, "--prompt_ids")
    elif args.chat is not None:
        text = tok.apply_chat_template([{"role": "user", "content": args.chat}], add_generation_prompt=True,
                                       enable_thinking=not args.no_think)
        prompt_ids = tok.encode(text)
    else:
        prompt_ids = tok.encode(args.prompt)
    bad = [i for i in prompt_ids if not 0 <= i < config.vocab_size]
    if bad:
        raise CliError(f"--prompt_ids: token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    if not prompt_ids:
        raise CliError("the prompt is empty")
    engine = Engine.for_one_request(model, tok, len(prompt_ids) + args.max_new_tokens, args.chunk_size)
    res, timings = engine.generate(prompt_ids, params)
    if res.error:
        raise CliError(res.error)
    text = tok.decode(res.token_ids, skip_special_tokens=True)
    if args.json:
        out = {
            "prompt_ids": prompt_ids,
            "output_ids": res.token_ids,
            "text": text,
            "finish_reason": res.finish_reason,
            "logprobs": [_scores(lp) for lp in res.logprobs] if args.logprobs else [],
            "timings": {"load_s": load_s, **timings},
        }
        if args.echo:
            out["prompt_logprobs"] = [_scores(lp) for lp in res.prompt_logprobs or []]
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(text)
        print(f"[prefill {len(prompt_ids)} tok {timings['prefill_tokens_per_s']:.1f} tok/s, decode "
              f"{len(res.token_ids)} tok {timings['decode_tokens_per_s']:.1f} tok/s, {res.finish_reason}]",
              file=sys.stderr)
    return 0


def _scores(lp) -> dict[str, float]:
    """A TokenLogprob as `ktrans generate --json` prints it: {token id: logprob} of the top-K and the chosen one."""
    d = {str(k): v for k, v in lp.top.items()}
    d[str(lp.token_id)] = lp.logprob
    return d


def cmd_serve(args: argparse.Namespace) -> int:
    from ktrans.api.server import ServeOptions, run

    names = ServeOptions.__dataclass_fields__
    opts = ServeOptions(**{k: v for k, v in vars(args).items() if k in names})
    try:
        run(opts)
    except ValueError as e:
        raise CliError(str(e)) from None
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from ktrans.api.chat_client import ChatError, chat

    try:
        return chat(args.url, args.model, args.api_key, think=not args.no_think, temperature=args.temperature,
                    max_tokens=args.max_tokens, system=args.system)
    except ChatError as e:
        raise CliError(str(e)) from None
    except KeyboardInterrupt:
        return 0


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching")
    _add_model_flags(s)
    s.add_argument("--backend_type", default="balance_serve", help="only balance_serve (continuous batching)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=10021)
    s.add_argument("--served_model_name", help="the model id clients send (default: the model directory's name)")
    s.add_argument("--num_gpu_experts", type=int, default=None,
                   help="experts 0..N-1 of each layer also on the GPU, where the pairs routed to them run beside the "
                        "CPU experts (`gpu_experts: N` on the rules' KExpertsCPU; SGLang + kt-kernel's "
                        "--kt-num-gpu-experts); default: as the rules say")
    s.add_argument("--gpu_experts_from", metavar="PATH",
                   help="with --num_gpu_experts N: each layer's N most-routed experts in this routing statistics "
                        "file (from --routing_stats_out) go on the GPU, not experts 0..N-1")
    s.add_argument("--routing_stats_out", metavar="PATH",
                   help="count how often each layer routes to each expert while serving (after the warm-up) and "
                        "write it to PATH at exit, for --gpu_experts_from")
    s.add_argument("--api_key", help="require `Authorization: Bearer KEY` on /v1 requests")
    s.add_argument("--max_new_tokens", type=int, default=1024, help="default max_tokens of a request")
    s.add_argument("--cache_lens", type=int, default=32768, help="KV cache size in tokens, over all requests")
    s.add_argument("--cache_memory_fraction", type=float,
                   help="size the KV cache to this fraction of free device memory instead of --cache_lens")
    s.add_argument("--page_size", type=int, default=16, help="tokens per KV cache page")
    s.add_argument("--chunk_size", type=int, help="token budget of one step (prefill chunks + decodes; default 512, "
                   "4096 where the rules split prefill experts between the CPU and the GPU)")
    s.add_argument("--max_batch_size", type=int, default=16, help="running requests (= DeltaNet state slots)")
    s.add_argument("--max_model_len", type=int, help="prompt + output limit (default: the model's, within the cache)")
    s.add_argument("--max_queued_requests", type=int, default=1024, help="waiting requests before HTTP 503")
    s.add_argument("--max_request_body_bytes", type=int, default=16 * 1024 * 1024,
                   help="larger request bodies get HTTP 413")
    s.add_argument("--cpu_infer", type=int, help="CPU threads for compute (default: all cores but one)")
    s.add_argument("--enable_prefix_cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages and DeltaNet state snapshots of shared prefixes (multi-turn chat, "
                        "system prompts)")
    s.add_argument("--prefix_cache_max_snapshots", type=int, default=32,
                   help="DeltaNet state snapshots the prefix cache keeps (state slots beyond --max_batch_size; "
                        "the startup summary states their memory)")
    s.add_argument("--prefix_cache_snapshot_interval", type=int, default=0,
                   help="also snapshot the DeltaNet state every N prompt tokens inside a prefill chunk (a multiple "
                        "of 64 and of --page_size; 0: only at chunk ends), so a long prompt's prefixes are "
                        "reusable without small chunks")
    s.add_argument("--use_cuda_graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps as CUDA graphs, one per batch-size bucket (default: on where the "
                        "model's batches are on a GPU)")
    s.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="before listening, run throw-away requests through every kind of step (a whole chunk, "
                        "mixed prefill and decode, decode), so the first users do not wait for kernel compiles "
                        "and graph captures")
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="interactive terminal chat with a running server")
    c.add_argument("--url", default="http://127.0.0.1:10021")
    c.add_argument("--model", help="model id (default: the server's first)")
    c.add_argument("--api_key")
    c.add_argument("--no_think", action="store_true", help="start with thinking off (/think on|off to switch)")
    c.add_argument("--temperature", type=float)
    c.add_argument("--max_tokens", type=int)
    c.add_argument("--system", help="a system message")
    c.set_defaults(func=cmd_chat)


def _rules_config(args: argparse.Namespace):
    """(config, its name, the stored tensor types or None) a rules report is for: --model_path, --gguf_path (whose
    types it reports), --config, or the real 80B model."""
    from pathlib import Path

    from ktrans.config import CONFIGS_DIR, ModelConfig
    from ktrans.model.source import ModelSource

    given = [f for f in ("model_path", "gguf_path", "config") if getattr(args, f)]
    if len(given) > 1:
        raise CliError(f"give at most one of --model_path, --gguf_path, --config (got {', '.join(given)})")
    if args.model_path or args.gguf_path:
        source = ModelSource(args.model_path, args.gguf_path)
        if args.gguf_path:  # the tensors' stored types too (the header only: nothing is read)
            weights = source.open().weights
            return weights.config, args.gguf_path, weights.tensor_type
        return source.config(), args.model_path, None
    path = Path(args.config or CONFIGS_DIR / "qwen3-next-80b-a3b.json")
    if not path.exists() and (CONFIGS_DIR / f"{path.stem}.json").is_file():
        path = CONFIGS_DIR / f"{path.stem}.json"  # a shipped config by name: --config qwen3-next-80b-a3b
    return ModelConfig.from_json(path), str(path), None


def cmd_rules_show(args: argparse.Namespace) -> int:
    from ktrans.inject.report import FROM_FILE, placement_report
    from ktrans.inject.rules import check_devices, load_rules, with_gpu_experts

    if args.cache_lens < 0 or args.max_batch_size < 1:
        raise CliError("--cache_lens must be >= 0 and --max_batch_size >= 1")
    if args.page_size < 1 or args.prefix_cache_max_snapshots < 0:
        raise CliError("--page_size must be >= 1 and --prefix_cache_max_snapshots >= 0")
    rules = load_rules(args.optimize_config_path)
    if args.num_gpu_experts is not None or args.gpu_experts_from:
        try:
            rules = with_gpu_experts(rules, args.num_gpu_experts, stats=args.gpu_experts_from)
        except ValueError as e:
            raise CliError(str(e)) from None
    if args.check_devices:
        check_devices(rules)
    config, config_name, tensor_type = _rules_config(args)
    weight_dtype = args.weight_dtype or (FROM_FILE if tensor_type is not None else "bf16")
    try:
        report = placement_report(config, rules, config_name, args.cache_lens, args.max_batch_size,
                                  weight_dtype, args.kv_dtype, args.default_device, tensor_type, args.page_size,
                                  args.prefix_cache_max_snapshots if args.enable_prefix_cache else 0)
    except ValueError as e:
        if "dtype" in str(e):
            raise CliError(f"--weight_dtype/--kv_dtype: {e}") from None
        raise
    print(json.dumps(report.to_json(), indent=2) if args.json else report.text())
    for w in report.warnings:
        print(f"ktrans rules: warning: {w}", file=sys.stderr)
    return 0


def cmd_rules_validate(args: argparse.Namespace) -> int:
    from ktrans.inject.rules import check_devices, load_rules

    for path in args.files:
        rules = load_rules(path)
        if args.check_devices:
            check_devices(rules)
        print(f"ok: {path} ({len(rules)} rules)")
    return 0


def _add_rules_parser(sub) -> None:
    r = sub.add_parser("rules", help="validate injection rules and show the placement they give")
    rsub = r.add_subparsers(dest="rules_command", required=True)
    s = rsub.add_parser("show", help="placement per module group, bytes per device, KV and state memory")
    s.add_argument("--optimize_config_path", required=True, help="YAML injection rules")
    s.add_argument("--model_path", help="HF directory (its config.json)")
    s.add_argument("--gguf_path", help="GGUF file (its metadata)")
    s.add_argument("--config", help="config.json path or a shipped name (default: qwen3-next-80b-a3b)")
    s.add_argument("--cache_lens", type=int, default=32768, help="KV cache tokens (full-attention layers)")
    s.add_argument("--max_batch_size", type=int, default=16,
                   help="DeltaNet state slots (running requests; ktrans serve's default)")
    s.add_argument("--page_size", type=int, default=16, help="tokens per KV page (as ktrans serve)")
    s.add_argument("--num_gpu_experts", type=int, default=None, help="as ktrans serve's")
    s.add_argument("--gpu_experts_from", metavar="PATH", help="as ktrans serve's")
    s.add_argument("--enable_prefix_cache", action=argparse.BooleanOptionalAction, default=True,
                   help="count the prefix cache's snapshot slots (as ktrans serve, on by default)")
    s.add_argument("--prefix_cache_max_snapshots", type=int, default=32,
                   help="DeltaNet state snapshots the prefix cache keeps (slots beyond --max_batch_size)")
    s.add_argument("--weight_dtype", help="bytes of matrices: bf16, f16, f32 or a GGUF type (q4_k); default: the "
                                          "types in --gguf_path's file, else bf16")
    s.add_argument("--kv_dtype", default="bf16", help="KV cache and conv state dtype")
    s.add_argument("--default_device", help="device of modules no rule places (default: cuda:0 if a rule uses "
                                            "CUDA, else cpu)")
    s.add_argument("--check_devices", action="store_true", help="fail when a rule needs a device this machine lacks")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_rules_show)
    v = rsub.add_parser("validate", help="check rule files (keys, regexes, classes, ops, devices)")
    v.add_argument("files", nargs="+")
    v.add_argument("--check_devices", action="store_true", help="also require the devices to exist here")
    v.set_defaults(func=cmd_rules_validate)


FLOAT_PRESETS = ("tiny", "small")  # drawn as fp32 weights (the HF checkpoint's), then quantized


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from ktrans.model.tiny import preset_config, write_tiny_model

    if args.layers is not None and args.layers < 1:
        raise CliError(f"--layers must be >= 1, got {args.layers}")
    try:
        d = preset_config(args.preset, args.layers)
    except ValueError as e:
        raise CliError(str(e)) from None
    from pathlib import Path

    if Path(args.out).exists() and not args.force:
        raise CliError(f"--out {args.out!r} exists; remove it or add --force to overwrite it")
    if args.gguf:
        return _make_tiny_gguf(args, d)
    if args.quant != "f32" or args.legacy_ssm_in or args.dense != "as-quant":
        raise CliError("--quant, --dense and --legacy-ssm-in apply only with --gguf")
    if args.preset not in FLOAT_PRESETS:
        raise CliError(f"--preset {args.preset!r}: only the tiny and small presets are written as HF checkpoints "
                       f"(fp32); add --gguf to write a config's shapes as random GGUF blocks")
    path = write_tiny_model(args.out, args.preset, args.seed, layers=args.layers, router=args.router)
    print(f"wrote {args.preset} model (seed {args.seed}) to {path}")
    return 0


def _make_tiny_gguf(args: argparse.Namespace, d: dict) -> int:
    from ktrans.config import ModelConfig
    from ktrans.tokenizer.tokenizer import Tokenizer

    if args.out.endswith("/") or not args.out.endswith(".gguf"):
        raise CliError(f"--out {args.out!r}: with --gguf, give a file name ending in .gguf")
    if args.dense != "as-quant" and args.quant != "q4_k_m":
        raise CliError("--dense bf16 keeps the non-expert tensors of a q4_k_m file in BF16: add --quant q4_k_m")
    if args.workers is not None and args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    config = ModelConfig.from_hf_dict(d, source=f"--preset {args.preset!r}")
    t0 = time.perf_counter()
    if args.preset in FLOAT_PRESETS:
        from ktrans.model.tiny import random_state_dict
        from ktrans.tokenizer.gguf import gguf_tokenizer_metadata
        from ktrans.weights.gguf_writer import write_gguf

        path = write_gguf(args.out, config, random_state_dict(config, args.seed, args.router), args.quant,
                          legacy_ssm_in=args.legacy_ssm_in, dense=args.dense,
                          extra_metadata=gguf_tokenizer_metadata(Tokenizer.default(), config))
        how = "fp32 weights quantized"
    else:
        from ktrans.model.random_gguf import write_random_gguf

        path = write_random_gguf(args.out, config, args.quant, args.seed, args.router, args.dense,
                                 Tokenizer.default(), args.workers, args.legacy_ssm_in, show_progress=True)
        how = "random blocks"
    layout = "legacy ssm_in" if args.legacy_ssm_in else "split attn_qkv/attn_gate"
    dense = ", BF16 dense" if args.dense == "bf16" else ""
    print(f"wrote {args.preset} model ({config.num_hidden_layers} layers, seed {args.seed}, {args.router} router"
          f"{dense}) as {args.quant.upper()} GGUF ({layout}; {how}) to {path}: {path.stat().st_size / 1e9:.2f} GB "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(),
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        from ktrans.kernels.cpu import isa_report

        info["cpu"] = isa_report()
    except ImportError as e:
        info["cpu"] = {"error": f"ktrans._cpu is not built: {e}. Reinstall with `pip install -e .`"}
    print(json.dumps(info, indent=2))
    return 0



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ktrans", description="Serve MoE LLMs across CPU and GPU")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one prompt, offline")
    _add_model_flags(g)
    g.add_argument("--prompt", help="raw text prompt")
    g.add_argument("--prompt_ids", help="comma-separated token ids")
    g.add_argument("--chat", help="a user message, wrapped in the chat template")
    g.add_argument("--no_think", action="store_true", help="with --chat: enable_thinking=False")
    g.add_argument("--max_new_tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top_p", type=float, default=1.0)
    g.add_argument("--top_k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--logprobs", type=int, default=0, help="top-K logprobs per generated token")
    g.add_argument("--echo", action="store_true", help="also score the prompt (prompt_logprobs)")
    g.add_argument("--ignore_eos", action="store_true")
    g.add_argument("--chunk_size", type=int, default=0, help="prefill in chunks of this many tokens (0: one pass)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("make-tiny", help="write a random-weight Qwen3-Next checkpoint")
    m.add_argument("--out", required=True)
    m.add_argument("--preset", default="tiny",
                   help="tiny (the embedded default), small, a shipped config by name (qwen3-next-80b-a3b: the real "
                        "shapes, written as random GGUF blocks on all cores) or a config.json path")
    m.add_argument("--layers", type=int, help="keep only the first N layers of the preset's stack")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--gguf", action="store_true", help="write a GGUF file (tokenizer embedded) instead of an HF dir")
    m.add_argument("--quant", default="f32", choices=["f32", "bf16", "q8_0", "q4_k_m"],
                   help="with --gguf: tensor types, as llama.cpp's converter / llama-quantize choose them")
    m.add_argument("--dense", default="as-quant", choices=["as-quant", "bf16"],
                   help="with --gguf --quant q4_k_m: bf16 keeps every tensor but the routed experts in BF16")
    m.add_argument("--router", default="uniform", choices=["uniform", "skewed"],
                   help="skewed: a few hot experts per layer (realistic uneven expert popularity)")
    m.add_argument("--workers", type=int, help="processes writing random blocks (default: the usable cores)")
    m.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    m.add_argument("--legacy-ssm-in", dest="legacy_ssm_in", action="store_true",
                   help="with --gguf: the older layout (one ssm_in tensor instead of attn_qkv + attn_gate)")
    m.set_defaults(func=cmd_make_tiny)

    _add_serve_parser(sub)
    add_bench_parsers(sub)

    _add_rules_parser(sub)

    d = sub.add_parser("doctor", help="report CPU ISA paths, CUDA and versions")
    d.set_defaults(func=cmd_doctor)
    return p


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to stderr and the process runs on: what a stuck server or
    benchmark is waiting in (the device scripts send it before they kill a command that ran out of time)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        except (RuntimeError, ValueError):  # stderr without a file descriptor (an embedding host)
            pass


def main(argv: list[str] | None = None) -> int:
    # torch's OpenMP threads sleep at the end of a parallel region instead of spinning (libgomp's default): on the
    # CPU placements they share the cores with the CPU pool's pinned, polling workers (full size, 16-core Xeon,
    # doc/benchmarks.md session 15: a CPU-only decode token 80.5 -> 63.3 ms with the module forward, 61.4 -> 52.1
    # with the flat step). Before torch loads (the OpenMP runtime reads it once); the user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _stacks_on_sigusr1()
    args = build_parser().parse_args(argv)
    from ktrans.config import ConfigError
    from ktrans.inject.rules import RuleError
    from ktrans.weights.safetensors_mmap import CheckpointError

    try:
        return args.func(args)
    except (CliError, ConfigError, CheckpointError, FileNotFoundError, NotImplementedError, RuleError) as e:
        print(f"ktrans {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
