"""Prometheus metrics of one server (a private registry, so several apps can live in one process).

Names follow vLLM's with a ``dsv4:`` prefix so that existing dashboards need only a rename.
The engine thread records token counts, latencies and scheduler gauges; the HTTP layer records
requests by endpoint and status.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lbl = {"model_name": model_name}
        self.http_requests = Counter("dsv4:http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.request_success = Counter("dsv4:request_success", "Finished generation requests by finish reason",
                                       ["model_name", "finished_reason"], registry=r)
        self._prompt_tokens = Counter("dsv4:prompt_tokens", "Prefilled prompt tokens", ["model_name"],
                                      registry=r).labels(**lbl)
        self._generation_tokens = Counter("dsv4:generation_tokens", "Generated tokens", ["model_name"],
                                          registry=r).labels(**lbl)
        self._waiting = Gauge("dsv4:num_requests_waiting", "Requests waiting to be scheduled", ["model_name"],
                              registry=r).labels(**lbl)
        self._running = Gauge("dsv4:num_requests_running", "Requests in the running batch", ["model_name"],
                              registry=r).labels(**lbl)
        self._cache_usage = Gauge("dsv4:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
                                  ["model_name"], registry=r).labels(**lbl)
        self._ttft = Histogram("dsv4:time_to_first_token_seconds", "Time to first token", ["model_name"],
                               buckets=_LATENCY_BUCKETS, registry=r).labels(**lbl)
        self._tpot = Histogram("dsv4:time_per_output_token_seconds", "Time per output token after the first",
                               ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**lbl)
        self._e2e = Histogram("dsv4:e2e_request_latency_seconds", "Request latency in the engine", ["model_name"],
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**lbl)
        from ..ops import compiles

        Gauge("dsv4:kernel_compiles", "Triton kernel specializations built since the engine started (start-up "
              "included); a rise while serving is a request that waited for a compile", registry=r
              ).set_function(compiles.count)
        self.model_name = model_name

    # ---- engine side (called from the engine thread; prometheus_client is thread-safe) --------
    def scheduler_state(self, waiting: int, running: int, cache_usage: float) -> None:
        self._waiting.set(waiting)
        self._running.set(running)
        self._cache_usage.set(cache_usage)

    def tokens(self, prompt: int, generated: int) -> None:
        if prompt:
            self._prompt_tokens.inc(prompt)
        if generated:
            self._generation_tokens.inc(generated)

    def first_token(self, ttft: float) -> None:
        self._ttft.observe(ttft)

    def finished(self, reason: str, e2e: float, tpot: float | None) -> None:
        self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
        self._e2e.observe(e2e)
        if tpot is not None:
            self._tpot.observe(tpot)

    # ---- HTTP side ------------------------------------------------------------------------------
    def http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
