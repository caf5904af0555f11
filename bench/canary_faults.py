"""Planted faults on candidate canaries, per task: which checkpoint still detects every fault?

Runs the engine (torch backend, CPU, one thread) on the first 16 mul, 16 copy and 8 recall
held-out examples of each model directory: healthy (`fp8_ds_mla`, FNUZ records), FNUZ records read
as OCP, and the SwiGLU clamp removed — the faults of `tests/canary/test_canary_accuracy.py`,
whose bound is a quarter of the healthy correct answers. Used to choose a canary before it
replaces `dsv4/assets/canary` (docs/canary.md, runs 11–12).

    python bench/canary_faults.py out/r11/canary_b out/r12/canary_12b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dsv4.cache.paged as paged  # noqa: E402
import dsv4.model.moe as moe  # noqa: E402
from dsv4.canary.eval import evaluate_engine  # noqa: E402
from dsv4.canary.tasks import heldout  # noqa: E402
from dsv4.formats import FNUZ, OCP, get_fp8_format  # noqa: E402
from dsv4.model.linear import linear  # noqa: E402

COUNTS = {"mul": 16, "copy": 16, "recall": 8}


def engine(model: str, kv: str, fmt: str = "ocp"):
    from dsv4.llm import LLM

    return LLM(model, backend="torch", dtype="float32", kv_cache_dtype=kv, fp8_format=fmt,
               kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=2048,
               enable_prefix_caching=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    held = heldout(32, recall_per_task=24)
    examples = [e for t, n in COUNTS.items() for e in [x for x in held if x.task == t][:n]]
    true_read, true_swiglu = paged.read_kv, moe.swiglu

    def fnuz_as_ocp(pages, block_ids, offsets, fmt, block_size):
        wrong = OCP if get_fp8_format(fmt).name == "fnuz" else FNUZ
        return true_read(pages, block_ids, offsets, wrong, block_size)

    def no_clamp(x, w1, w3, w2, limit, act_quant=False):
        gate, up = linear(x, w1, act_quant).float(), linear(x, w3, act_quant).float()
        return linear((F.silu(gate.double()) * up.double()).to(x.dtype), w2, act_quant)

    for model in a.models:
        res = {"healthy": evaluate_engine(model, examples, llm=engine(model, "fp8_ds_mla", "fnuz"))["correct"]}
        try:
            paged.read_kv = fnuz_as_ocp
            res["fnuz_as_ocp"] = evaluate_engine(model, examples, llm=engine(model, "fp8_ds_mla", "fnuz"))["correct"]
        finally:
            paged.read_kv = true_read
        try:
            moe.swiglu = no_clamp
            res["no_clamp"] = evaluate_engine(model, examples, llm=engine(model, "auto"))["correct"]
        finally:
            moe.swiglu = true_swiglu
        healthy = sum(res["healthy"].values())
        print(model, {k: f"{sum(v.values())} {dict(v)}" for k, v in res.items()}, f"bound {healthy / 4:.2f}", flush=True)


if __name__ == "__main__":
    main()
