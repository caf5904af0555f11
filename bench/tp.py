"""Multi-GPU layouts against one GPU: equality with TP=1, the probe, speed, KV capacity, collective share.

The multi-GPU run, on a machine with ≥ 2 H200s:

    python bench/tp.py --ckpt /tmp/fw4 --layers 4 --out $OUT/tp.json

1. writes (or reuses) a ``flash-width`` checkpoint with ``--layers`` layers — small enough that
   TP=1 fits one GPU, so the parallel runs have a single-GPU reference;
2. for every layout — TP=1, TP=N (with and without async scheduling), TP=N + expert parallel, and
   data-parallel attention with expert
   parallelism over ``--dp`` ranks (DP=M + EP, with decode graphs and eager; each in its own
   process): greedy tokens of fixed
   prompts with their top-2 logprobs; decode ms/step at batch 1 / 8 / 64 (steady-state decode
   steps only; under DP the batch is spread over the ranks, and at batch 1 one rank runs dummy
   forwards); prefill tok/s at 8K (one 8K prompt, or one per rank under DP: every rank computes);
   the KV cache capacity in tokens (all ranks' together: replicated under TP, added up under DP);
   and the share of a decode step rank 0 spends in collectives (a second pass with every collective
   synchronised and timed, which runs the decode steps eagerly: the all-reduces under TP, the MoE
   all-to-alls under DP);
3. compares the parallel runs' greedy tokens with TP=1: a divergence is reported with TP=1's
   top-1/top-2 margin there (bf16 partial sums are rounded in another order than TP=1, so a near
   tie may flip; the ``*_f32`` configurations make the comparison tight);
4. runs ``dsv4 probe`` at TP=N, and at each TP of ``--probe-tps`` (oracle: a separately loaded
   single-GPU torch model; TP=1 shows how far the engine itself is from the oracle);
5. prints a table and writes JSON.

Every process (this one, the per-config children, their worker ranks, the probe) runs with
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (no NVLink
multicast on the lent machines).

``--cpu`` is the smoke test for a machine without GPUs: the tiny checkpoint, gloo, float32 and
``kv_cache_dtype=auto``, small batches and a 512-token prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # before torch is imported; inherited by every child process

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N_PROMPTS, PROMPT_LENS = 4, (16, 200, 700, 1500)


F32 = "_f32"  # suffix of the greedy-only float32 configurations


def _configs(tp: int, f32_backend: str = "auto", dp: int = 2, tp_dp: bool = False) -> list[tuple[str, dict]]:
    """TP=1, TP=1 eager, TP=N (async scheduling, the CUDA default; also on ``--cpu``), TP=N without
    async scheduling, TP=N + expert parallel, DP=M + EP and DP=M + EP eager, with ``tp_dp`` TP=N
    inside DP=M ranks + EP over all N×M processes (decode
    replays CUDA graphs on every rank unless eager; under DP all ranks replay one agreed bucket,
    dsv4/parallel/dp_graphs.py); then each but the eager ones in float32 for greedy tokens only.
    bf16 rounds each rank's partial sum before the all-reduce adds it (TP=1 rounds once; under EP
    each expert's output is rounded before its rank adds it up), so on a random-weight model whose
    bf16 logits often tie exactly, bf16 greedy tokens may part at a near-tie; in float32 the
    layouts differ only in fp32 summation order."""
    layouts = [("tp1", {"tensor_parallel_size": 1}), ("tp1_eager", {"tensor_parallel_size": 1, "enforce_eager": True}),
               (f"tp{tp}", {"tensor_parallel_size": tp, "async_scheduling": True}),
               (f"tp{tp}_sync", {"tensor_parallel_size": tp, "async_scheduling": False}),
               (f"tp{tp}_ep", {"tensor_parallel_size": tp, "enable_expert_parallel": True})]
    if dp > 1:
        dpx = {"data_parallel_size": dp, "enable_expert_parallel": True}
        layouts += [(f"dp{dp}_ep", dpx), (f"dp{dp}_ep_eager", {**dpx, "enforce_eager": True})]
        if tp_dp and tp > 1:
            layouts.append((f"tp{tp}_dp{dp}_ep", {**dpx, "tensor_parallel_size": tp}))
    f32 = [(name + F32, {**extra, "enforce_eager": True, "dtype": "float32", "backend": f32_backend})
           for name, extra in layouts if not name.endswith(("_eager", "_sync"))]
    return layouts + f32


def _process(s: dict) -> str:
    """A startup report's process, where it is not the rank (TP inside DP: several per rank)."""
    return "" if s.get("process", s["rank"]) == s["rank"] else f" (process {s['process']})"


