"""Shared helpers of the tests/ops kernel tests (device choice, tolerances, expert weights).

Bitwise claims under the interpreter. Without a GPU the kernels run in Triton's interpreter, where a
``tl.dot`` is numpy's matmul: OpenBLAS picks its kernel (and so each output's summation order) by CPU
type and by the operands' shapes. A bitwise comparison is portable there only between launches that
issue the same dots (same shapes, the row at the same place) — batch invariance within one tile
configuration, say. Two code paths that issue different dots (another tile, another head block, keys
decoded once against in registers) are bitwise only compiled; under the interpreter
``assert_bits_if_compiled`` holds them to a bound from the math instead. The dense and FP8-linear
kernels sum k by k in the interpreter (``dsv4.ops.triton.dense.dot_acc``), so no BLAS reaches them.
"""

from __future__ import annotations

import os

import torch

from dsv4.formats import quantize_block_fp8, quantize_mxfp4

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
EPS32 = 2.0 ** -24  # fp32 unit roundoff
BF16_ULP = 2.0 ** -8  # bf16 relative spacing (unit roundoff 2^-9)
# One bf16 spacing relative to the value it is at: 2^-7 just above a power of two, 2^-8 just below the next. Two
# roundings to bf16 of fp32 values a hair apart can land one spacing apart, up to 2^-7·|v| (H200: 0.0078 at 1.04).
BF16_SPACING_MAX = 2.0 ** -7


def spy_launches(monkeypatch, module, name: str) -> list:
    """The grids of every launch of ``module.name`` (a Triton kernel) from now on; the launches still run."""
    calls = []
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(module, name, Spy())
    return calls


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def assert_fp32_accum_close(y, ref, absprod, rel=1e-5):
    """|y - ref| ≤ rel · Σ_k |x_k||w_k|: both sides are fp32 sums of the same exact products, so
    they differ only by summation order (≤ K·2^-24 of Σ|x w| in the worst case, ~√K·2^-24 in
    practice); rel = 1e-5 covers K up to a few hundred with margin."""
    d = (y.float() - ref.float()).abs()
    lim = rel * absprod.float() + 1e-30
    bad = d > lim
    assert not bool(bad.any()), (f"{int(bad.sum())} elements off; max |diff| {d.max().item():.3g}, "
                                 f"max diff/limit {(d / lim).max().item():.3g}")


def assert_bits_equal(got, want):
    """Same dtype, shape and bits everywhere (NaN payloads aside: NaN exactly where the oracle has NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    ib = {2: torch.int16, 4: torch.int32}[want.element_size()]
    g, w = got.view(ib), want.view(ib)
    bad = (g != w) & ~nan
    assert not bool(bad.any()), (f"{int(bad.sum())} of {want.numel()} differ, e.g. got {got[bad][:4].tolist()} "
                                 f"want {want[bad][:4].tolist()}")


def assert_bits_if_compiled(got, want, bound):
    """``got`` and ``want`` come from two code paths whose dots differ: bitwise compiled (on the GPU),
    within ``bound`` (elementwise, from the math) under the interpreter, whose BLAS sums in an order
    that depends on the CPU (see the module docstring)."""
    if not INTERPRET:
        assert_bits_equal(got, want)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    d = (got.double() - want.double()).abs()
    worst = (d / (bound + 1e-300)).max().item()
    assert worst <= 1.0, f"max |diff|/bound = {worst:.3g} (max |diff| {d.max().item():.3g})"


def mxfp4_experts(n_exp, hidden, inter, g, scale=0.05):
    """Per-expert checkpoint-format tensors: (w1, s1, w3, s3, w2, s2) lists, int8 / float8_e8m0fnu."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    out = {k: [] for k in ("w1", "s1", "w3", "s3", "w2", "s2")}
    for _ in range(n_exp):
        for name, (o, i) in (("1", (inter, hidden)), ("3", (inter, hidden)), ("2", (hidden, inter))):
            w, s = quantize_mxfp4(torch.randn(o, i, generator=g) * scale)
            out["w" + name].append(w.to(DEV))
            out["s" + name].append((s.view(e8m0) if e8m0 is not None else s).to(DEV))
    return [out[k] for k in ("w1", "s1", "w3", "s3", "w2", "s2")]


def fp8_experts(n_exp, hidden, inter, g, scale_fmt="fp32", scale=0.05):
    """Per-expert FP8 (Base checkpoint) tensors: float8_e4m3fn weights, 128x128 block scales."""
    out = {k: [] for k in ("w1", "s1", "w3", "s3", "w2", "s2")}
    for _ in range(n_exp):
        for name, (o, i) in (("1", (inter, hidden)), ("3", (inter, hidden)), ("2", (hidden, inter))):
            w, s = quantize_block_fp8(torch.randn(o, i, generator=g) * scale, scale_fmt=scale_fmt)
            out["w" + name].append(w.to(DEV))
            out["s" + name].append(s.to(DEV))
    return [out[k] for k in ("w1", "s1", "w3", "s3", "w2", "s2")]
