"""CPU benchmark of the serving engine: prefill and decode throughput per batch size.

    python bench/engine_cpu.py [--model DIR] [--batch-sizes 1,8,32] [--prompt-len 64] [--max-tokens 32]
                               [--kv-cache-dtype auto|fp8_ds_mla] [--threads N]

Without ``--model`` a tiny synthetic checkpoint is written to a temporary directory first. For each
batch size, B random prompts of ``--prompt-len`` tokens are added at once and decoded greedily
(``ignore_eos``) for ``--max-tokens`` tokens. The budget of batched tokens is at least
B × prompt-len, so the prefill is one step, which also samples every request's first token:

* prefill tok/s = prompt tokens / time of the steps until every request has its first token;
* decode tok/s  = output tokens produced after that / time of the remaining (decode) steps;
* total         = wall time of the whole batch, prefill and decode.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--batch-sizes must be comma-separated integers, got {text!r}")
    if not sizes or any(b < 1 for b in sizes):
        raise SystemExit(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def run_batch(llm, batch: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    import torch

    from dsv4.engine.sampling_params import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 129000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    reqs = [engine.requests[r][0] for r in ids]
    steps = 0
    while not all(r.output_token_ids for r in reqs):
        engine.step()
        steps += 1
    t1 = time.perf_counter()
    first = sum(len(r.output_token_ids) for r in reqs)
    done = engine.run_to_completion(ids)
    t2 = time.perf_counter()
    out_tokens = sum(len(done[r].outputs[0].token_ids) for r in ids)
    assert out_tokens == batch * max_tokens, "a request stopped early"
    assert not engine.kv.leaks()
    decode_tokens = out_tokens - first
    return {
        "batch": batch, "prompt_tokens": batch * prompt_len, "prefill_steps": steps, "prefill_s": t1 - t0,
        "prefill_tps": batch * prompt_len / (t1 - t0), "decode_tokens": decode_tokens, "decode_s": t2 - t1,
        "decode_tps": decode_tokens / (t2 - t1) if t2 > t1 else float("nan"), "total_s": t2 - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a temporary tiny checkpoint)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_ds_mla", "fp8"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    sizes = _parse_sizes(a.batch_sizes)
    if a.prompt_len < 1 or a.max_tokens < 2:
        raise SystemExit("--prompt-len must be ≥ 1 and --max-tokens ≥ 2 (one prefill token plus decode)")

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from dsv4.llm import LLM

    tmp = None
    model = a.model
    t_start = time.perf_counter()
    if model is None:
        from dsv4.checkpoint.synthetic import write_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="dsv4-bench-")
        t = time.perf_counter()
        model = str(write_checkpoint(tmp.name, preset="tiny", progress=False))
        print(f"wrote a tiny checkpoint to {model} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    try:
        max_b = max(sizes)
        max_len = -(-(a.prompt_len + a.max_tokens) // 256) * 256
        llm = LLM(model, kv_cache_dtype=a.kv_cache_dtype, max_model_len=max_len, max_num_seqs=max_b,
                  max_num_batched_tokens=max(2048, max_b * a.prompt_len), enable_prefix_caching=False,
                  kv_cache_memory=None)
        run_batch(llm, 1, min(a.prompt_len, 16), 2, a.seed + 999)  # warm-up: first-call overheads
        rows = [run_batch(llm, b, a.prompt_len, a.max_tokens, a.seed + i) for i, b in enumerate(sizes)]
    finally:
        if tmp is not None:
            tmp.cleanup()

    print(f"dsv4 engine on CPU: torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{os.cpu_count()} CPUs, kv cache {a.kv_cache_dtype}, model {a.model or 'tiny (synthetic)'}, "
          f"prompt {a.prompt_len} tokens, {a.max_tokens} new tokens per request")
    head = ["batch", "prompt tok", "prefill s", "prefill tok/s", "decode tok", "decode s", "decode tok/s", "total s"]
    table = [[str(r["batch"]), str(r["prompt_tokens"]), f"{r['prefill_s']:.2f}", f"{r['prefill_tps']:.1f}",
              str(r["decode_tokens"]), f"{r['decode_s']:.2f}", f"{r['decode_tps']:.1f}", f"{r['total_s']:.2f}"]
             for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for row in table:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
    print(f"wall time of the whole benchmark: {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