def _tp_dp(a) -> bool:
    if a.tp_dp != "auto":
        return a.tp_dp == "on"
    import torch

    return a.cpu or torch.cuda.device_count() >= a.tp * a.dp


def _engine_kwargs(a, extra: dict) -> dict:
    kw = dict(dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, max_model_len=a.max_model_len,
              max_num_seqs=max(a.batches), max_num_batched_tokens=max(a.prefill_len, 2048), seed=0,
              enable_prefix_caching=False)  # every timed prefill computes all its tokens
    kw.update(extra)
    if a.cpu:
        kw.update(device="cpu", kv_cache_memory=a.kv_cache_mib << 20)
    elif a.kv_cache_mib:
        kw["kv_cache_memory"] = a.kv_cache_mib << 20
    return kw


def _prompts(n: int, lens, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


# ---- one configuration (a child process) -----------------------------------------------------------
def _greedy(llm, a) -> list[dict]:
    from dsv4 import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    lens = PROMPT_LENS if not a.cpu else (7, 150, 300)
    sp = SamplingParams(temperature=0, max_tokens=a.greedy_tokens, ignore_eos=True, logprobs=2)
    out = []
    for o in llm.generate(_prompts(len(lens), lens, vocab, seed=1), sp):
        c = o.outputs[0]
        margins = []
        for d in c.logprobs or []:
            lp = sorted((v.logprob for v in d.values()), reverse=True)
            margins.append(lp[0] - lp[1] if len(lp) > 1 else None)
        out.append({"prompt_len": len(o.prompt_token_ids), "tokens": c.token_ids, "margins": margins})
    return out


def _parts(engine):
    """(rank 0's device, every rank's startup report or None, rank 0's collective timer or None) of
    an engine of any layout: one process, a tensor-parallel driver, or a data-parallel front end."""
    if hasattr(engine, "engine0"):  # DPEngine
        return engine.device, engine.startup_reports, engine.engine0.executor.ep
    ex = engine.executor
    multi = not ex.one_process
    return engine.model.device, (ex.rank_stats if multi else None), (ex.tp if multi else None)


def _ranks(engine) -> int:
    return engine.config.data_parallel_size


def _graph_replays(engine) -> list[int] | None:
    """Every data-parallel rank's decode-graph replays so far (None without DP)."""
    stats = getattr(engine, "rank_stats", None)
    return None if stats is None else [s.get("graph_replays", 0) for s in stats]


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _decode(engine, batch: int, prompt_len: int, steps: int, tp) -> dict:
    """Steady-state decode of ``batch`` requests: ms/step, then the same with rank 0's collectives
    timed (``tp``: its ``CommTimer``, the tensor-parallel group or the data-parallel EP group)."""
    from dsv4 import SamplingParams

    warm = 3
    sp = SamplingParams(temperature=0, max_tokens=warm + 2 * steps + 2, ignore_eos=True)
    rids = [engine.add_request(prompt_token_ids=p, params=sp)
            for p in _prompts(batch, (prompt_len,), engine.model_config.vocab_size, seed=2)]
    started: set[str] = set()
    while len(started) < len(rids):  # prefill (chunked as the scheduler likes) until each has a token
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(warm):
        engine.step()
    dev = _parts(engine)[0]
    replays = _graph_replays(engine)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(dev)
    ms = (time.perf_counter() - t0) / steps * 1e3
    res = {"batch": batch, "ms_per_step": round(ms, 3)}
    if replays is not None:  # DP: the timed steps' graph replays on each rank (0 when eager)
        res["graph_replays"] = [b - a for a, b in zip(replays, _graph_replays(engine))]
    if tp is not None:
        tp.comm_s, tp.comm_calls, tp.timed = 0.0, 0, True
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(dev)
        total = time.perf_counter() - t0
        tp.timed = False
        # the timed pass runs eagerly (a collective inside a CUDA graph cannot be timed): comm_share
        # is the share of that eager step; comm_vs_step puts the same collective time against the
        # untimed (graph) step, an upper bound since a synced collective also waits for the slower rank
        comm_ms = tp.comm_s / steps * 1e3
        res.update(timed_ms_per_step=round(total / steps * 1e3, 3), comm_ms_per_step=round(comm_ms, 3),
                   comm_share=round(tp.comm_s / total, 4), comm_vs_step=round(comm_ms / ms, 4),
                   collectives_per_step=tp.comm_calls // steps)
    for r in rids:
        engine.abort_request(r)
    return res


def _prefill(engine, n: int, seed: int = 3) -> dict:
    """One ``n``-token prompt per data-parallel rank (one in all without DP), to its first token."""
    from dsv4 import SamplingParams

    k = _ranks(engine)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rids = [engine.add_request(prompt_token_ids=ids, params=sp)
            for ids in _prompts(k, (n,), engine.model_config.vocab_size, seed=seed)]
    dev = _parts(engine)[0]
    _sync(dev)
    t0 = time.perf_counter()
    while any(r in engine.requests for r in rids):
        engine.step()
    _sync(dev)
    dt = time.perf_counter() - t0
    return {"tokens": n, "prompts": k, "seconds": round(dt, 3), "tok_per_s": round(k * n / dt, 1)}


def run_one(a, name: str, extra: dict, save) -> dict:
    """One configuration; ``save(res)`` after every stage, so a run cut short still reports."""
    from dsv4 import LLM
    from dsv4.parallel.group import peak_memory

    t0 = time.perf_counter()
    llm = LLM(a.ckpt, **_engine_kwargs(a, extra))
    eng = llm.engine
    dev, ranks, timer = _parts(eng)
    res = {"config": name, **extra, "init_s": round(time.perf_counter() - t0, 1),
           "kv_tokens": eng.kv_cache.budget.capacity_tokens}  # under DP: every rank's cache, added up
    if ranks is not None:
        res["ranks"] = ranks
    res["rank0_after_init"] = peak_memory(dev)  # weights + KV cache (TP=1: the whole model)
    print(f"[{name}] init {res['init_s']} s, rank 0 {res['rank0_after_init']}", flush=True)
    save(res)
    try:
        res["greedy"] = _greedy(llm, a)
        save(res)
        if name.endswith(F32):  # greedy tokens only
            return res
        # warm-up at the timed length (other tokens): Triton compiles a kernel per new shape class,
        # and NCCL sets up its first collectives; neither belongs in the timed prefill
        _prefill(eng, a.prefill_len, seed=4)
        res["prefill"] = _prefill(eng, a.prefill_len)
        print(f"[{name}] prefill {res['prefill']}", flush=True)
        save(res)
        res["decode"] = []
        for b in a.batches:
            res["decode"].append(_decode(eng, b, a.decode_prompt_len, a.steps, timer))
            print(f"[{name}] decode {res['decode'][-1]}", flush=True)
            save(res)
    finally:
        t1 = time.perf_counter()
        llm.shutdown()
        print(f"[{name}] shutdown {time.perf_counter() - t1:.1f} s", flush=True)
    return res


# ---- the driver -------------------------------------------------------------------------------------
def ensure_checkpoint(a) -> str:
    from dsv4.checkpoint.reader import INDEX_FILE

    preset = "tiny" if a.cpu else "flash-width"
    path = Path(a.ckpt or f"/tmp/dsv4_tp_gpu/{preset}-L{a.layers}")
    if not (path / INDEX_FILE).exists():  # written last: a checkpoint cut short is rewritten
        print(f"writing a {preset} checkpoint with {a.layers} layers to {path}", flush=True)
        t0 = time.perf_counter()
        # in a child process: memory this process held on GPU 0 would shrink every engine's budget there
        subprocess.run([sys.executable, "-m", "dsv4.cli", "make-checkpoint", "--preset", preset, "--layers",
                        str(a.layers), "--out", str(path), "--device", "cpu" if a.cpu else "cuda", "--quiet"],
                       check=True)
        gib = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30
        print(f"wrote {gib:.1f} GiB in {time.perf_counter() - t0:.0f} s", flush=True)
    return str(path)


def compare(ref: list[dict], got: list[dict]) -> list[dict]:
    out = []
    for r, g in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(r["tokens"], g["tokens"])) if x != y), None)
        row = {"prompt_len": r["prompt_len"], "equal": n is None and len(r["tokens"]) == len(g["tokens"])}
        if n is not None:
            row.update(first_divergence=n, tp1_top2_margin=r["margins"][n] if n < len(r["margins"]) else None)
        out.append(row)
    return out


