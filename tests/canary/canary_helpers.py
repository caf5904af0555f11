"""Helpers shared by tests/canary (imported by its conftest and test files) and
bench/canary_faults.py: held-out subsets, recorded accuracy, the engine settings and the planted
faults of test_canary_accuracy.py."""

from __future__ import annotations

import torch.nn.functional as F


def subset(held, counts: dict[str, int]):
    """The first ``counts[task]`` held-out examples of each task (in the recorded order)."""
    out = []
    for task, n in counts.items():
        out += [e for e in held if e.task == task][:n]
    return out


def recorded_on(info: dict, key: str, counts: dict[str, int]) -> dict[str, float]:
    """Recorded accuracy of ``key`` (e.g. 'checkpoint/auto') on the same first-n examples per task."""
    masks = info["correct"][key]
    return {t: masks[t][:n].count("1") / n for t, n in counts.items()}


def llm(canary_dir, kv_cache_dtype: str, fp8_format: str = "ocp"):
    """The engine the canary tests measure: torch backend, fp32, CPU-sized caches."""
    from dsv4.llm import LLM

    return LLM(canary_dir, backend="torch", dtype="float32", kv_cache_dtype=kv_cache_dtype, fp8_format=fp8_format,
               kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=32,
               max_num_batched_tokens=2048, enable_prefix_caching=False)


def fnuz_read_as_ocp(true_read):
    """Fault (b): a ``paged.read_kv`` that decodes the KV bytes in the other FP8 flavour."""
    from dsv4.formats import FNUZ, OCP, get_fp8_format

    def other_format(pages, block_ids, offsets, fmt, block_size):
        wrong = OCP if get_fp8_format(fmt).name == "fnuz" else FNUZ
        return true_read(pages, block_ids, offsets, wrong, block_size)

    return other_format


def swiglu_without_clamp(seen: dict | None = None):
    """Fault (c): ``moe.swiglu`` without its clamp (what an op set built after the patch binds as its
    ``swiglu``); counts into ``seen`` ({"n", "over"}) how many gate/up values the clamp would have cut."""

    def swiglu(ops, x, w1, w3, w2, limit, act_quant=False):
        linear = ops.linear
        gate = linear(x, w1, act_quant).float()
        up = linear(x, w3, act_quant).float()
        if seen is not None:
            seen["n"] += 2 * gate.numel()
            seen["over"] += int((gate > limit).sum()) + int((up.abs() > limit).sum())
        return linear((F.silu(gate.double()) * up.double()).to(x.dtype), w2, act_quant)

    return swiglu
