"""Prometheus metrics for /metrics, named like vLLM's (with the `ktrans:` prefix instead of `vllm:`), so
dashboards built for vLLM need only the prefix changed.

Each server gets its own registry (tests run several in one process). The engine thread calls on_step, on_token
and on_finish; gauges are read from the engine when /metrics is scraped, and so are the prefix cache's counters,
which the cache keeps itself (as vLLM, `prefix_cache_queries` and `prefix_cache_hits` count tokens, so their ratio
is the hit rate; `_query_requests` and `_hit_requests` count admissions).
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the API)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no `_created` series next to each counter, as in vLLM

P = "ktrans:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


# (metric name, key in Engine.stats(), help) of the prefix cache's series
PREFIX_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_query_tokens", "Prefix cache queries, in tokens looked up"),
    ("prefix_cache_hits", "prefix_cache_hit_tokens", "Prefix cache hits, in tokens reused (not computed)"),
    ("prefix_cache_query_requests", "prefix_cache_queries", "Admissions that looked the prefix cache up"),
    ("prefix_cache_hit_requests", "prefix_cache_hits", "Admissions that reused a cached prefix"),
    ("prefix_cache_snapshots_taken", "prefix_cache_snapshots_taken", "DeltaNet state snapshots taken"),
    ("prefix_cache_evicted_snapshots", "prefix_cache_evicted_snapshots", "DeltaNet state snapshots evicted"),
    ("prefix_cache_evicted_pages", "prefix_cache_evicted_pages", "KV pages the prefix cache gave back under pressure"),
)
PREFIX_GAUGES = (
    ("prefix_cache_snapshots", "prefix_cache_snapshots", "DeltaNet state snapshots held"),
    ("prefix_cache_snapshot_bytes", "prefix_cache_snapshot_bytes", "Memory of the snapshots held, in bytes"),
    ("prefix_cache_pages", "prefix_cache_pages", "KV pages the prefix cache holds"),
)


class _PrefixCacheSeries:
    """The prefix cache's series from the last scraped stats (nothing when the cache is off)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict = {}

    def collect(self):
        if "prefix_cache_queries" not in self.stats:
            return
        for family, table in ((CounterMetricFamily, PREFIX_COUNTERS), (GaugeMetricFamily, PREFIX_GAUGES)):
            for name, key, doc in table:
                m = family(P + name, doc, labels=["model_name"])
                m.add_metric([self.model_name], self.stats[key])
                yield m


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._name = model_name

        def g(name, doc):
            return Gauge(P + name, doc, labels, registry=r).labels(model_name)

        self.running = g("num_requests_running", "Requests in the running batch")
        self.waiting = g("num_requests_waiting", "Requests waiting to be admitted")
        self.kv_usage = g("kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full)")
        self.slot_usage = g("state_slot_usage_perc", "Fraction of DeltaNet state slots in use (1 = full)")
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens computed (recomputes included)", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", labels,
                                         registry=r).labels(model_name)
        self.preemptions = Counter(P + "num_preemptions", "Requests preempted (to be recomputed)", labels,
                                   registry=r).labels(model_name)
        self.success = Counter(P + "request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between two output tokens", labels,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        def phase(name, doc):
            return Histogram(P + name, doc, labels, buckets=PHASE_BUCKETS, registry=r).labels(model_name)

        self.queue_time = phase("request_queue_time_seconds", "Arrival to first admission into the running batch")
        self.prefill_time = phase("request_prefill_time_seconds", "First admission to the first token")
        self.decode_time = phase("request_decode_time_seconds", "First token to the last token")
        self.inference_time = phase("request_inference_time_seconds", "First admission to the last token")
        self.iteration_tokens = Histogram(P + "iteration_tokens_total", "Tokens computed per engine step", labels,
                                          buckets=ITERATION_BUCKETS, registry=r).labels(model_name)
        self.prompt_len = Histogram(P + "request_prompt_tokens", "Prompt length of finished requests", labels,
                                    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000),
                                    registry=r).labels(model_name)
        self.gen_len = Histogram(P + "request_generation_tokens", "Output length of finished requests", labels,
                                 buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000),
                                 registry=r).labels(model_name)
        self.prefix_cache = _PrefixCacheSeries(model_name)
        r.register(self.prefix_cache)

    # ---- engine thread --------------------------------------------------------------------------------
    def on_step(self, sched, num_sampled: int) -> None:
        prompt = 0
        for c in sched.chunks:
            # tokens below the prompt end are prompt work; a request's last output is fed back as a decode token
            prompt += max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(num_sampled)
        self.iteration_tokens.observe(sum(c.num_tokens for c in sched.chunks))
        if sched.preempted:
            self.preemptions.inc(len(sched.preempted))

    def on_token(self, req) -> None:
        """Called before the token is appended: the first one is the TTFT, later ones an inter-token gap."""
        now = time.monotonic()
        if req.last_token_time is None:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe(now - req.last_token_time)

    def on_finish(self, req) -> None:
        self.success.labels(self._name, req.status.value).inc()
        self.e2e.observe(time.monotonic() - req.arrival_time)
        self.prompt_len.observe(req.num_prompt_tokens)
        self.gen_len.observe(req.num_output_tokens)
        start, first, last = req.scheduled_time, req.first_token_time, req.last_token_time
        if start is None:  # aborted or failed while still waiting: never admitted, no phase times
            return
        self.queue_time.observe(start - req.arrival_time)
        if first is not None:
            self.prefill_time.observe(first - start)
            self.decode_time.observe(last - first)
            self.inference_time.observe(last - start)

    # ---- scrape ---------------------------------------------------------------------------------------
    def render(self, stats: dict) -> bytes:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_usage"])
        self.slot_usage.set(stats["slot_usage"])
        self.prefix_cache.stats = stats
        return generate_latest(self.registry)