def run_probe(a, spec: str, out_dir: Path) -> dict:
    """``spec`` is ``TP`` or ``TP:dtype`` (float32: the logits are not rounded to bf16, so the
    reference-agreement tolerances bound the drift alone)."""
    tp_s, _, dtype = spec.partition(":")
    tp, dtype = int(tp_s), dtype or a.dtype
    report = out_dir / f"probe_tp{tp}_{dtype}.json"
    cmd = [sys.executable, "-m", "dsv4.cli", "probe", "--model", a.ckpt, "--tp", str(tp), "--oracle", "torch",
           "--dtype", dtype, "--kv-cache-dtype", a.kv_cache_dtype, "--max-model-len", str(min(a.max_model_len, 4096)),
           "--json-report", str(report)]
    if dtype == "float32":
        cmd += ["--backend", a.f32_backend]
    if a.cpu:
        cmd += ["--max-tokens", "4", "--batch-sizes", "1,2", "--repeats", "1", "--kv-cache-memory", str(a.kv_cache_mib)]
    else:
        # the oracle is a second model on GPU 0: the engine's KV cache must leave room for it
        cmd += ["--max-tokens", "12", "--batch-sizes", "1,8", "--repeats", "2", "--kv-cache-memory", "8192"]
    t0 = time.perf_counter()
    # its own process group: on a timeout its worker ranks are killed too (they hold GPU memory)
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, code = child.communicate(timeout=a.probe_timeout)[0], child.returncode
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, code = child.communicate()[0], f"timeout after {a.probe_timeout} s"
    res = {"tp": tp, "dtype": dtype, "exit_code": code, "seconds": round(time.perf_counter() - t0, 1),
           "tail": (out or "")[-3000:]}
    if report.exists():
        rep = json.loads(report.read_text())
        res["verdict"] = rep.get("verdict")
    return res


