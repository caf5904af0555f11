"""Platform detection (arch → FP8 flavour, forced FNUZ) and the op registry (priority, forcing, describe)."""

import pytest
import torch

from dsv4.ops import registry
from dsv4.ops.platform import Platform, detect_platform, platform_from, triton_importable
from dsv4.ops.registry import BackendError, describe, describe_table, register, resolve, unregister

CPU_NO_TRITON = platform_from("cpu", triton=False)
CPU_TRITON = platform_from("cpu", triton=True)
H200 = platform_from("cuda", "NVIDIA H200", (9, 0), triton=True)


@pytest.fixture
def fresh_platform(monkeypatch):
    monkeypatch.delenv("DSV4_PLATFORM_FP8", raising=False)
    monkeypatch.delenv("DSV4_OPS", raising=False)
    detect_platform.cache_clear()
    yield monkeypatch
    detect_platform.cache_clear()


def test_cuda_capabilities():
    h = platform_from("cuda", "H200", (9, 0), triton=True)
    assert (h.kind, h.arch, h.capability, h.fp8_format, h.native_fp8, h.triton) == \
        ("cuda", "sm_90", (9, 0), "ocp", True, True)
    ada = platform_from("cuda", "L4", (8, 9), triton=True)
    assert ada.native_fp8 and ada.arch == "sm_89"
    a100 = platform_from("cuda", "A100", (8, 0), triton=True)
    # no native FP8 below sm_89, but the Triton kernels (integer FP8 decode) still run
    assert not a100.native_fp8 and a100.fp8_format == "ocp" and a100.triton


@pytest.mark.parametrize("arch,fmt,native", [
    ("gfx942:sramecc+:xnack-", "fnuz", True),  # MI300
    ("gfx950", "ocp", True),  # MI355
    ("gfx936", "ocp", False),  # no native FP8: cache bytes still OCP
    ("gfx90a:sramecc+:xnack-", "ocp", False),
])
def test_rocm_arches(arch, fmt, native):
    p = platform_from("rocm", "AMD Instinct", (9, 4), arch, triton=True)
    assert p.kind == "rocm" and p.arch == arch.split(":")[0]
    assert (p.fp8_format, p.native_fp8) == (fmt, native)


def test_detect_cpu_triton_only_when_interpreting(fresh_platform):
    if torch.cuda.is_available():
        pytest.skip("CPU detection test")
    fresh_platform.setenv("TRITON_INTERPRET", "1")
    p = detect_platform()
    assert p.kind == "cpu" and p.capability is None and p.arch is None and not p.native_fp8
    assert p.fp8_format == "ocp" and p.triton == triton_importable()
    assert detect_platform() is p  # cached
    fresh_platform.setenv("TRITON_INTERPRET", "0")
    detect_platform.cache_clear()
    assert detect_platform().triton is False


def test_forced_fnuz_via_env(fresh_platform):
    fresh_platform.setenv("DSV4_PLATFORM_FP8", "fnuz")
    detect_platform.cache_clear()
    assert detect_platform().fp8_format == "fnuz"
    assert platform_from("cuda", "H200", (9, 0), triton=True).fp8_format == "fnuz"
    fresh_platform.setenv("DSV4_PLATFORM_FP8", "ocp")
    assert platform_from("rocm", "MI300", None, "gfx942", triton=True).fp8_format == "ocp"
    fresh_platform.setenv("DSV4_PLATFORM_FP8", "e5m2")
    detect_platform.cache_clear()
    with pytest.raises(ValueError, match="DSV4_PLATFORM_FP8"):
        detect_platform()


def test_selection_by_capability(fresh_platform):
    for op in registry.OPS:
        assert resolve(op, CPU_NO_TRITON)[0] == "torch"
        assert callable(resolve(op, CPU_NO_TRITON)[1])
    if triton_importable():
        for op in registry.OPS:
            assert resolve(op, CPU_TRITON)[0] == "triton"  # interpreter counts as Triton-capable
            name, fn = resolve(op, H200)
            assert name == "triton" and callable(fn) and fn.__module__.startswith("dsv4.ops.triton")


