"""End-to-end benchmark on one GPU: dsv4 vs transformers vs the HBM bound, on one checkpoint.

Run on the H200 (see docs/perf.md for the command that produced the table there):

    python bench/e2e.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4 --out $OUT/e2e.json

The host tier of the prefix cache (``--host-tier 262144``: only that measurement):

    python bench/e2e.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4 --host-tier 262144 --out $OUT/ht.json

and its smoke run on the CPU (the same procedure on the tiny checkpoint, no bandwidth bound):

    python bench/e2e.py --device cpu --ckpt /tmp/tiny --make-preset tiny --host-tier 1024 --prefill 512

Measures, for the same `flash-width` checkpoint (real widths, CSA/HCA layers):
- decode ms/step at batch 1, 8, 64 through the dsv4 engine (steady-state decode steps only; each request has
  a `--decode-prompt`-token prompt, 32 by default);
- prefill tok/s at 1K and 8K tokens (one request, one chunk);
- the same figures for transformers' DeepseekV4ForCausalLM (bf16, eager, dequantized weights);
- the HBM bound of one decode step: the bytes it must read in the checkpoint's own formats
  (all non-expert weights of the layers, the active routed experts, the head) / measured bandwidth.

``--verify-k 1,2,3`` times instead the MTP speculative step against a one-token decode step at each
batch (``bench_verify``); ``--device cpu`` runs it on a tiny checkpoint as a smoke test:

    python bench/e2e.py --ckpt /tmp/tiny --make-preset tiny --layers 2 --device cpu --batches 1,8 --verify-k 1,2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PREFILL_TIMED_RUNS = 3  # prefill: the median of this many runs after a warm-up run
sys.path.insert(0, str(ROOT))


def measure_bandwidth() -> float:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    a = b = None  # freed (a timed closure above refers to them)
    return 2 * n / dt  # bytes read + written per second


def measure_peaks() -> dict:
    """Dense bf16 matmul peak (8192³, random data) measured in this run."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    a = b = None  # freed (a timed closure above refers to them)
    return {"bf16_peak_flops": 2 * n ** 3 / dt}


def prefill_flops(ckpt_dir: str, L: int) -> float:
    """FLOPs of one L-token prefill: 2·(active weights)·L for the layers' GEMMs (non-expert weights,
    top-k + shared experts), the head once (the engine computes logits for the sampled last row only),
    plus the attention products (each query × its keys: window + selected/compressed entries, QK and PV
    over 512 dims, all heads) and the indexer scores of CSA layers.

    Up to the fourteenth session this counted the head for all L rows, which the engine never computes:
    at 8K that added 8.7 TFLOP (30 % of the count) and overstated the fraction of peak by ~1.4×."""
    from dsv4.checkpoint.reader import Checkpoint

    ck = Checkpoint(ckpt_dir)
    c = ck.config
    dense = expert = head = 0
    for name, e in ck.entries.items():
        if name.startswith("mtp.") or name == "embed.weight" or len(e.shape) != 2 or not name.endswith(".weight"):
            continue
        n = e.shape[0] * e.shape[1] * (2 if e.dtype in ("I8", "U8") and ".experts." in name else 1)
        if name == "head.weight":
            head += n
        elif ".experts." in name and ".shared_experts." not in name:
            expert += n
        else:
            dense += n
    active = dense + expert * c.num_experts_per_tok / c.n_routed_experts
    fl = 2.0 * active * L + 2.0 * head
    for layer in range(c.num_hidden_layers):
        r = c.compress_ratio(layer)
        avg_keys = min(L, c.sliding_window)
        if r == 4:
            avg_keys += min(c.index_topk, L / 8)
            fl += 2.0 * L * (L / 8) * c.index_n_heads * c.index_head_dim  # indexer scores over visible entries
        elif r:
            avg_keys += L / (2 * r)
        fl += 4.0 * L * avg_keys * c.num_attention_heads * c.head_dim
    return fl


def decode_step_bytes(ckpt_dir: str, batch: int) -> int:
    """Bytes one decode step must read: every layer weight except routed experts, the routed experts
    the batch activates (≤ min(E, 6·batch) per layer, counted at their checkpoint size), the head."""
    from dsv4.checkpoint.reader import Checkpoint

    ck = Checkpoint(ckpt_dir)
    c = ck.config
    total = 0
    per_expert = 0
    for name, e in ck.entries.items():
        if name == "embed.weight" or name.startswith("mtp."):
            continue
        if ".experts." in name:
            if ".experts.0." in name and name.startswith("layers.0."):
                per_expert += e.nbytes
            continue
        total += e.nbytes
    active = min(c.n_routed_experts, c.num_experts_per_tok * batch)
    return total + c.num_hidden_layers * active * per_expert


PROFILE_GROUPS = (  # kernel-name substrings → the op they belong to (first match wins)
    ("sparse attention (paged, in-kernel FP8 decode)", ("_sparse_attn", "sparse_attention", "_attn_")),
    ("Lightning Indexer (scores + top-k)", ("_indexer", "sort", "topk", "radix")),
    ("KV insert (window + compressed)", ("_kv_insert", "_kv_norm_rope_insert", "index_put", "scatter")),
    ("FP8 linear", ("_fp8_linear",)),
    ("MoE (routing + grouped experts)", ("_moe", "_route")),
    ("mHC pre/post", ("_mix_kernel", "_gate_kernel", "_post_kernel", "_comb_kernel", "_collapse")),
    ("dense GEMM / RMSNorm / split-K sums (batch-invariant)", ("_dense", "_sum_in_order", "_rms_norm")),
    ("cuBLAS / other GEMM", ("gemm", "cutlass", "sm90_xmma", "nvjet")),
    ("elementwise / copies / other", ("",)),
)


