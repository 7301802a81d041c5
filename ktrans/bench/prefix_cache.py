"""`ktrans bench prefix-cache`: what the hybrid prefix cache buys, measured through the engine's own steps.

1. **Hit vs miss TTFT** with a shared prefix (8k tokens by default): a miss computes the whole prompt; a hit on
   another prompt with the same prefix starts from the snapshot at the prefix's end (a chunk end).
2. **Miss overhead**: TTFT of a prompt no cache holds, with the cache on (snapshots at chunk ends, inserting,
   evicting the earlier prompts' pages) against the cache off, interleaved so that drift in the machine's speed
   falls on both; medians and minima (the minimum is the run least disturbed by other load), and the time spent
   inside the cache's entry points per miss (what the cache itself costs, free of the machine's noise).
3. **A multi-turn chat**: prefill tokens computed with the cache as a fraction of those without it. The
   conversation is built at the token level as the Instruct template (no think tags) renders it, keeping each
   reply's generated ids, which is what a re-rendered history gives when the reply tokenizes back to the ids that
   were generated; `text` mode re-renders the history through the model's own chat template instead (the
   embedded tokenizer's is a thinking template: it drops earlier turns' think blocks).

Prompts are random token ids from a seeded generator; greedy decoding, EOS ignored.
"""
from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass

from ktrans.engine.engine import Engine, EngineConfig, default_chunk_size
from ktrans.engine.sampler import SamplingParams


@dataclass
class Options:
    prefix_len: int = 8192
    suffix_len: int = 32
    chunk_size: int | None = None  # None: as ktrans serve's default for the model (engine.default_chunk_size)
    repeats: int = 3
    turns: int = 10
    reply_len: int = 64
    seed: int = 0


def _ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    out, t = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return t["prefill_s"], out.num_cached_tokens


def _engine(model, tok, opts: Options, cache: bool, tokens: int) -> Engine:
    return Engine(model, tok, EngineConfig(max_batch_size=1, chunk_size=opts.chunk_size or default_chunk_size(model),
                                           cache_lens=tokens,
                                           max_new_tokens=max(opts.reply_len, 1), enable_prefix_cache=cache))


def hit_vs_miss(model, tok, opts: Options, rnd: random.Random) -> dict:
    vocab = model.config.vocab_size
    ids = lambda n: [rnd.randrange(vocab) for _ in range(n)]  # noqa: E731
    e = _engine(model, tok, opts, True, 4 * (opts.prefix_len + opts.suffix_len + 64))
    misses, hits, cached = [], [], []
    for _ in range(opts.repeats):
        e.flush_cache()
        prefix = ids(opts.prefix_len)
        misses.append(_ttft(e, prefix + ids(opts.suffix_len))[0])
        for _ in range(2):
            s, c = _ttft(e, prefix + ids(opts.suffix_len))
            hits.append(s)
            cached.append(c)
    miss, hit = statistics.median(misses), statistics.median(hits)
    return {"prefix_len": opts.prefix_len, "suffix_len": opts.suffix_len, "miss_ttft_s": miss, "hit_ttft_s": hit,
            "speedup": miss / hit, "cached_tokens": min(cached)}


# What the scheduler calls on the prefix cache (none calls another of these): their time is the cache's own work.
_ENTRY_POINTS = ("lookup", "pin", "attach", "restore", "waits_for_branch", "clip", "on_computed", "release",
                 "evict_pages")


def _time_cache_work(engine: Engine) -> list[float]:
    """Wrap the prefix cache's entry points on this engine with a clock; returns the running total (a list of
    one, so the caller reads it later)."""
    total = [0.0]
    pc = engine.prefix_cache
    for name in _ENTRY_POINTS:
        real = getattr(pc, name)

        def timed(*args, _real=real, **kwargs):
            t0 = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - t0

        setattr(pc, name, timed)
    return total


