"""`ktrans bench serve`: load a running OpenAI-compatible server and report latency and throughput the way vLLM's
and SGLang's serving benchmarks do (TTFT, TPOT, ITL, E2E percentiles; request, output and total token throughput).

Each request is a streaming /v1/completions call with a random token-id prompt of exactly --prompt_len tokens and
`ignore_eos` with max_tokens --gen_len, so every request does the same work. For each --concurrency level,
--num_prompts requests (default 4 per concurrent client, at least 8) run through that many concurrent clients.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], gen_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _pcts(xs: list[float], name: str) -> dict:
    ms = sorted(x * 1000 for x in xs) or [0.0]

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, max(0, round(p / 100 * len(ms) + 0.5) - 1))]

    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"p90_{name}_ms": pct(90), f"p99_{name}_ms": pct(99)}


async def run_level(url: str, model: str, concurrency: int, num_prompts: int, prompt_len: int, gen_len: int,
                    seed: int, timeout: float) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        async def run(p):
            async with sem:
                return await one_request(client, url, model, p, gen_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    out = {"concurrency": concurrency, "num_prompts": num_prompts, "prompt_len": prompt_len, "gen_len": gen_len,
           "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration}
    out.update(_pcts([r.ttft for r in ok], "ttft"))
    out.update(_pcts(tpot, "tpot"))
    out.update(_pcts([x for r in ok for x in r.itl], "itl"))
    out.update(_pcts([r.e2e for r in ok], "e2el"))
    errors = [r.error for r in results if not r.ok]
    if errors:
        out["first_error"] = errors[0]
    return out


def report(r: dict) -> str:
    w = 40
    lines = [f"{' Serving Benchmark Result (concurrency ' + str(r['concurrency']) + ') ':=^50}",
             f"{'Successful requests:':<{w}}{r['completed']:<10}",
             f"{'Failed requests:':<{w}}{r['failed']:<10}",
             f"{'Benchmark duration (s):':<{w}}{r['duration_s']:<10.2f}",
             f"{'Total input tokens:':<{w}}{r['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<{w}}{r['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<{w}}{r['request_throughput']:<10.2f}",
             f"{'Output token throughput (tok/s):':<{w}}{r['output_throughput']:<10.2f}",
             f"{'Total Token throughput (tok/s):':<{w}}{r['total_token_throughput']:<10.2f}"]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p90", "p99"):
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {key.upper()} (ms):"
            lines.append(f"{label:<{w}}{r[f'{stat}_{key}_ms']:<10.2f}")
    if r.get("first_error"):
        lines.append(f"first error: {r['first_error']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    head = (f"{'conc':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8}  (ms)")
    rows = [f"{r['concurrency']:>5} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
            f"{r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} {r['median_tpot_ms']:>9.1f} "
            f"{r['median_itl_ms']:>8.1f} {r['p99_itl_ms']:>8.1f}" for r in results]
    return "\n".join([head, *rows])


async def bench(url: str, concurrency: list[int], prompt_len: int, gen_len: int, num_prompts: int = 0,
                model: str | None = None, seed: int = 0, timeout: float = 600.0) -> list[dict]:
    url = url.rstrip("/").removesuffix("/v1")
    async with httpx.AsyncClient(timeout=30) as client:
        if model is None:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await one_request(client, url, model, [1000] * min(prompt_len, 8), 2)  # warm-up, not counted
    out = []
    for c in concurrency:
        n = num_prompts or max(8, 4 * c)
        out.append(await run_level(url, model, c, n, prompt_len, gen_len, seed, timeout))
    return out


def main(args) -> int:
    try:
        levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if not levels or min(levels) <= 0 or args.prompt_len <= 0 or args.gen_len <= 0:
        raise ValueError("--concurrency, --prompt_len and --gen_len must be positive")
    try:
        results = asyncio.run(bench(args.url, levels, args.prompt_len, args.gen_len, args.num_prompts, args.model,
                                    args.seed))
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot benchmark {args.url}: {e}; is `ktrans serve` running there?") from None
    if args.json:
        print(json.dumps({"url": args.url, "results": results}, indent=2))
    else:
        for r in results:
            print(report(r))
        print(table(results))
    return 0 if all(r["failed"] == 0 for r in results) else 1