def table(results: list[dict], checks: dict, batches: list[int], ref_name: str) -> str:
    lines = []
    head = (
        ["config", "init s", "KV tokens", "prefill tok/s"]
        + [f"decode b{b} ms" for b in batches]
        + [f"comm share b{b}" for b in batches]
        + [f"greedy = {ref_name}"]
    )
    lines.append(" | ".join(head))
    lines.append(" | ".join("---" for _ in head))
    for r in results:
        c = checks.get(r["config"])
        eq = (
            "ref"
            if r["config"] in (ref_name, ref_name + F32)
            else "-"
            if c is None
            else "yes"
            if all(x["equal"] for x in c)
            else "NO: "
            + ", ".join(
                f"p{x['prompt_len']}@{x['first_divergence']} (margin {x['tp1_top2_margin']})"
                for x in c
                if not x["equal"]
            )
        )
        dec = {d["batch"]: d for d in r.get("decode", [])}
        row = [r["config"], str(r["init_s"]), str(r.get("kv_tokens", "-")),
               str(r["prefill"]["tok_per_s"]) if "prefill" in r else "-"]
        row += [str(dec[b]["ms_per_step"]) if b in dec else "-" for b in batches]
        row += [f"{100 * dec[b]['comm_share']:.1f}%" if "comm_share" in dec.get(b, {}) else "-" for b in batches]
        lines.append(" | ".join(row + [eq]))
    for r in results:
        m = r["rank0_after_init"]
        dev = "" if m["device_peak_mib"] is None else f", device peak {m['device_peak_mib']:.0f} MiB"
        lines.append(
            f"{r['config']} rank 0 after engine init (weights + KV cache): host peak {m['host_peak_mib']:.0f} MiB{dev}"
        )
        for s in r.get("ranks", []):
            dev = "" if s["device_peak_mib"] is None else f", device peak {s['device_peak_mib']:.0f} MiB"
            dp = "" if "kv_tokens" not in s else f", weights {s['weights_mib']:.0f} MiB, KV {s['kv_tokens']} tokens"
            lines.append(
                f"{r['config']} rank {s['rank']}{_process(s)}: loaded in {s['load_s']} s{dp}, "
                f"host peak {s['host_peak_mib']:.0f} MiB{dev}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", default=None, help="checkpoint directory (written if missing)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the parallel runs")
    p.add_argument("--dp", type=int, default=2, help="data-parallel size of the DP + EP run (1: none)")
    p.add_argument("--tp-dp", choices=("auto", "on", "off"), default="auto",
                   help="also run TP=--tp inside DP=--dp ranks (tp×dp GPUs; auto: when that many are visible or --cpu)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (GPU), float32 (--cpu)")
    p.add_argument("--kv-cache-dtype", default=None, help="default: fp8_ds_mla (GPU), auto (--cpu)")
    p.add_argument("--batches", default=None, help="decode batch sizes, default 1,8,64 (GPU), 1,4 (--cpu)")
    p.add_argument("--prefill-len", type=int, default=None, help="default 8192 (GPU), 512 (--cpu)")
    p.add_argument("--decode-prompt-len", type=int, default=None, help="default 1024 (GPU), 64 (--cpu)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps, default 20 (GPU), 3 (--cpu)")
    p.add_argument("--greedy-tokens", type=int, default=None, help="default 32 (GPU), 6 (--cpu)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-mib", type=int, default=None, help="KV cache budget (default: 256 on CPU, GPU share)")
    p.add_argument("--only", default=None, help="comma-separated config names to run (tp1, tp1_eager, tpN, tpN_sync, "
                   "tpN_ep, dpM_ep, dpM_ep_eager, and each not eager nor sync with _f32)")
    p.add_argument(
        "--f32-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="backend of the float32 greedy configurations",
    )
    p.add_argument("--skip-probe", action="store_true")
    p.add_argument(
        "--probe-tps", default=None, help="comma-separated probes, each TP or TP:dtype (default: --tp at --dtype)"
    )
    p.add_argument("--probe-timeout", type=int, default=900)
    p.add_argument("--config-timeout", type=int, default=None, help="seconds allowed to one configuration")
    p.add_argument("--cpu", action="store_true", help="smoke test without GPUs: tiny checkpoint, gloo")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)  # child: one configuration
    p.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cpu = a.cpu
    a.dtype = a.dtype or ("float32" if cpu else "bfloat16")
    a.kv_cache_dtype = a.kv_cache_dtype or ("auto" if cpu else "fp8_ds_mla")
    a.batches = [int(x) for x in (a.batches or ("1,4" if cpu else "1,8,64")).split(",")]
    a.prefill_len = a.prefill_len or (512 if cpu else 8192)
    a.decode_prompt_len = a.decode_prompt_len or (64 if cpu else 1024)
    a.steps = a.steps or (3 if cpu else 20)
    a.greedy_tokens = a.greedy_tokens or (6 if cpu else 32)
    a.max_model_len = a.max_model_len or (1024 if cpu else a.prefill_len + 512)
    a.kv_cache_mib = a.kv_cache_mib or (256 if cpu else 0)

    if a.run_one:
        extra = dict(_configs(a.tp, a.f32_backend, a.dp, _tp_dp(a)))[a.run_one]
        run_one(a, a.run_one, extra, lambda res: Path(a.one_out).write_text(json.dumps(res)))
        return 0

    a.ckpt = ensure_checkpoint(a)
    out_dir = Path(a.out).parent if a.out else Path("/tmp/dsv4_tp_gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if cpu else "8")}
    results, failures = [], []
    probes: list[dict] = []

    def summarize():
        """The greedy checks against each dtype's reference and the document; written after every
        configuration and probe, so a run cut short by its caller's timeout still reports."""
        # The reference for greedy equality: TP=1 of the same dtype when it ran, else the first
        # configuration of that dtype that ran.
        families = {
            False: [r for r in results if not r["config"].endswith(F32)],
            True: [r for r in results if r["config"].endswith(F32)],
        }
        refs = {
            f32: next((r for r in rs if r["config"] in ("tp1", "tp1" + F32)), rs[0] if rs else None)
            for f32, rs in families.items()
        }
        checks = {}
        for r in results:
            fref = refs[r["config"].endswith(F32)]
            if fref is not None and r is not fref and "greedy" in r and "greedy" in fref:
                checks[r["config"]] = compare(fref["greedy"], r["greedy"])
        doc = {
            "ckpt": a.ckpt,
            "tp": a.tp,
            "dp": a.dp,
            "cpu": cpu,
            "dtype": a.dtype,
            "kv_cache_dtype": a.kv_cache_dtype,
            "env": {
                k: os.environ[k]
                for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
            },
            "results": results,
            "greedy_reference": {("float32" if k else a.dtype): v and v["config"] for k, v in refs.items()},
            "greedy_vs_reference": checks,
            "probe": probes,
            "failures": failures,
        }
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1))
        return refs[False] or refs[True], checks

    wanted = a.only.split(",") if a.only else None  # "none": probes only
    for name, _ in _configs(a.tp, a.f32_backend, a.dp, _tp_dp(a)):
        if wanted and name not in wanted:
            continue
        one = out_dir / f"tp_gpu_{name}.json"
        one.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            __file__,
            *(argv if argv is not None else sys.argv[1:]),
            "--ckpt",
            a.ckpt,
            "--run-one",
            name,
            "--one-out",
            str(one),
        ]
        print(f"== {name}", flush=True)
        child = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: a timeout kills its ranks too
        try:
            rc = child.wait(timeout=a.config_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = f"timeout after {a.config_timeout} s"
        if rc != 0:
            failures.append(f"{name}: exit code {rc}")
        if one.exists():  # partial results of a failed run are kept (the table shows what finished)
            results.append(json.loads(one.read_text()))
        summarize()
    for t in [] if a.skip_probe else (a.probe_tps or str(a.tp)).split(","):
        probes.append(run_probe(a, t, out_dir))
        summarize()
    ref, checks = summarize()
    if results and ref is not None:
        print(table(results, checks, a.batches, ref["config"]))
    for probe in probes:
        print(
            f"probe at TP={probe['tp']} {probe['dtype']}: verdict {probe.get('verdict')} "
            f"(exit code {probe['exit_code']}, {probe['seconds']} s)"
        )
    for f in failures:
        print("FAILED:", f)
    if a.out:
        print("wrote", a.out)
    ok = (
        not failures
        and all(c["equal"] for cs in checks.values() for c in cs)
        and all(pr["exit_code"] == 0 for pr in probes)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