def miss_overhead(model, tok, opts: Options, rnd: random.Random) -> dict:
    vocab = model.config.vocab_size
    n = opts.prefix_len + opts.suffix_len
    engines = {c: _engine(model, tok, opts, c, 2 * n + 64) for c in (False, True)}
    work = _time_cache_work(engines[True])
    times: dict[bool, list[float]] = {False: [], True: []}
    warmup = 2  # by then the cache-on engine has written every page of its pool once, as a server long up has
    for i in range(2 * opts.repeats + warmup):
        for c in ((False, True) if i % 2 else (True, False)):
            s, cached = _ttft(engines[c], [rnd.randrange(vocab) for _ in range(n)])
            assert cached == 0
            if i == warmup - 1 and c:
                work[0] = 0.0
            if i >= warmup:
                times[c].append(s)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    best_off, best_on = min(times[False]), min(times[True])  # the least disturbed by other load on the machine
    return {"prompt_len": n, "ttft_off_s": off, "ttft_on_s": on, "overhead": on / off - 1,
            "min_ttft_off_s": best_off, "min_ttft_on_s": best_on, "min_overhead": best_on / best_off - 1,
            "cache_work_s": work[0] / len(times[True]), "cache_work_fraction": work[0] / sum(times[True])}


def chat(model, tok, opts: Options, rnd: random.Random, mode: str = "ids") -> dict:
    """Prefill tokens a chat computes with the cache, against those it would compute without (every prompt whole,
    as without a cache every turn recomputes the conversation)."""
    vocab = model.config.vocab_size
    user_turns = [[rnd.randrange(1000, vocab) for _ in range(rnd.randint(50, 200))] for _ in range(opts.turns)]
    e = _engine(model, tok, opts, True, 2 * opts.turns * (200 + opts.reply_len + 16) + 1024)
    params = SamplingParams(temperature=0.0, max_tokens=opts.reply_len, ignore_eos=True)
    im_start, im_end, nl = tok.encode("<|im_start|>"), tok.encode("<|im_end|>"), tok.encode("\n")
    system = tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    history, messages = list(system), [{"role": "system", "content": "You are a helpful assistant."}]
    total = computed = 0
    for turn in user_turns:
        if mode == "ids":
            prompt = history + im_start + tok.encode("user\n") + turn + im_end + nl + im_start + tok.encode(
                "assistant\n")
        else:
            messages.append({"role": "user", "content": tok.decode(turn)})
            prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        out, _ = e.generate(prompt, params)
        total += len(prompt)
        computed += len(prompt) - out.num_cached_tokens
        history = prompt + out.token_ids + im_end + nl
        messages.append({"role": "assistant", "content": tok.decode(out.token_ids, skip_special_tokens=True)})
    return {"mode": mode, "turns": opts.turns, "reply_len": opts.reply_len, "prompt_tokens": total,
            "computed_tokens": computed, "fraction": computed / total}


def run(model, tok, opts: Options, log=print) -> dict:
    rnd = random.Random(opts.seed)
    t0 = time.perf_counter()
    res = {"hit_vs_miss": hit_vs_miss(model, tok, opts, rnd)}
    log(f"hit vs miss ({opts.prefix_len}-token shared prefix): {json.dumps(res['hit_vs_miss'])}")
    res["miss_overhead"] = miss_overhead(model, tok, opts, rnd)
    log(f"miss overhead: {json.dumps(res['miss_overhead'])}")
    res["chat"] = [chat(model, tok, opts, rnd, mode) for mode in ("ids", "text")]
    for c in res["chat"]:
        log(f"{opts.turns}-turn chat: {json.dumps(c)}")
    res["wall_s"] = time.perf_counter() - t0
    return res


def main(args) -> int:
    from ktrans.api.server import ServeOptions, load

    opts = ServeOptions(model_path=args.model_path, gguf_path=args.gguf_path,
                        optimize_config_path=args.optimize_config_path, dtype=args.dtype, device=args.device,
                        cpu_infer=args.cpu_infer)
    model, tok, name, _ = load(opts, show_progress=not args.json)
    o = Options(prefix_len=args.prefix_len, suffix_len=args.suffix_len, chunk_size=args.chunk_size,
                repeats=args.repeats, turns=args.turns, reply_len=args.reply_len, seed=args.seed)
    res = run(model, tok, o, log=(lambda *_: None) if args.json else print)
    res["model"] = name
    if args.json:
        print(json.dumps(res))
    return 0
