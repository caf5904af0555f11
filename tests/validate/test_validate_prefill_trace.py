"""``bench/prefill_trace.py``'s trace analysis on a hand-written Chrome trace: the GPU's busy union, its idle
gaps, and which host frame and runtime calls each gap and each synchronisation is charged to."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "prefill_trace", Path(__file__).resolve().parents[2] / "bench" / "prefill_trace.py")
pt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pt)


def _ev(cat, name, ts, dur):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur)


def _trace():
    return {"traceEvents": [
        _ev("python_function", "dsv4/engine/engine.py(289): step", 0, 1000),
        _ev("python_function", "dsv4/engine/runner.py(10): build", 10, 190),       # host-only work
        _ev("python_function", "dsv4/model/model.py(50): forward", 200, 700),
        _ev("python_function", "dsv4/ops/triton/moe.py(700): moe_experts", 400, 100),
        _ev("cuda_runtime", "cudaLaunchKernel", 210, 5),
        _ev("cuda_runtime", "cudaMemcpyAsync", 420, 3),
        _ev("cuda_runtime", "cudaStreamSynchronize", 430, 60),
        _ev("cuda_runtime", "cudaLaunchKernel", 600, 5),
        _ev("kernel", "k1", 220, 200),     # busy 220..420
        _ev("kernel", "k2", 400, 80),      # overlaps k1: busy until 480
        _ev("gpu_memcpy", "Memcpy DtoH", 480, 5),   # busy until 485
        _ev("kernel", "k3", 610, 290),     # gap 485..610 = 125 us; busy until 900
        _ev("kernel", "k4", 905, 10),      # gap of 5 us: a small gap
        _ev("cpu_op", "aten::empty", 5, 1),
    ]}


def test_busy_union_merges_overlaps():
    assert pt.busy_union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]


def test_analyze_gaps_and_syncs():
    rep = pt.analyze(_trace())
    assert rep["wall_ms"] == pytest.approx(0.915)  # host start 0 .. last GPU end 915
    assert rep["gpu_busy_ms"] == pytest.approx((485 - 220 + 290 + 10) / 1e3)
    assert rep["gpu_idle_ms"] == pytest.approx((915 - 565) / 1e3)
    assert rep["idle_before_first_kernel_ms"] == pytest.approx(0.22)
    assert rep["idle_in_small_gaps_ms"] == pytest.approx(0.005)
    first, second = rep["largest_gaps"][:2]
    assert first["gap_us"] == 220 and first["frames_at_middle"][0] == "engine/runner.py(10): build"
    assert second["gap_us"] == 125 and second["runtime_calls"] == {"cudaLaunchKernel": 1}
    assert second["frames_at_start"][:2] == ["ops/triton/moe.py(700): moe_experts", "model/model.py(50): forward"]
    assert second["frames_at_middle"][0] == "model/model.py(50): forward"
    calls = [s["call"] for s in rep["syncs"]]
    assert calls == ["cudaMemcpyAsync", "cudaStreamSynchronize"]
    assert rep["syncs"][1]["frames"][0] == "ops/triton/moe.py(700): moe_experts"


def test_analyze_needs_gpu_events():
    with pytest.raises(ValueError, match="no GPU kernel events"):
        pt.analyze({"traceEvents": [_ev("python_function", "dsv4/x.py(1): f", 0, 10)]})