def profile_decode(eng, steps: int = 5, run=None, top: int = 30) -> tuple[dict, list]:
    """Device time per decode step by op group, with their "device total" (torch.profiler over
    ``steps`` engine steps, or over one call of ``run``, with steps=1), and the ``top`` largest
    kernels as printed rows [ms per step, launches per step, name]."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if run is not None:
            run()
        else:
            for _ in range(steps):
                eng.step()
        torch.cuda.synchronize()
    groups = {name: 0.0 for name, _ in PROFILE_GROUPS}
    kernels = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not t or ev.key.startswith("ProfilerStep"):
            continue
        kernels.append((t / 1e3 / steps, ev.count / steps, ev.key[:90]))
        key = ev.key.lower()
        for name, subs in PROFILE_GROUPS:
            if any(sub.lower() in key for sub in subs):
                groups[name] += t / 1e3 / steps
                break
    rows = [[round(ms, 4), round(n, 1), name] for ms, n, name in sorted(kernels, reverse=True)[:top]]
    for ms, n, name in rows:
        print(f"   {ms:9.4f} ms {n:7.1f}x  {name}", flush=True)
    groups = {k: round(v, 3) for k, v in groups.items()}
    groups["device total"] = round(sum(groups.values()), 3)
    groups["kernels per step"] = round(sum(n for _, n, _ in kernels), 1)
    return groups, rows


def layer_timeline(eng, layers: list[int]) -> list[dict]:
    """The kernels of each of ``layers`` in one decode step, in time order (torch.profiler's trace of one
    CUDA-graph replay): from the post_mix launch that ends layer L − 1 to the one that ends L, each kernel's
    start (µs after the window's start), duration and stream, printed. Per layer: the window's wall time, the
    time no kernel runs at all (``idle_us``: launch latency and dependency waits), the kernels' summed time
    (above the wall where branches overlap), and the kernels and gaps of the stream the window's first
    kernel ran on ("main"; a replay maps the graph's branches to streams of its own, so that is not always
    the path the step waits on)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp(), "decode_step_trace.json")
    prof.export_chrome_trace(str(path))
    ks = sorted((e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                key=lambda e: e["ts"])
    marks = [i for i, e in enumerate(ks) if "_post_mix_kernel" in e["name"]]  # two a layer (attention, MoE posts)
    out = []
    for layer in layers:
        if not 1 <= layer or len(marks) < 2 * layer + 2:
            out.append({"layer": layer, "error": f"{len(marks)} post_mix launches in the step"})
            continue
        lo, hi = marks[2 * layer - 1], marks[2 * layer + 1]
        window = ks[lo:hi]
        t0, main = window[0]["ts"], window[0]["tid"]
        print(f"   layer {layer}: {'start µs':>9s} {'µs':>6s}  stream  kernel", flush=True)
        for e in window:
            print(f"   {'':8s} {e['ts'] - t0:9.1f} {e['dur']:6.1f}  {'main' if e['tid'] == main else e['tid']!s:>6s}  "
                  f"{e['name'][:60]}", flush=True)
        on_main = [e for e in window if e["tid"] == main]
        gaps = sum(max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(on_main, on_main[1:]))
        idle, end = 0.0, t0
        for e in window:
            idle += max(0.0, e["ts"] - end)
            end = max(end, e["ts"] + e["dur"])
        idle += max(0.0, ks[hi]["ts"] - end)
        res = {"layer": layer, "wall_us": round(ks[hi]["ts"] - t0, 1), "idle_us": round(idle, 1),
               "busy_sum_us": round(sum(e["dur"] for e in window), 1), "kernels": len(window),
               "main_busy_us": round(sum(e["dur"] for e in on_main), 1), "main_kernels": len(on_main),
               "main_gaps_us": round(gaps, 1)}
        print(f"   layer {layer}: {res}", flush=True)
        out.append(res)
    return out


def decode_tok_s(eng, B: int, g, steps: int = 20, profile: bool = False,
                 prompt: int = 32, timeline: list[int] | None = None) -> tuple[float, tuple | None]:
    """ms per steady-state decode step of B requests (``prompt``-token prompts: the context every step's
    attention reads), and ``profile_decode``'s (groups, top kernels) when ``profile`` (with ``timeline``, the
    groups hold those layers' ``layer_timeline`` too)."""
    from dsv4 import SamplingParams

    ids = [eng.add_request(prompt_token_ids=torch.randint(3, 120000, (prompt,), generator=g).tolist(),
                           params=SamplingParams(temperature=0, max_tokens=steps + 12 + (6 if profile else 0),
                                                 ignore_eos=True)) for _ in range(B)]
    while any(len(eng.requests[i][0].output_token_ids) == 0 for i in ids):  # every prompt prefilled (in chunks)
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / steps * 1e3
    prof = profile_decode(eng) if profile else None
    if timeline and prof is not None:
        prof[0]["timeline"] = layer_timeline(eng, timeline)
    while eng.has_unfinished_requests():
        eng.step()
    return ms, prof


def greedy_outputs(eng, batch: int = 4, tokens: int = 12, prompt: int = 32) -> list[list[int]]:
    """The greedy tokens of ``batch`` fixed random prompts decoded together: an arm whose settings claim the
    defaults' bits must give the same tokens (a difference is a wrong kernel, not noise)."""
    from dsv4 import SamplingParams

    g = torch.Generator().manual_seed(1234)
    ids = [eng.add_request(prompt_token_ids=torch.randint(3, 120000, (prompt,), generator=g).tolist(),
                           params=SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                                 output_kind="final_only"))
           for _ in range(batch)]
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return [outs[i] for i in ids]


