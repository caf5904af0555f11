"""``dsv4 bench serve``: a load generator for any OpenAI-compatible server, reporting like ``vllm bench serve``.

Requests are streamed ``POST {base_url}/v1/completions`` calls made with ``httpx`` on asyncio, at
most ``--max-concurrency`` in flight (optionally released at ``--request-rate`` with Poisson
arrivals). Per request it records the time to the first streamed chunk (TTFT), the gaps between
chunks (ITL), the end-to-end latency and the token counts (the server's ``usage`` when it sends
one, else the chunk count); TPOT is ``(latency - TTFT) / (output tokens - 1)``. The summary is
printed in ``vllm bench serve``'s table format, and ``--result-json`` writes its field names. A
server that speculates (``vllm:spec_decode_*`` counters on its /metrics) also gets the run's
acceptance: the counters are scraped before and after the main run.

Random prompts: ``--random-input-len`` random token ids per prompt (lengths spread by
``--random-range-ratio``), turned into text by the server's ``/detokenize`` endpoint, else a local
tokenizer (``--tokenizer``), else random words; the server's ``usage.prompt_tokens`` gives the real
input length. Bounded: the run stops after ``--timeout`` seconds (pending requests count as failed)
and each request after ``--request-timeout``; it only talks to ``--base-url`` (loopback by default),
with the environment's proxy settings ignored.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TextIO

from .. import env

MAX_PROMPTS = 100_000
TOKEN_ID_RANGE = (1000, 100_000)  # random prompt ids: clear of special tokens at both ends of most vocabularies
_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


@dataclass
class BenchOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str = ""
    tokenizer: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    num_prompts: int = 100
    max_concurrency: int | None = None
    sweep_concurrency: list[int] | None = None
    request_rate: float = math.inf
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    timeout: float = 600.0
    request_timeout: float = 300.0
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    warmup: bool = True
    result_json: str | None = None
    backend: str = "openai"

    def check(self) -> None:
        if not self.model:
            raise ValueError("--model: the model name the server serves")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {self.base_url!r}: expected http(s)://HOST[:PORT]")
        if not 1 <= self.num_prompts <= MAX_PROMPTS:
            raise ValueError(f"--num-prompts {self.num_prompts}: between 1 and {MAX_PROMPTS}")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be ≥ 1")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be ≥ 1")
        if self.timeout <= 0 or self.request_timeout <= 0:
            raise ValueError("--timeout and --request-timeout must be > 0")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        bad = set(self.percentile_metrics) - {"ttft", "tpot", "itl", "e2el"}
        if bad:
            raise ValueError(f"--percentile-metrics: unknown {sorted(bad)} (ttft, tpot, itl, e2el)")


def bench_options_from_args(a) -> BenchOptions:
    base = a.base_url
    if a.host is not None and a.base_url == "http://127.0.0.1:8000":
        base = f"http://{a.host}:{a.port or 8000}"
    elif a.port is not None and a.base_url == "http://127.0.0.1:8000":
        base = f"http://127.0.0.1:{a.port}"
    return BenchOptions(
        base_url=base.rstrip("/"),
        endpoint=a.endpoint,
        model=a.model,
        tokenizer=a.tokenizer,
        random_input_len=a.random_input_len,
        random_output_len=a.random_output_len,
        random_range_ratio=a.random_range_ratio,
        random_prefix_len=a.random_prefix_len,
        num_prompts=a.num_prompts,
        max_concurrency=a.max_concurrency,
        sweep_concurrency=a.sweep_concurrency,
        request_rate=a.request_rate,
        ignore_eos=a.ignore_eos,
        temperature=a.temperature,
        seed=a.seed,
        api_key=a.api_key or env.openai_api_key(),
        timeout=a.timeout,
        request_timeout=a.request_timeout,
        percentile_metrics=tuple(m.strip() for m in a.percentile_metrics.split(",") if m.strip()),
        metric_percentiles=tuple(float(p) for p in a.metric_percentiles.split(",") if p.strip()),
        warmup=a.warmup,
        result_json=a.result_json,
        backend=a.backend,
    )


# ---- per-request results and metrics ------------------------------------------------------------------
@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # perf_counter at send
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of every streamed chunk
    error: str = ""


@dataclass
class BenchResult:
    options: dict
    max_concurrency: int | None
    duration: float
    results: list[RequestResult]
    metrics: dict
    detokenizer: str

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if not r.success)


def _pct(values: list[float], p: float) -> float:
    """numpy.percentile's default (linear interpolation)."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def calculate_metrics(results: list[RequestResult], duration: float, percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """The numbers of ``vllm bench serve`` from per-request results (times in seconds → ms)."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    d = max(duration, 1e-9)
    m: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / d,
        "output_throughput": total_output / d,
        "total_token_throughput": (total_input + total_output) / d,
    }
    # peak output tok/s: chunks per 1-second bucket (a chunk carries one token on a streaming server)
    times = [t for r in ok for t in r.chunk_times]
    if times:
        t0 = min(r.start for r in ok)
        buckets: dict[int, int] = {}
        for t in times:
            b = int(t - t0)
            buckets[b] = buckets.get(b, 0) + 1
        m["max_output_tokens_per_s"] = float(max(buckets.values()))
    else:
        m["max_output_tokens_per_s"] = 0.0
    events = sorted(
        [(r.start, 1) for r in results if r.start] + [(r.start + r.latency, -1) for r in results if r.start]
    )
    cur = peak = 0
    for _, e in events:
        cur += e
        peak = max(peak, cur)
    m["max_concurrent_requests"] = float(peak)
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = [x * 1000 for x in xs]
        m[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        m[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        m[f"std_{name}_ms"] = statistics.pstdev(ms) if len(ms) > 1 else 0.0
        for p in percentiles:
            m[f"p{_pword(p)}_{name}_ms"] = _pct(ms, p)
    return m


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_table(
    m: dict,
    duration: float,
    max_concurrency: int | None,
    request_rate: float,
    percentile_metrics=("ttft", "tpot", "itl"),
    percentiles=(99.0,),
) -> str:
    """The result table of ``vllm bench serve``."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt=""):
        lines.append(("{:<40} {:<10" + fmt + "}").format(label, value))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != math.inf:
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", duration, ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", m["total_token_throughput"], ".2f")
    heads = {
        "ttft": ("TTFT", "Time to First Token"),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
        "itl": ("ITL", "Inter-token Latency"),
        "e2el": ("E2EL", "End-to-end Latency"),
    }
    for key in percentile_metrics:
        short, header = heads[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pword(p)} {short} (ms):", m[f"p{_pword(p)}_{key}_ms"], ".2f")
    if "spec_decode_acceptance_length" in m:
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
        row("Acceptance rate (%):", m["spec_decode_acceptance_rate"], ".2f")
        row("Acceptance length:", m["spec_decode_acceptance_length"], ".2f")
        row("Drafts:", m["spec_decode_num_drafts"])
        row("Draft tokens:", m["spec_decode_draft_tokens"])
        row("Accepted tokens:", m["spec_decode_accepted_tokens"])
        lines.append("Per-position acceptance (%):")
        for i, rate in enumerate(m["spec_decode_per_position_acceptance_rates"]):
            row(f"  Position {i}:", 100.0 * rate, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r'^(vllm:spec_decode_[a-z_]+)(?:\{([^}]*)\})?\s+(\S+)$')
_POSITION = re.compile(r'position="(\d+)"')


def spec_counters(metrics_text: str) -> dict | None:
    """The server's speculative-decoding counters from a /metrics page (summed over engines), as
    ``{name: value}`` with ``(SPEC_PER_POS, position)`` keys; None when it has none (no speculation)."""
    out: dict = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == SPEC_PER_POS:
            pos = _POSITION.search(labels)
            key = (name, int(pos.group(1))) if pos else None
        else:
            key = name if name in SPEC_COUNTERS else None
        if key is not None:
            out[key] = out.get(key, 0.0) + value
    return out if SPEC_COUNTERS[0] in out else None


def spec_decode_metrics(before: dict, after: dict) -> dict:
    """Acceptance over the run, from the counters' increase: the rate (accepted / draft tokens), the
    acceptance length (1 + accepted per draft, the tokens a verify step gives) and, per draft
    position, the share of drafts accepted up to it."""
    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts, draft_tokens, accepted = (delta(k) for k in SPEC_COUNTERS)
    positions = sorted(k[1] for k in after if isinstance(k, tuple))
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
        "spec_decode_per_position_acceptance_rates": [delta((SPEC_PER_POS, i)) / drafts if drafts else 0.0
                                                      for i in positions],
    }


async def scrape_spec_counters(client, o: BenchOptions, headers: dict) -> dict | None:
    """The server's spec-decode counters now, or None (no /metrics, or no speculation)."""
    import httpx

    try:
        r = await client.get(f"{o.base_url}/metrics", headers=headers, timeout=o.request_timeout)
    except httpx.HTTPError:
        return None
    return spec_counters(r.text) if r.status_code == 200 else None


def format_sweep(runs: list[BenchResult]) -> str:
    head = (
        f"{'Max concurrency':>15}  {'Successful':>10}  {'Failed':>6}  {'Output tok/s':>12}  {'Total tok/s':>11}  "
        f"{'Median TTFT (ms)':>16}  {'Median TPOT (ms)':>16}"
    )
    lines = [head]
    for r in runs:
        m = r.metrics
        c = "-" if r.max_concurrency is None else r.max_concurrency
        lines.append(
            f"{c:>15}  {m['completed']:>10}  {m['failed']:>6}  {m['output_throughput']:>12.2f}  "
            f"{m['total_token_throughput']:>11.2f}  {m['median_ttft_ms']:>16.2f}  {m['median_tpot_ms']:>16.2f}"
        )
    return "\n".join(lines)


# ---- prompts -----------------------------------------------------------------------------------------
def _lens(rng: random.Random, n: int, base: int, ratio: float) -> list[int]:
    lo, hi = max(1, math.floor(base * (1 - ratio))), max(1, math.ceil(base * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _local_detokenizer(path: str):
    from ..chat.tokenizer import Tokenizer, tokenizer_json_path

    p = Path(path)
    tok = Tokenizer.from_file(p if p.is_file() else tokenizer_json_path(p))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


async def _server_detokenize(client, o: BenchOptions, headers: dict, ids: list[int]) -> str:
    r = await client.post(
        f"{o.base_url}/detokenize", json={"model": o.model, "tokens": ids}, headers=headers, timeout=o.request_timeout
    )
    r.raise_for_status()
    return r.json()["prompt"]


async def make_prompts(client, o: BenchOptions, headers: dict) -> tuple[list[tuple[str, int, int]], str]:
    """[(prompt text, intended input tokens, output tokens)] and how the text was made."""
    rng = random.Random(o.seed)
    ins = _lens(rng, o.num_prompts, o.random_input_len, o.random_range_ratio)
    outs = _lens(rng, o.num_prompts, o.random_output_len, o.random_range_ratio)
    lo, hi = TOKEN_ID_RANGE
    prefix = [rng.randrange(lo, hi) for _ in range(o.random_prefix_len)]
    id_lists = [prefix + [rng.randrange(lo, hi) for _ in range(n)] for n in ins]
    how = "random words"
    texts: list[str] | None = None
    if o.tokenizer:
        dec = _local_detokenizer(o.tokenizer)
        texts, how = [dec(ids) for ids in id_lists], f"local tokenizer {o.tokenizer}"
    else:
        try:
            texts = [await _server_detokenize(client, o, headers, ids) for ids in id_lists]
            how = "server /detokenize"
        except Exception:  # noqa: BLE001 - no /detokenize: fall back
            texts = None
    if texts is None:
        wprefix = [rng.choice(_WORDS) for _ in range(o.random_prefix_len)]
        texts = [" ".join(wprefix + [rng.choice(_WORDS) for _ in range(n)]) for n in ins]
    return [(t, len(prefix) + n, m) for t, n, m in zip(texts, ins, outs)], how


# ---- requests ----------------------------------------------------------------------------------------
async def send_one(
    client, o: BenchOptions, headers: dict, prompt: str, prompt_len: int, max_tokens: int
) -> RequestResult:
    payload = {
        "model": o.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": o.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if o.ignore_eos:
        payload["ignore_eos"] = True
    res = RequestResult(prompt_len=prompt_len)
    st = time.perf_counter()
    res.start = st
    last = st
    chunks = 0
    usage = None
    try:
        async with client.stream(
            "POST", f"{o.base_url}{o.endpoint}", json=payload, headers=headers, timeout=o.request_timeout
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                res.latency = time.perf_counter() - st
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = f"stream error: {obj['error']}"
                    break
                if obj.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    res.chunk_times.append(now)
                if obj.get("usage"):
                    usage = obj["usage"]
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - st
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or chunks)
        res.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
    else:
        res.output_tokens = chunks
    if not res.error and chunks == 0:
        res.error = "no streamed chunks"
    res.success = not res.error
    return res


async def _run_once(o: BenchOptions, concurrency: int | None, out: TextIO) -> BenchResult:
    import httpx

    headers = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
    limits = httpx.Limits(
        max_connections=max(concurrency or o.num_prompts, 1) + 4,
        max_keepalive_connections=max(concurrency or o.num_prompts, 1) + 4,
    )
    async with httpx.AsyncClient(limits=limits, trust_env=False, timeout=o.request_timeout) as client:
        prompts, how = await make_prompts(client, o, headers)
        out.write(
            f"prompts: {len(prompts)} random ({how}); input {o.random_input_len} tokens, output "
            f"{o.random_output_len}, range ratio {o.random_range_ratio}\n"
        )
        if o.warmup:
            out.write("Starting initial single prompt test run...\n")
            t, n, _ = prompts[0]
            w = await send_one(client, o, headers, t, n, min(o.random_output_len, 8))
            if not w.success:
                raise RuntimeError(f"initial test run failed: {w.error}. Check --base-url, --model and the server log")
            out.write("Initial test run completed. Starting main benchmark run...\n")
        out.write(f"Maximum request concurrency: {concurrency}\n")
        out.flush()
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(o.seed + 1)

        async def limited(t, n, m):
            if sem is None:
                return await send_one(client, o, headers, t, n, m)
            async with sem:
                return await send_one(client, o, headers, t, n, m)

        spec_before = await scrape_spec_counters(client, o, headers)
        t0 = time.perf_counter()
        tasks = []
        deadline = t0 + o.timeout
        for t, n, m in prompts:
            tasks.append(asyncio.create_task(limited(t, n, m)))
            if o.request_rate != math.inf:
                await asyncio.sleep(min(rng.expovariate(o.request_rate), max(0.0, deadline - time.perf_counter())))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for p in pending:
            p.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        results = []
        for task, (_, n, _) in zip(tasks, prompts):
            if task in done and not task.cancelled() and task.exception() is None:
                results.append(task.result())
            else:
                results.append(RequestResult(prompt_len=n, error=f"not finished within --timeout {o.timeout:g} s"))
        ends = [r.start + r.latency for r in results if r.start]
        duration = (max(ends) if ends else time.perf_counter()) - t0
        spec_after = await scrape_spec_counters(client, o, headers) if spec_before is not None else None
    m = calculate_metrics(results, duration, o.metric_percentiles)
    if spec_after is not None:
        m.update(spec_decode_metrics(spec_before, spec_after))
    return BenchResult({}, concurrency, duration, results, m, how)


def result_dict(o: BenchOptions, r: BenchResult) -> dict:
    d = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": o.backend,
        "endpoint_type": "openai",
        "base_url": o.base_url,
        "model_id": o.model,
        "tokenizer_id": o.tokenizer,
        "dataset_name": "random",
        "num_prompts": o.num_prompts,
        "request_rate": "inf" if o.request_rate == math.inf else o.request_rate,
        "max_concurrency": r.max_concurrency,
        "random_input_len": o.random_input_len,
        "random_output_len": o.random_output_len,
        "random_range_ratio": o.random_range_ratio,
        "ignore_eos": o.ignore_eos,
        "seed": o.seed,
        "prompt_text": r.detokenizer,
        "duration": r.duration,
    }
    d.update(r.metrics)
    d.update(
        input_lens=[x.prompt_len for x in r.results],
        output_lens=[x.output_tokens for x in r.results],
        ttfts=[x.ttft for x in r.results],
        itls=[x.itl for x in r.results],
        errors=[x.error for x in r.results],
    )
    return d


@dataclass
class BenchRun:
    runs: list[BenchResult]
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.error or not self.runs:
            return 1
        return 1 if any(r.failed for r in self.runs) else 0


def run_bench(o: BenchOptions, out: TextIO | None = None) -> BenchRun:
    """Run the benchmark (once, or once per ``sweep_concurrency``); print tables; write ``result_json``."""
    o.check()
    out = out or sys.stdout
    levels = o.sweep_concurrency or [o.max_concurrency]
    runs: list[BenchResult] = []
    try:
        for c in levels:
            r = asyncio.run(_run_once(o, c, out))
            runs.append(r)
            out.write(
                format_table(r.metrics, r.duration, c, o.request_rate, o.percentile_metrics, o.metric_percentiles)
                + "\n"
            )
            errs = [x.error for x in r.results if x.error]
            if errs:
                out.write(f"first error ({len(errs)} failed): {errs[0]}\n")
            out.flush()
    except RuntimeError as e:
        out.write(f"dsv4 bench serve: {e}\n")
        return BenchRun(runs, str(e))
    if len(runs) > 1:
        out.write(format_sweep(runs) + "\n")
    if o.result_json:
        data = [result_dict(o, r) for r in runs]
        Path(o.result_json).write_text(json.dumps(data[0] if len(data) == 1 else data, indent=2))
        out.write(f"result written to {o.result_json}\n")
    out.flush()
    return BenchRun(runs)
