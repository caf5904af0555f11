"""Prometheus metrics of one server, under vLLM's names (a private registry, so several apps can live in one process).

Names, types, units, label names (``model_name``, ``engine``) and bucket boundaries are those of
``vllm serve`` (vLLM's v1 ``PrometheusStatLogger``), so dashboards and alerts built for vLLM work
unchanged; ``http_requests_total`` is the counter prometheus-fastapi-instrumentator adds to vLLM's
server (``handler``, ``method``, ``status`` grouped as ``2xx``). ``dsv4:kernel_compiles`` has no vLLM
equivalent. The engine thread records tokens, latencies and scheduler state (:class:`ServerMetrics`);
:class:`HTTPMetricsMiddleware` counts HTTP requests.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

log = logging.getLogger("dsv4.serve")

# paths vLLM's instrumentator leaves out of http_requests_total (probes and scrapes)
UNCOUNTED_PATHS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to ``max_value``: vLLM's token-count buckets (max_model_len bounds them)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, max_model_len: int = 8192, num_speculative_tokens: int = 0):
        """``num_speculative_tokens``: k of the engine's speculative decoding (0: none, and no
        ``vllm:spec_decode_*`` metrics, as vLLM exports them only with a speculative config)."""
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        names, values = ["model_name", "engine"], {"model_name": model_name, "engine": "0"}

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=r).labels(**values)

        def counter(name, doc):
            return Counter(name, doc, names, registry=r).labels(**values)

        # what a data-parallel server reports per rank: families, labelled per engine when set
        def gauge_family(name, doc):
            return Gauge(name, doc, names, registry=r)

        def counter_family(name, doc):
            return Counter(name, doc, names, registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**values)

        self._running = gauge_family("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge_family("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._cache_usage = gauge_family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._prefix_queries = counter_family("vllm:prefix_cache_queries",
                                              "Prefix cache queries, in terms of number of queried tokens.")
        self._prefix_hits = counter_family("vllm:prefix_cache_hits",
                                           "Prefix cache hits, in terms of number of cached tokens.")
        self._preemptions = counter_family("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        # the prefix cache's host tier (kv_offloading_size): vLLM's names for the hits of a tier beyond the GPU
        # pool, dsv4's for what vLLM has no name of (0 without a host tier)
        self._host_queries = counter("vllm:external_prefix_cache_queries",
                                     "External prefix cache queries (dsv4: the host tier), in terms of number of "
                                     "queried tokens.")
        self._host_hits = counter("vllm:external_prefix_cache_hits",
                                  "External prefix cache hits (dsv4: the host tier), in terms of number of cached "
                                  "tokens.")
        self._host_usage = gauge("dsv4:host_kv_cache_usage_perc",
                                 "Host-tier KV-cache usage (blocks held / slots). 1 means 100 percent usage.")
        self._host_offloaded = counter("dsv4:host_kv_offloaded_bytes",
                                       "Bytes copied from the device KV cache to the host tier (evicted blocks).")
        self._host_restored = counter("dsv4:host_kv_restored_bytes",
                                      "Bytes copied from the host tier back to the device KV cache (prefix hits).")
        for fam in (self._running, self._waiting, self._cache_usage, self._prefix_queries, self._prefix_hits,
                    self._preemptions):
            fam.labels(**values)  # engine "0" present from the start; a data-parallel server adds one per rank
        self._prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                names + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # present at 0 from the start, as vLLM's
            self._success.labels(**values, finished_reason=reason)
        self._labels = values
        token_buckets = build_1_2_5_buckets(max_model_len)
        self._req_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                     token_buckets)
        self._req_generation = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                         token_buckets)
        self._ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               TTFT_BUCKETS)
        self._itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              ITL_BUCKETS)
        self._tpot = histogram("vllm:request_time_per_output_token_seconds",
                               "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        lat = REQUEST_LATENCY_BUCKETS
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat)
        self._queue = histogram("vllm:request_queue_time_seconds",
                                "Histogram of time spent in WAITING phase for request.", lat)
        self._inference = histogram("vllm:request_inference_time_seconds",
                                    "Histogram of time spent in RUNNING phase for request.", lat)
        self._prefill = histogram("vllm:request_prefill_time_seconds",
                                  "Histogram of time spent in PREFILL phase for request.", lat)
        self._decode = histogram("vllm:request_decode_time_seconds",
                                 "Histogram of time spent in DECODE phase for request.", lat)
        self._spec = None
        if num_speculative_tokens:
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft (speculative) token position.", names + ["position"],
                              registry=r)
            self._spec = (counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                          counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                          counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                          [per_pos.labels(**values, position=str(i)) for i in range(num_speculative_tokens)])
            self._spec_seen = None  # the engine's SpecStats at the last spec_decode call
        self.http_requests = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                     ["method", "status", "handler"], registry=r)
        from ..ops import compiles

        Gauge("dsv4:kernel_compiles", "Triton kernel specializations built since the engine started (start-up "
              "included); a rise while serving is a request that waited for a compile", registry=r
              ).set_function(compiles.count)

    # ---- engine side (called from the engine thread; prometheus_client is thread-safe) --------
    def _engine(self, engine: int) -> dict:
        return {**self._labels, "engine": str(engine)}

    def scheduler_state(self, waiting: int, running: int, cache_usage: float, host_usage: float = 0.0,
                        engine: int = 0) -> None:
        """``engine``: the data-parallel rank (vLLM's ``engine`` label; 0 for one engine core)."""
        lab = self._engine(engine)
        self._waiting.labels(**lab).set(waiting)
        self._running.labels(**lab).set(running)
        self._cache_usage.labels(**lab).set(cache_usage)
        if engine == 0:
            self._host_usage.set(host_usage)

    def engine_counters(self, prefix_queries: int, prefix_hits: int, preemptions: int, host_queries: int = 0,
                        host_hits: int = 0, offloaded_bytes: int = 0, restored_bytes: int = 0,
                        engine: int = 0) -> None:
        """Increments since the last call (tokens queried / found in the prefix cache's device tier,
        preemptions, for data-parallel rank ``engine``; tokens queried / found in its host tier,
        bytes copied out to it and back)."""
        lab = self._engine(engine)
        for fam, n in ((self._prefix_queries, prefix_queries), (self._prefix_hits, prefix_hits),
                       (self._preemptions, preemptions)):
            if n:
                fam.labels(**lab).inc(n)
        for c, n in ((self._host_queries, host_queries), (self._host_hits, host_hits),
                     (self._host_offloaded, offloaded_bytes), (self._host_restored, restored_bytes)):
            if n:
                c.inc(n)

    def spec_decode(self, stats) -> None:
        """Count what the engine's ``SpecStats`` (cumulative, on the engine thread) added since the
        last call; a no-op without speculation."""
        if self._spec is None:
            return
        seen = self._spec_seen
        self._spec_seen = copy.deepcopy(stats)
        new = stats if seen is None else stats.since(seen)
        drafts, draft_tokens, accepted, per_pos = self._spec
        if new.num_drafts:
            drafts.inc(new.num_drafts)
            draft_tokens.inc(new.num_draft_tokens)
            accepted.inc(new.num_accepted_tokens)
            for c, n in zip(per_pos, new.accepted_per_position):
                if n:
                    c.inc(n)

    def tokens(self, prompt: int, generated: int) -> None:
        if prompt:
            self._prompt_tokens.inc(prompt)
        if generated:
            self._generation_tokens.inc(generated)

    def first_token(self, ttft: float) -> None:
        self._ttft.observe(ttft)

    def inter_token(self, itl: float) -> None:
        self._itl.observe(itl)

    def finished(self, reason: str, *, e2e: float, prompt_tokens: int, generation_tokens: int,
                 queue: float | None = None, prefill: float | None = None, decode: float | None = None) -> None:
        """A request ended; the phase times are None for a request that never ran (aborted while waiting)."""
        self._success.labels(**self._labels, finished_reason=reason).inc()
        self._e2e.observe(e2e)
        self._req_prompt.observe(prompt_tokens)
        self._req_generation.observe(generation_tokens)
        if queue is not None:
            self._queue.observe(queue)
        if prefill is not None:
            self._prefill.observe(prefill)
            self._inference.observe(prefill + (decode or 0.0))
        if decode is not None:
            self._decode.observe(decode)
            self._tpot.observe(decode / (generation_tokens - 1) if generation_tokens > 1 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HTTPMetricsMiddleware:
    """``http_requests_total{handler, method, status}`` as vLLM's instrumentator counts it: the route's
    path (``none`` for a path no route serves), the status grouped (``2xx``), probes not counted."""

    def __init__(self, app, metrics: ServerMetrics, routes: tuple[str, ...]):
        self.app, self.counter, self.routes = app, metrics.http_requests, frozenset(routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            handler = scope["path"] if scope["path"] in self.routes else "none"
            self.counter.labels(method=scope.get("method", ""), status=f"{status[0] // 100}xx", handler=handler).inc()


class StatsLog:
    """The periodic engine stats line of ``vllm serve`` (throughput, requests, KV cache, prefix-cache hits).

    Logged at INFO every ``interval`` seconds while the engine is busy (tokens moved in this interval or
    the last one, or requests running or waiting), else at DEBUG, as vLLM's LoggingStatLogger does. The
    prefix-cache hit rate is over the last ``recent`` requests that queried the cache.
    """

    def __init__(self, interval: float = 10.0, device: str = "GPU", recent: int = 1000):
        self.interval, self.device, self.recent = interval, device, recent
        self.last = time.monotonic()
        self.prompt = self.generation = 0
        self.last_throughput = (0.0, 0.0)
        self._window: deque = deque()  # (requests, queried tokens, hit tokens) per step
        self._sums = [0, 0, 0]

    def tokens(self, prompt: int, generation: int) -> None:
        self.prompt += prompt
        self.generation += generation

    def prefix(self, requests: int, queries: int, hits: int) -> None:
        if not requests and not queries:
            return
        self._window.append((requests, queries, hits))
        self._sums = [a + b for a, b in zip(self._sums, (requests, queries, hits))]
        while len(self._window) > 1 and self._sums[0] - self._window[0][0] >= self.recent:
            old = self._window.popleft()
            self._sums = [a - b for a, b in zip(self._sums, old)]

    @property
    def hit_rate(self) -> float:
        return self._sums[2] / self._sums[1] if self._sums[1] else 0.0

    def maybe_log(self, now: float, running: int, waiting: int, cache_usage: float) -> bool:
        """Log the line if an interval has passed; True when it was logged at INFO."""
        dt = now - self.last
        if dt < self.interval:
            return False
        throughput = (self.prompt / dt, self.generation / dt)
        busy = any(throughput) or any(self.last_throughput) or running or waiting
        self.last, self.prompt, self.generation, self.last_throughput = now, 0, 0, throughput
        log.log(logging.INFO if busy else logging.DEBUG,
                "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, %s KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                throughput[0], throughput[1], running, waiting, self.device, cache_usage * 100, self.hit_rate * 100)
        return busy