def bench_dsv4(ckpt: str, batches: list[int], prefill_lens: list[int], backend: str, variants: list[str],
               long_context: int = 0, long_repeat: int = 1, long_profile: bool = False,
               profile_prefill: list[int] | None = None, ab: list[str] | None = None, decode_prompt: int = 32,
               act_quant: bool = False, timeline: list[int] | None = None,
               arms: dict[str, list[str]] | None = None) -> dict:
    """Decode/prefill of the dsv4 engine. The decode-path ``variants`` run on the one loaded model:
    graphs (the engine's defaults: CUDA graphs, batch-invariant tiles and, on one GPU, async
    scheduling: the next step launched before this one's greedy picks are read), sync (graphs
    without async scheduling), async (async scheduling asked for explicitly), eager (no graphs;
    profiled), fastest (graphs + per-M tiles: what batch invariance costs), reference (the
    per-request attention of the oracle: the old path). ``ab``: ``--set`` items timed against the defaults
    at every prefill length, run by run in turn on the same engine (constants the prefill reads per call),
    and at every batch on an engine whose decode graphs were captured under them (the "_B" keys).
    ``arms``: more such arms, {key suffix: items} (``--arm``), each timed the same way on the one loaded
    model; with any arm the defaults' decode is timed again last (the "_A2" keys), so drift over the
    run shows. ``timeline``: print those layers' kernels of a batch-1 graph step (``layer_timeline``)."""
    from dsv4 import LLM, SamplingParams
    from dsv4.engine.engine import LLMEngine
    from dsv4.ops.invariance import set_batch_invariant

    res: dict = {"decode_prompt": decode_prompt, "act_quant": act_quant}
    max_len = max(max(prefill_lens), decode_prompt) + 64
    llm = LLM(ckpt, dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", max_model_len=max_len, max_num_seqs=max(batches),
              max_num_batched_tokens=max(prefill_lens), kv_cache_memory=16 << 30, enable_prefix_caching=False,
              backend=backend, act_quant=act_quant)
    eng, llm.engine = llm.engine, None
    model, tok, cfg0 = eng.model, eng.tokenizer, eng.config
    res["graph_capture_s"] = getattr(eng.runner.graphs, "capture_seconds", None)
    res["async_scheduling_default"] = cfg0.async_scheduling  # what the "graphs" variant ran with

    def engine(**changes):
        nonlocal eng
        eng = None
        torch.cuda.empty_cache()
        return LLMEngine(dataclasses.replace(cfg0, **changes), model=model, tokenizer=tok)

    g = torch.Generator().manual_seed(0)
    for variant in variants:
        if variant != "graphs":
            set_batch_invariant(variant != "fastest")
            eng = engine(enforce_eager=variant == "eager",
                         async_scheduling={"sync": False, "async": True}.get(variant, cfg0.async_scheduling),
                         attention="reference" if variant == "reference" else "auto")
        for B in batches:
            if variant == "reference" and B > 8:
                continue  # the per-request path takes seconds per step at 64
            # profiled: eager steps (every kernel a launch) and graph replays (kernels inside the
            # graph; the step's wall time minus their sum is host time)
            ms, prof = decode_tok_s(eng, B, g, profile=(variant in ("eager", "graphs") and B in (1, max(batches))),
                                    prompt=decode_prompt, timeline=timeline if (variant, B) == ("graphs", 1) else None)
            res[f"decode_ms_b{B}" + ("" if variant == "graphs" else f"_{variant}")] = ms
            if prof:
                suffix = "_graphs" if variant == "graphs" else ""
                res[f"profile_b{B}{suffix}"], res[f"top_kernels_b{B}{suffix}"] = prof
            print(variant, B, round(ms, 3), prof[0] if prof else "", flush=True)
        set_batch_invariant(True)
    others = {**({"_B": ab} if ab else {}), **(arms or {})}  # the arms beside the defaults, by key suffix
    want = greedy_outputs(eng) if others else None
    for arm, items in others.items():  # decode under each arm's settings: graphs captured with them (they may
        with settings_applied(items):  # change what a capture records)
            eng = engine()
            got = greedy_outputs(eng)
            res[f"greedy_same{arm}"] = got == want
            print(f"{arm[1:]}: greedy tokens {'the same as' if got == want else 'DIFFERENT from'} the defaults'",
                  flush=True)
            for B in batches:
                ms, prof = decode_tok_s(eng, B, g, profile=B == 1, prompt=decode_prompt, timeline=timeline)
                res[f"decode_ms_b{B}{arm}"] = ms
                if prof:
                    res[f"profile_b1{arm}"] = prof[0]
                print(f"{arm[1:]}:", " ".join(items), B, round(ms, 3), prof[0] if prof else "", flush=True)
    if others:  # the defaults again, last: how far the machine drifted while the arms ran
        eng = engine()
        for B in batches:
            ms, _ = decode_tok_s(eng, B, g, prompt=decode_prompt)
            res[f"decode_ms_b{B}_A2"] = ms
            print("A again:", B, round(ms, 3), flush=True)
    elif variants[-1] != "graphs":
        eng = engine()
    if ab:
        res["ab"] = ab
    res["arms"] = {"": [], **others}
    arms = res["arms"]  # the prefill alternates every arm run by run on this engine (drift hits all alike)

    def one_prefill(ids):
        eng.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()

    for L in prefill_lens:
        runs = {arm: [] for arm in arms}
        # run 0 warms up this shape's kernels; then the median of three (one 1K run moved by up to 30 %
        # between device calls of one tree); a new prompt each run, so no prefix-cache hit
        for rep in range(1 + PREFILL_TIMED_RUNS):
            for arm, items in arms.items():
                ids = torch.randint(3, 120000, (L,), generator=g).tolist()
                with settings_applied(items):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    one_prefill(ids)
                    torch.cuda.synchronize()
                    runs[arm].append(time.perf_counter() - t)
        for arm, items in arms.items():
            dt = statistics.median(runs[arm][1:])
            res[f"prefill_tok_s_{L}{arm}"] = L / dt
            res[f"prefill_ms_runs_{L}{arm}"] = [round(r * 1e3, 2) for r in runs[arm]]
            if L in (profile_prefill or [max(prefill_lens)]):  # one more, profiled: where a prefill's device time goes
                with settings_applied(items):
                    prof, res[f"top_kernels_prefill_{L}{arm}"] = profile_decode(eng, steps=1,
                                                                               run=lambda: one_prefill(ids))
                res[f"profile_prefill_{L}{arm}"] = prof
                print("prefill", L, arm or "", round(dt * 1e3, 1), "ms", prof, flush=True)
    if long_context:  # one long prompt: chunked prefill, then 16 decode steps; peak memory
        chunk = 8192
        eng = engine(max_model_len=long_context + 64, max_num_seqs=4, max_num_batched_tokens=chunk,
                     kv_cache_memory=8 << 30)
        torch.cuda.reset_peak_memory_stats()
        runs = []
        for rep in range(long_repeat):  # a later run has its kernels compiled (new prompt: no prefix hit)
            ids = torch.randint(3, 120000, (long_context,), generator=g).tolist()
            eng.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            torch.cuda.synchronize()
            t = time.perf_counter()
            chunk_ms = []
            n_chunks = -(-long_context // chunk)
            for i in range(n_chunks):
                c = time.perf_counter()
                if long_profile and rep + 1 == long_repeat and i + 1 == n_chunks:  # the last chunk's kernels
                    prof, top = profile_decode(eng, steps=1)
                    res[f"profile_long_{long_context}_last_chunk"], res[f"top_kernels_long_{long_context}"] = prof, top
                else:
                    eng.step()
                torch.cuda.synchronize()
                chunk_ms.append(round((time.perf_counter() - c) * 1e3, 1))
            t_prefill = time.perf_counter() - t
            runs.append({"prefill_s": round(t_prefill, 2), "chunk_ms": chunk_ms})
            print("long context prefill run", rep, runs[-1], flush=True)
            if rep + 1 < long_repeat:
                while eng.has_unfinished_requests():
                    eng.step()
        t = time.perf_counter()
        n = 0
        outs = []
        while eng.has_unfinished_requests():
            outs = eng.step() or outs
            n += 1
        torch.cuda.synchronize()
        res[f"long_{long_context}"] = {
            "prefill_s": round(t_prefill, 2), "prefill_tok_s": round(long_context / t_prefill),
            "decode_ms": round((time.perf_counter() - t) / max(n, 1) * 1e3, 2),
            "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "tokens": len(outs[-1].outputs[0].token_ids) if outs else 0, "runs": runs}
        print("long context", res[f"long_{long_context}"], flush=True)
    return res


def measure_host_copies(reps: int = 5, nbytes: int = 1 << 30, device: str = "cuda") -> dict:
    """The PCIe bound measured here: one contiguous pinned host ↔ device copy of ``nbytes`` each way
    (the median of ``reps`` after a warm-up), bytes per second; nothing on the CPU."""
    if torch.device(device).type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[f"pinned_{name}_GBps"] = round(nbytes / statistics.median(times[1:]) / 1e9, 2)
    return out


def bench_host_tier(ckpt: str, L: int, chunk: int = 8192, device_hits: int = 3, device: str = "cuda") -> dict:
    """TTFT of an ``L``-token prompt cold, re-sent from the device tier, and re-sent from the host
    tier after another ``L``-token prompt pushed its blocks out of a device pool that holds one
    such request; whether the first token and its logprob agree; the copy bandwidth the engine's
    own transfer path reaches (consecutive and scattered slots) against the pinned-copy bound.
    On the CPU (``device="cpu"``) it runs in float32: a dry run of the procedure on a small checkpoint."""
    from dsv4 import LLM, SamplingParams
    from dsv4.cache.host_tier import HostTransfer
    from dsv4.cache.paged import unit_bytes
    from dsv4.config import load_config
    from dsv4.model.cache import CacheNumerics
    from dsv4.model.step import BLOCK

    seqs = 2
    max_len = L + 64
    gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    blk, swa, slot = unit_bytes(load_config(ckpt), CacheNumerics("fp8_ds_mla"), dtype)
    need = -(-max_len // BLOCK)
    fixed = seqs * slot + (seqs * 3 + -(-chunk // 64) + 2) * swa
    pool = fixed + need * (blk + 2 * swa)  # one request's blocks: the next prompt evicts every cached one
    host_gib = 2.2 * need * (blk + 2 * swa) / 2**30  # both prompts' blocks
    t = time.perf_counter()
    llm = LLM(ckpt, device=device, dtype="bfloat16" if gpu else "float32", kv_cache_dtype="fp8_ds_mla",
              max_model_len=max_len,
              max_num_seqs=seqs, max_num_batched_tokens=chunk, kv_cache_memory=pool, kv_offloading_size=host_gib)
    eng = llm.engine
    kv = eng.kv
    res = {"tokens": L, "engine_init_s": round(time.perf_counter() - t, 1), "device_blocks": kv.kvc.budget.num_blocks,
           "host_blocks": kv.host.num_slots, "slot_MiB": round(kv.host.store.slot_bytes / 2**20, 3),
           "device_tier_tokens": kv.kvc.budget.capacity_tokens, "host_tier_tokens": kv.host.store.capacity_tokens}
    g = torch.Generator().manual_seed(7)
    prompt, other = (torch.randint(3, 120000, (L,), generator=g).tolist() for _ in range(2))
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)

    def ttft(ids) -> tuple[float, tuple]:
        sync()
        t0 = time.perf_counter()
        rid = eng.add_request(prompt_token_ids=ids, params=sp)
        out = eng.run_to_completion([rid])[rid]
        dt = time.perf_counter() - t0
        c = out.outputs[0]
        return dt, (tuple(c.token_ids), tuple(c.logprobs[i][tok].logprob for i, tok in enumerate(c.token_ids)))

    res["cold_s"], cold = ttft(prompt)
    runs = []
    for _ in range(device_hits):
        dt, sig = ttft(prompt)
        runs.append(dt)
        res["device_hit_equal"] = res.get("device_hit_equal", True) and sig == cold
    res["device_hit_s"], res["device_hit_runs_s"] = statistics.median(runs), [round(r, 4) for r in runs]
    hashes = kv.chain_hashes(prompt, (L - 1) // BLOCK)
    res["push_s"], _ = ttft(other)
    res["pushed_out_blocks"] = sum(h not in kv.cached for h in hashes)
    res["in_host_tier_blocks"] = sum(h in kv.host for h in hashes)
    before = dict(kv.stats())
    res["host_hit_s"], host = ttft(prompt)
    after = kv.stats()
    res["host_hit_equal"] = host == cold
    res["host_hit_tokens"] = after["host_prefix_cache_hits"] - before["host_prefix_cache_hits"]
    res["host_restored_MiB"] = round((after["host_restored_bytes"] - before["host_restored_bytes"]) / 2**20, 1)
    res["host_offloaded_MiB"] = round(after["host_offloaded_bytes"] / 2**20, 1)
    res["stats"] = after
    print("host tier", json.dumps({k: v for k, v in res.items() if k != "stats"}), flush=True)

    # the engine's transfer path on its own: n blocks each way, consecutive and scattered slots/pages
    kv.reset_prefix_cache()  # (nothing runs: every device page is free to write)
    store = kv.host.store
    n = min(kv.kvc.budget.num_blocks, store.num_slots, kv.kvc.budget.num_swa_pages // 2)
    perm = torch.randperm(n, generator=g).tolist()
    for layout, order in (("consecutive", list(range(n))), ("scattered", perm)):
        for direction in ("in", "out"):
            transfers = [HostTransfer(direction, slot_i, b, (2 * b, 2 * b + 1)) for slot_i, b in zip(order, range(n))]
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                store.execute(transfers)
                store.copies.synchronize()
                times.append(time.perf_counter() - t0)
            res[f"engine_{direction}_{layout}_GBps"] = round(n * store.slot_bytes / min(times) / 1e9, 2)
    res["engine_copy_blocks"] = n
    return res


PUBLISHED_ACCEPTANCE = 0.8  # per-position acceptance of Flash's MTP layer (vLLM / SGLang reports)


def verify_step_ms(eng, B: int, g, sync, steps: int = 10, profile: bool = False) -> float:
    """ms per steady-state engine step of B requests (32-token prompts); with a proposer every step
    verifies k drafts per request (random weights reject them, which costs the same: the chunk
    always has k + 1 rows). ``profile``: print the host functions of the timed steps by own time
    (cProfile: where a host-bound step spends it)."""
    from dsv4 import SamplingParams

    vocab = eng.model_config.vocab_size
    for _ in range(B):
        eng.add_request(prompt_token_ids=torch.randint(3, vocab, (32,), generator=g).tolist(),
                        params=SamplingParams(temperature=0, max_tokens=(steps + 4) * 4, ignore_eos=True))
    for _ in range(3):  # the prefill, then the first drafts
        eng.step()
    sync()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    ms = (time.perf_counter() - t) / steps * 1e3
    replay = _replay_ms(eng, B, sync, steps)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return ms, replay


def _rows_replay_ms(eng, n: int, g, sync, steps: int) -> float | None:
    """ms per replay of the decode graph for ``n`` rows (random tokens, spare positions and pages):
    the device time of a forward over as many rows as a verify step of B·(k + 1) has."""
    graphs = eng.runner.graphs
    b = graphs.bucket(n) if graphs is not None else None
    if b is None or graphs.graphs[b][0] is None:
        return None
    graphs.inputs[b][:b].copy_(torch.randint(3, eng.model_config.vocab_size, (b,), generator=g))
    return _time_replays(graphs.graphs[b][0], sync, steps)


def _replay_ms(eng, B: int, sync, steps: int) -> float | None:
    """ms per replay of the CUDA graph a step of B requests runs (the speculative step's, else the
    decode step's) on its last inputs, back to back: the step's device time without the host's."""
    graphs = eng.spec_graphs or eng.runner.graphs
    b = graphs.bucket(B) if graphs is not None else None
    key = (b, False) if eng.spec_graphs is not None else b  # (the greedy speculative step's)
    if b is None or graphs.graphs[key][0] is None:
        return None
    return _time_replays(graphs.graphs[key][0], sync, steps)


def _time_replays(graph, sync, steps: int) -> float:
    """ms per replay of ``graph``, ``steps`` replays back to back."""
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    sync()
    return (time.perf_counter() - t) / steps * 1e3


def bench_verify(ckpt: str, batches: list[int], ks: list[int], device: str, backend: str, method: str = "mtp",
                 acceptance: float = PUBLISHED_ACCEPTANCE, steps: int = 10, profile: bool = False) -> dict:
    """The speculative step (MTP drafting + the verify forward of k + 1 rows per request) against a
    one-token decode step, per batch; the implied speedup is the tokens a step gives at
    ``acceptance`` per position (sum of acceptance**i, i = 0..k) over the step-time ratio."""
    from dsv4.engine.engine import EngineConfig, LLMEngine
    from dsv4.ops import compiles

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cfg = dict(model=ckpt, dtype=str(dtype).removeprefix("torch."), kv_cache_dtype="fp8_ds_mla", backend=backend,
               max_model_len=1024, max_num_seqs=max(batches) * (max(ks) + 1),
               kv_cache_memory=(4 << 30) if device == "cuda" else 512 << 20, enable_prefix_caching=False, device=device)
    g = torch.Generator().manual_seed(0)
    res: dict = {"acceptance": acceptance, "device": device, "method": method}
    eng = LLMEngine(EngineConfig(**cfg))  # the decode engine loads the model the others share
    model, tok = eng.model, eng.tokenizer
    for k in [0] + ks:
        if k:
            eng = None
            eng = LLMEngine(EngineConfig(**cfg, speculative_config={"method": method, "num_speculative_tokens": k}),
                            model=model, tokenizer=tok)
        for B in batches:
            built = compiles.count()
            replays = eng.spec_graphs.replays if eng.spec_graphs is not None else 0
            res[f"step_ms_b{B}_k{k}"], res[f"replay_ms_b{B}_k{k}"] = verify_step_ms(eng, B, g, sync, steps,
                                                                                   profile=profile and k > 0)
            res[f"kernels_built_b{B}_k{k}"] = compiles.count() - built  # in the timed steps' path: must be 0
            if eng.spec_graphs is not None:  # steps run as one graph replay (the others eagerly)
                res[f"graph_steps_b{B}_k{k}"] = eng.spec_graphs.replays - replays
            rp = res[f"replay_ms_b{B}_k{k}"]
            print(f"k={k} batch {B}: {res[f'step_ms_b{B}_k{k}']:.2f} ms/step, graph replay "
                  f"{'-' if rp is None else f'{rp:.2f} ms'} "
                  f"({res[f'kernels_built_b{B}_k{k}']} kernels built, "
                  f"{res.get(f'graph_steps_b{B}_k{k}', 0)} graph steps)", flush=True)
        if k == 0:  # the verify forward's floor: a decode graph over as many rows
            for n in sorted({B * (j + 1) for B in batches for j in ks}):
                res[f"decode_rows_ms_{n}"] = _rows_replay_ms(eng, n, g, sync, steps)
    for k in ks:
        tokens = sum(acceptance ** i for i in range(k + 1))
        for B in batches:
            ratio = res[f"step_ms_b{B}_k{k}"] / res[f"step_ms_b{B}_k0"]
            res[f"speedup_b{B}_k{k}"] = tokens / ratio
    return res


def format_verify(res: dict, batches: list[int], ks: list[int]) -> str:
    """One row per batch and k: the step times, their ratio, the implied speedup, and the device time
    of each step's graph alone (replayed back to back: what is left is the host's)."""
    def ms(key):
        v = res.get(key)
        return "-" if v is None else f"{v:.2f}"

    lines = [f"speculative step ({res.get('method', 'mtp')}) vs one-token decode ({res['device']}; speedup at "
             f"{res['acceptance']} per position)",
             f"{'batch':>5} {'k':>2} {'decode ms':>10} {'verify ms':>10} {'ratio':>6} {'tokens/step':>11} "
             f"{'speedup':>7} {'decode graph':>12} {'spec graph':>10} {'decode graph B(k+1) rows':>24}"]
    for B in batches:
        for k in ks:
            d, v = res[f"step_ms_b{B}_k0"], res[f"step_ms_b{B}_k{k}"]
            tokens = sum(res["acceptance"] ** i for i in range(k + 1))
            lines.append(f"{B:>5} {k:>2} {d:>10.2f} {v:>10.2f} {v / d:>6.2f} {tokens:>11.2f} "
                         f"{res[f'speedup_b{B}_k{k}']:>7.2f} {ms(f'replay_ms_b{B}_k0'):>12} "
                         f"{ms(f'replay_ms_b{B}_k{k}'):>10} {ms(f'decode_rows_ms_{B * (k + 1)}'):>24}")
    return "\n".join(lines)


def bench_transformers(ckpt: str, batches: list[int], prefill_lens: list[int]) -> dict:
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    res: dict = {}
    qc = FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0", expert_dtype="fp4")
    model = DeepseekV4ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, quantization_config=qc,
                                                  device_map="cuda").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for B in batches:
            ids = torch.randint(3, 120000, (B, 32), generator=g).cuda()
            try:
                out = model(ids, use_cache=True)
                pkv = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(3):
                    out = model(tok, past_key_values=pkv, use_cache=True)
                    pkv, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                steps = 10
                t = time.perf_counter()
                for _ in range(steps):
                    out = model(tok, past_key_values=pkv, use_cache=True)
                    pkv, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                res[f"decode_ms_b{B}"] = (time.perf_counter() - t) / steps * 1e3
            except torch.OutOfMemoryError:
                res[f"decode_ms_b{B}"] = None
            pkv = None  # freed (a timed closure above refers to them)
            torch.cuda.empty_cache()
        for L in prefill_lens:
            ids = torch.randint(3, 120000, (1, L), generator=g).cuda()
            try:
                for rep in range(2):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    model(ids, use_cache=True, logits_to_keep=1)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t
                res[f"prefill_tok_s_{L}"] = L / dt
            except torch.OutOfMemoryError:
                res[f"prefill_tok_s_{L}"] = None
            torch.cuda.empty_cache()
    model = None  # freed (a timed closure above refers to them)
    torch.cuda.empty_cache()
    return res


def set_constant(item: str):
    """One ``MODULE.NAME=JSON`` (a module attribute) or ``MODULE.NAME[KEY]=JSON`` (an existing key of a
    module-level dict, e.g. a kernel's CONFIG) item applied: (label, value, restore). The name and the
    key must exist already (a typo is an error, not a silent new attribute)."""
    import importlib

    target, sep, value = item.partition("=")
    key = None
    if target.endswith("]") and "[" in target:
        target, _, key = target[:-1].partition("[")
    module, _, name = target.rpartition(".")
    if not sep or not module or not name or key == "":
        raise SystemExit(f"--set {item!r}: expected MODULE.NAME=JSON or MODULE.NAME[KEY]=JSON")
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise SystemExit(f"--set {item!r}: {module} has no attribute {name}")
    val = json.loads(value)
    if key is None:
        old = getattr(mod, name)
        setattr(mod, name, val)
        return target, val, lambda: setattr(mod, name, old)
    table = getattr(mod, name)
    if not isinstance(table, dict) or key not in table:
        raise SystemExit(f"--set {item!r}: {module}.{name} is not a dict with the key {key!r}")
    old = table[key]
    table[key] = val
    return f"{target}[{key}]", val, lambda: table.__setitem__(key, old)


def apply_settings(items: list[str]) -> dict:
    """``set_constant`` for every item, kept for the whole run: {label: value}."""
    return {label: val for label, val, _ in map(set_constant, items)}


def parse_arms(specs: list[str]) -> dict[str, list[str]]:
    """``--arm`` values (settings joined by '+') as {"_B1": [item, ...], "_B2": ...}; every item is checked
    (set and restored) now, so a typo fails before the checkpoint loads, not after the first arms ran."""
    arms = {}
    for i, spec in enumerate(specs, 1):
        items = [item for item in spec.split("+") if item]
        if not items:
            raise SystemExit(f"--arm {spec!r}: no MODULE.NAME=JSON setting")
        with settings_applied(items):
            pass
        arms[f"_B{i}"] = items
    return arms


@contextlib.contextmanager
def settings_applied(items: list[str]):
    """``items`` set inside the block and restored after it, last set first restored (the B arm of --ab)."""
    restores = []
    try:
        for item in items:
            restores.append(set_constant(item)[2])
        yield
    finally:
        for restore in reversed(restores):
            restore()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--make-preset", default=None, help="write this synthetic preset to --ckpt first if missing")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--variants", default="graphs,sync,eager,fastest", help="decode-path variants (see bench_dsv4)")
    ap.add_argument("--decode-prompt", type=int, default=32,
                    help="prompt tokens of each decode-step request (the context every decode step's attention reads)")
    ap.add_argument("--act-quant", action="store_true",
                    help="the engine setting act_quant: activations FP8-rounded per 128 before each FP8 GEMM")
    ap.add_argument("--long-context", type=int, default=0, help="also prefill+decode one prompt of this length")
    ap.add_argument("--long-repeat", type=int, default=1, help="prefill that many long prompts (the first compiles)")
    ap.add_argument("--long-profile", action="store_true", help="profile the last long prompt's last chunk")
    ap.add_argument("--profile-prefill", default=None,
                    help="prompt lengths whose prefill is profiled (comma-separated; default: the longest)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=JSON",
                    help="set a module constant before the engine is built (an A/B of a tuning constant in one "
                         "call), e.g. dsv4.ops.triton.sparse_attention.PREDECODE_MIN_T=2048; repeatable")
    ap.add_argument("--ab", action="append", default=[], metavar="MODULE.NAME=JSON",
                    help="the B arm: decode on an engine whose graphs were captured under these settings, and "
                         "each prefill length alternating run by run with the defaults on the same engine (keys *_B "
                         "in the JSON); repeatable, all set together")
    ap.add_argument("--arm", action="append", default=[], metavar="MODULE.NAME=JSON[+MODULE.NAME=JSON...]",
                    help="one more arm timed as the --ab arm is (settings joined by '+'), keys *_B1, *_B2, ... in "
                         "the order given; with any arm the defaults' decode is timed again last (*_A2)")
    ap.add_argument("--host-tier", type=int, default=0, metavar="TOKENS",
                    help="only the host-tier measurement, with a prompt of this many tokens (bench_host_tier)")
    ap.add_argument("--verify-method", default="mtp", choices=("mtp", "dspark"),
                    help="with --verify-k: the drafter (dspark needs a flash-0731 checkpoint)")
    ap.add_argument("--verify-profile", action="store_true",
                    help="with --verify-k: print the host functions of each speculative step by own time (cProfile)")
    ap.add_argument("--verify-k", default=None, metavar="K,K,...",
                    help="only time the speculative (MTP) step for these k against a one-token decode step at "
                         "--batches, and print the speedup implied at 0.8 per-position acceptance")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"),
                    help="where the checkpoint is made and the engine runs (cpu: only --host-tier or --verify-k, "
                         "smoke runs on a tiny checkpoint)")
    ap.add_argument("--timeline", default=None, metavar="L,L,...",
                    help="print these layers' kernels in time order in a batch-1 decode step (graphs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.device == "cpu" and not (a.host_tier or a.verify_k):
        ap.error("--device cpu runs only the --host-tier or --verify-k measurement (the others need a GPU)")
    settings = apply_settings(a.set)
    extra_arms = parse_arms(a.arm)
    batches = [int(x) for x in a.batches.split(",")]
    prefill = [int(x) for x in a.prefill.split(",")]
    if a.make_preset and not Path(a.ckpt, "config.json").exists():
        t = time.time()
        subprocess.run([sys.executable, "-m", "dsv4.cli", "make-checkpoint", "--preset", a.make_preset, "--layers",
                        str(a.layers), "--out", a.ckpt, "--device", a.device, "--quiet"], check=True, cwd=ROOT)
        print(f"made checkpoint in {time.time() - t:.0f}s", flush=True)
    if a.host_tier:
        rows = {"device": a.device, **measure_host_copies(device=a.device),
                **({"settings": settings} if settings else {})}
        print(json.dumps(rows), flush=True)
        rows["host_tier"] = bench_host_tier(a.ckpt, a.host_tier, chunk=max(prefill), device=a.device)
        h = rows["host_tier"]
        print(f"\nTTFT of {a.host_tier} tokens: cold {h['cold_s']:.2f} s, device tier {h['device_hit_s']:.3f} s, "
              f"host tier {h['host_hit_s']:.3f} s ({h['host_restored_MiB']} MiB restored; same token and logprob: "
              f"device {h['device_hit_equal']}, host {h['host_hit_equal']})")
        print(f"copies: pinned bound h2d {rows.get('pinned_h2d_GBps')} / d2h {rows.get('pinned_d2h_GBps')} GB/s; "
              "engine "
              f"restore {h['engine_in_consecutive_GBps']} (scattered {h['engine_in_scattered_GBps']}), offload "
              f"{h['engine_out_consecutive_GBps']} (scattered {h['engine_out_scattered_GBps']}) GB/s")
        if a.out:
            Path(a.out).write_text(json.dumps(rows, indent=2))
        return 0
    if a.verify_k:
        ks = [int(x) for x in a.verify_k.split(",")]
        res = bench_verify(a.ckpt, batches, ks, a.device, a.backend, a.verify_method, profile=a.verify_profile)
        print(format_verify(res, batches, ks))
        if a.out:
            Path(a.out).write_text(json.dumps({"verify": res, **({"settings": settings} if settings else {})},
                                              indent=2))
        return 0
    bw = measure_bandwidth()
    rows = {"bandwidth_TBps": bw / 1e12, **({"settings": settings} if settings else {})}
    for B in batches:
        rows[f"bound_decode_ms_b{B}"] = decode_step_bytes(a.ckpt, B) / bw * 1e3
    print(json.dumps(rows), flush=True)
    t = time.time()
    rows.update(measure_peaks())
    rows["dsv4"] = bench_dsv4(a.ckpt, batches, prefill, a.backend, a.variants.split(","), a.long_context,
                              a.long_repeat, a.long_profile,
                              [int(x) for x in a.profile_prefill.split(",")] if a.profile_prefill else None, a.ab,
                              a.decode_prompt, a.act_quant,
                              [int(x) for x in a.timeline.split(",")] if a.timeline else None, extra_arms)
    arms = rows["dsv4"]["arms"]
    for L in prefill:
        fl = prefill_flops(a.ckpt, L)
        rows[f"prefill_{L}_TFLOP"] = fl / 1e12
        for arm in arms:
            rows[f"prefill_{L}_frac_of_bf16_peak{arm}"] = (fl / (L / rows["dsv4"][f"prefill_tok_s_{L}{arm}"])
                                                          / rows["bf16_peak_flops"])
    print("dsv4", json.dumps(rows["dsv4"]), f"({time.time() - t:.0f}s)", flush=True)
    if not a.skip_transformers:
        t = time.time()
        try:
            rows["transformers"] = bench_transformers(a.ckpt, batches, prefill)
        except Exception as e:  # the peer failing must not hide our numbers
            rows["transformers"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print("transformers", json.dumps(rows["transformers"]), f"({time.time() - t:.0f}s)", flush=True)
    print(f"\n{'metric':24s} {'dsv4':>12s} {'transformers':>14s} {'bound':>10s}")
    for B in batches:
        k = f"decode_ms_b{B}"
        hf = rows.get("transformers", {}).get(k)
        print(f"{k:24s} {rows['dsv4'][k]:12.2f} {hf if hf is None else round(hf, 2)!s:>14s} "
              f"{rows[f'bound_decode_ms_b{B}']:10.3f}")
        for arm, items in arms.items():
            if arm:
                print(f"{k + arm:24s} {rows['dsv4'][k + arm]:12.2f}  {' '.join(items)}")
        if len(arms) > 1:
            print(f"{k + '_A2':24s} {rows['dsv4'][k + '_A2']:12.2f}  (the defaults again, last)")
    for L in prefill:
        k = f"prefill_tok_s_{L}"
        hf = rows.get("transformers", {}).get(k)
        print(f"{k:24s} {rows['dsv4'][k]:12.0f} {hf if hf is None else round(hf)!s:>14s} {'':>10s}")
        for arm in arms:
            if arm:
                print(f"{k + arm:24s} {rows['dsv4'][k + arm]:12.0f}")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
