"""The `ktrans` command: generate | make-tiny | doctor (serve, rules and bench arrive with their issues).

Flags follow KTransformers' spelling (--model_path, --gguf_path, --optimize_config_path, --max_new_tokens) so
users' scripts carry over. Errors are one line on stderr naming the flag or file, with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time


class CliError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model_path", help="HF directory: config.json, *.safetensors, tokenizer files")
    p.add_argument("--gguf_path", help="GGUF file (first shard of a split file)")
    p.add_argument("--optimize_config_path", help="YAML injection rules")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype on the CPU")
    p.add_argument("--device", default="cpu", help="device for the plain model (no rules): cpu or cuda")


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated token ids, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from ktrans.serve.offline import generate
    from ktrans.serve.sampler import SamplingParams
    from ktrans.weights.loader import ModelSource, load_model, load_tokenizer, parse_dtype

    if args.optimize_config_path:
        raise CliError("--optimize_config_path is not supported yet (injection rules land with their own issue)")
    given = [x for x in (args.prompt, args.prompt_ids, args.chat) if x is not None]
    if len(given) != 1:
        raise CliError("give exactly one of --prompt, --prompt_ids, --chat")
    if args.max_new_tokens < 0:
        raise CliError(f"--max_new_tokens must be >= 0, got {args.max_new_tokens}")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                logprobs=args.logprobs)
    except ValueError as e:
        raise CliError(f"--{str(e).split()[0]}: {e}") from None
    source = ModelSource(args.model_path, args.gguf_path)
    t0 = time.perf_counter()
    tok = load_tokenizer(source)
    model, config = load_model(source, parse_dtype(args.dtype), args.device, show_progress=not args.json)
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
    stop = set() if args.ignore_eos else set(tok.eos_token_ids) | set(config.eos_token_id)
    res = generate(model, prompt_ids, args.max_new_tokens, params, stop_token_ids=stop, echo=args.echo,
                   chunk_size=args.chunk_size)
    text = tok.decode(res.output_ids, skip_special_tokens=True)
    if args.json:
        out = {
            "prompt_ids": res.prompt_ids,
            "output_ids": res.output_ids,
            "text": text,
            "finish_reason": res.finish_reason,
            "logprobs": [{str(k): v for k, v in d.items()} for d in res.logprobs],
            "timings": {"load_s": load_s, **res.timings},
        }
        if args.echo:
            out["prompt_logprobs"] = [{str(k): v for k, v in d.items()} for d in res.prompt_logprobs]
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(text)
        t = res.timings
        print(f"[prefill {len(prompt_ids)} tok {t['prefill_tokens_per_s']:.1f} tok/s, decode "
              f"{len(res.output_ids)} tok {t['decode_tokens_per_s']:.1f} tok/s, {res.finish_reason}]", file=sys.stderr)
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from ktrans.model.tiny import write_tiny_model

    if args.gguf:
        raise CliError("--gguf is not supported yet (GGUF writing lands with the GGUF issue)")
    path = write_tiny_model(args.out, args.preset, args.seed)
    print(f"wrote {args.preset} model (seed {args.seed}) to {path}")
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
    m.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--gguf", action="store_true", help="write a GGUF file instead of an HF directory")
    m.set_defaults(func=cmd_make_tiny)

    d = sub.add_parser("doctor", help="report CPU ISA paths, CUDA and versions")
    d.set_defaults(func=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from ktrans.config import ConfigError
    from ktrans.weights.safetensors_mmap import CheckpointError

    try:
        return args.func(args)
    except (CliError, ConfigError, CheckpointError, FileNotFoundError, NotImplementedError) as e:
        print(f"ktrans {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
