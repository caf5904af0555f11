"""End-to-end benchmark on one GPU: dsv4 vs transformers vs the HBM bound, on one checkpoint.

Run on the H200 (see docs/perf.md for the command that produced the table there):

    python bench/e2e.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4 --out $OUT/e2e.json

Measures, for the same `flash-width` checkpoint (real widths, CSA/HCA layers):
- decode ms/step at batch 1, 8, 64 through the dsv4 engine (steady-state decode steps only);
- prefill tok/s at 1K and 8K tokens (one request, one chunk);
- the same figures for transformers' DeepseekV4ForCausalLM (bf16, eager, dequantized weights);
- the HBM bound of one decode step: the bytes it must read in the checkpoint's own formats
  (all non-expert weights of the layers, the active routed experts, the head) / measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
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
    del a, b
    return 2 * n / dt  # bytes read + written per second


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


def bench_dsv4(ckpt: str, batches: list[int], prefill_lens: list[int], backend: str) -> dict:
    from dsv4 import LLM, SamplingParams

    res: dict = {}
    max_len = max(prefill_lens) + 64
    llm = LLM(ckpt, dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", max_model_len=max_len, max_num_seqs=max(batches),
              max_num_batched_tokens=max(prefill_lens), kv_cache_memory=24 << 30, enable_prefix_caching=False,
              backend=backend)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for B in batches:
        for i in range(B):
            eng.add_request(prompt_token_ids=torch.randint(3, 120000, (32,), generator=g).tolist(),
                            params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        eng.step()  # prefill of all B prompts
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
        steps = 20
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        res[f"decode_ms_b{B}"] = (time.perf_counter() - t) / steps * 1e3
        while eng.has_unfinished_requests():
            eng.step()
    for L in prefill_lens:
        ids = torch.randint(3, 120000, (L,), generator=g).tolist()
        for rep in range(2):  # first run warms up kernels for this shape
            eng.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=1))
            torch.cuda.synchronize()
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
        res[f"prefill_tok_s_{L}"] = L / dt
    return res


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
            del pkv
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
    del model
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--make-preset", default=None, help="write this synthetic preset to --ckpt first if missing")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    prefill = [int(x) for x in a.prefill.split(",")]
    if a.make_preset and not Path(a.ckpt, "config.json").exists():
        t = time.time()
        subprocess.run([sys.executable, "-m", "dsv4.cli", "make-checkpoint", "--preset", a.make_preset, "--layers",
                        str(a.layers), "--out", a.ckpt, "--device", "cuda", "--quiet"], check=True, cwd=ROOT)
        print(f"made checkpoint in {time.time() - t:.0f}s", flush=True)
    bw = measure_bandwidth()
    rows = {"bandwidth_TBps": bw / 1e12}
    for B in batches:
        rows[f"bound_decode_ms_b{B}"] = decode_step_bytes(a.ckpt, B) / bw * 1e3
    print(json.dumps(rows), flush=True)
    t = time.time()
    rows["dsv4"] = bench_dsv4(a.ckpt, batches, prefill, a.backend)
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
    for L in prefill:
        k = f"prefill_tok_s_{L}"
        hf = rows.get("transformers", {}).get(k)
        print(f"{k:24s} {rows['dsv4'][k]:12.0f} {hf if hf is None else round(hf)!s:>14s} {'':>10s}")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