def test_forcing_by_dict_and_env(fresh_platform):
    assert resolve("fp8_linear", H200, force={"fp8_linear": "torch"})[0] == "torch"
    assert resolve("moe_route", H200, force="moe=torch")[0] == "torch"
    fresh_platform.setenv("DSV4_OPS", "fp8_linear=torch,moe=triton")
    assert resolve("fp8_linear", H200)[0] == "torch"
    if triton_importable():
        assert resolve("moe_route", H200)[0] == "triton"
        assert resolve("moe_experts", H200)[0] == "triton"
        # the argument wins over the environment; exact names win over groups
        assert resolve("fp8_linear", H200, force="fp8_linear=triton")[0] == "triton"
        assert resolve("moe_experts", H200, force="moe=torch,moe_experts=triton")[0] == "triton"
    fresh_platform.setenv("DSV4_OPS", "all=torch")
    assert {resolve(op, H200)[0] for op in registry.OPS} == {"torch"}


def test_forcing_unavailable_or_unknown_errors(fresh_platform):
    with pytest.raises(BackendError, match=r"'fp8_linear'.*'triton'.*not available"):
        resolve("fp8_linear", CPU_NO_TRITON, force={"fp8_linear": "triton"})
    fresh_platform.setenv("DSV4_OPS", "moe_experts=triton")
    with pytest.raises(BackendError, match=r"'moe_experts'.*'triton'"):
        resolve("moe_experts", CPU_NO_TRITON)
    with pytest.raises(BackendError, match=r"'cutlass'.*not registered"):
        resolve("moe_experts", H200, force={"moe_experts": "cutlass"})
    fresh_platform.delenv("DSV4_OPS")
    with pytest.raises(BackendError, match="unknown op 'attention'"):
        resolve("fp8_linear", H200, force="attention=torch")
    with pytest.raises(BackendError, match="bad entry"):
        resolve("fp8_linear", H200, force="fp8_linear")
    with pytest.raises(BackendError, match="unknown op"):
        resolve("flash_mla", H200)


def test_register_custom_backend_priority(fresh_platform):
    calls = []
    register("fp8_linear", "fake_fast", lambda *a, **k: calls.append(1), lambda p: p.kind == "cuda", 99)
    try:
        assert resolve("fp8_linear", H200)[0] == "fake_fast"
        assert resolve("fp8_linear", CPU_NO_TRITON)[0] == "torch"
        resolve("fp8_linear", H200)[1]()
        assert calls == [1]
    finally:
        unregister("fp8_linear", "fake_fast")
    assert "fake_fast" not in registry.backends("fp8_linear")


def test_describe(fresh_platform):
    rows = describe(CPU_NO_TRITON)
    assert [r["op"] for r in rows] == list(registry.OPS)
    for r in rows:
        assert r["backend"] == "torch" and r["reason"] == "priority"
        names = {c["name"]: c for c in r["candidates"]}
        assert names["torch"]["available"] and not names["triton"]["available"]
        assert names["triton"]["priority"] > names["torch"]["priority"]
    rows = describe(H200, force="moe_route=torch")
    by = {r["op"]: r for r in rows}
    assert by["moe_route"]["backend"] == "torch" and by["moe_route"]["reason"] == "forced"
    bad = describe(CPU_NO_TRITON, force="fp8_linear=triton")
    assert bad[0]["backend"] is None and "not available" in bad[0]["reason"]
    text = describe_table(H200)
    assert "sm_90" in text and all(op in text for op in registry.OPS)


def test_platform_is_frozen():
    with pytest.raises(Exception):
        CPU_TRITON.kind = "cuda"  # type: ignore[misc]
    assert isinstance(CPU_TRITON, Platform)
