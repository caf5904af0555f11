"""Planted faults on candidate canaries, per task: which checkpoint still detects every fault?

Runs the engine (torch backend, CPU, one thread) on the first 16 mul, 16 copy and 8 recall
held-out examples of each model directory: healthy (`fp8_ds_mla`, FNUZ records), FNUZ records read
as OCP, and the SwiGLU clamp removed — the faults and engine settings of
`tests/canary/test_canary_accuracy.py` (from `tests/canary/canary_helpers.py`), whose bound is a
quarter of the healthy correct answers. Used to choose a canary before it replaces
`dsv4/assets/canary` (docs/canary.md, runs 11–12).

    python bench/canary_faults.py out/r11/canary_b out/r12/canary_12b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "canary")]

import torch  # noqa: E402

import dsv4.cache.paged as paged  # noqa: E402
import dsv4.model.moe as moe  # noqa: E402
from canary_helpers import fnuz_read_as_ocp, llm, subset, swiglu_without_clamp  # noqa: E402
from dsv4.canary.eval import evaluate_engine  # noqa: E402
from dsv4.canary.tasks import heldout  # noqa: E402

COUNTS = {"mul": 16, "copy": 16, "recall": 8}  # test_canary_accuracy.FAULT


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    examples = subset(heldout(32, recall_per_task=24), COUNTS)
    true_read, true_swiglu = paged.read_kv, moe.swiglu
    for model in a.models:
        res = {"healthy": evaluate_engine(model, examples, llm=llm(model, "fp8_ds_mla", "fnuz"))["correct"]}
        try:
            paged.read_kv = fnuz_read_as_ocp(true_read)
            res["fnuz_as_ocp"] = evaluate_engine(model, examples, llm=llm(model, "fp8_ds_mla", "fnuz"))["correct"]
        finally:
            paged.read_kv = true_read
        try:
            moe.swiglu = swiglu_without_clamp()
            res["no_clamp"] = evaluate_engine(model, examples, llm=llm(model, "auto"))["correct"]
        finally:
            moe.swiglu = true_swiglu
        healthy = sum(res["healthy"].values())
        print(model, {k: f"{sum(v.values())} {dict(v)}" for k, v in res.items()}, f"bound {healthy / 4:.2f}", flush=True)


if __name__ == "__main__":
    main()
