"""The op set: every op the model and the engine call, each bound to one function when the model is built.

The reference model is written against these names (``self.ops.rms_norm(x, w, eps)``). An op set
without kernels is the oracle itself: plain torch, batch-invariant on CPU. ``dsv4.ops.resolve_op_set``
fills one from the backend registry, once per engine; a kernel replaces the oracle's torch code for
exactly the op it is registered for. Composite ops (mHC pre, the query's norm + rope, the SwiGLU, the
GEMM helpers) run the oracle's code over this set's own building blocks, so on the fast path every
GEMM and norm inside them is the batch-invariant kernel, and a debugger shows which function each
attribute is.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping

# The one list of op names, grouped by who consumes them (the startup table prints them in this order).
WEIGHT_OPS = ("fp8_linear", "moe_route", "moe_experts")  # on checkpoint-format weights (None: dequantized at load)
BLOCK_OPS = ("dense_linear", "rms_norm", "unit_rms_norm", "mhc_pre", "mhc_post", "mhc_post_pre", "apply_rope",
             "unit_norm_rope", "swiglu_act")  # the oracle's building blocks
ATTENTION_OPS = ("kv_insert", "kv_norm_rope_insert", "compressor_pool_insert", "sparse_attention", "indexer",
                 "indexer_q_rope_quant")  # the batched attention over the paged cache (None: per request)
SAMPLER_OPS = ("greedy_pick",)  # the sampler's batched pick of plain greedy rows (None: the torch op)
OPS = WEIGHT_OPS + BLOCK_OPS + ATTENTION_OPS + SAMPLER_OPS


def eager_only(fn: Callable) -> Callable:
    """Mark an op implementation that a CUDA graph must not capture (``fn.eager_only``): the torch
    backend of the batched attention reads device values on the host (page bounds, per-sequence key
    counts), a synchronization stream capture forbids, so an engine with it runs its steps eagerly."""
    fn.eager_only = True
    return fn


class OpSet:
    """``fns``: op name → function. Building blocks not given run the oracle's torch code; weight,
    attention and sampler ops not given are None (dequantized weights, the per-request attention, the
    torch pick). ``backends``: op name → backend name, for the startup table and reports."""

    def __init__(self, fns: Mapping[str, Callable] | None = None, backends: Mapping[str, str] | None = None,
                 fork: Callable | None = None):
        """``fork``: how the model's concurrent branches run (``dsv4.model.branches``; default in order)."""
        from . import branches, linear, mhc, moe, norms, rope

        fns = dict(fns or {})
        unknown = sorted(set(fns) - set(OPS))
        if unknown:
            raise ValueError(f"unknown op(s) {unknown}; ops are {list(OPS)}")
        given = [op for op in ATTENTION_OPS if op in fns]
        if given and len(given) != len(ATTENTION_OPS):
            missing = [op for op in ATTENTION_OPS if op not in fns]
            raise ValueError(f"the batched attention needs all of {list(ATTENTION_OPS)}; missing {missing}")
        self.kernels = {op: f for op, f in fns.items() if op in BLOCK_OPS}  # what replaces oracle code
        off = {**dict.fromkeys(WEIGHT_OPS, "off (weights dequantized)"),
               **dict.fromkeys(ATTENTION_OPS, "off (per-request attention)")}
        self.backends = {op: (backends or {}).get(op, "custom") if op in fns else off.get(op, "torch") for op in OPS}
        for op in WEIGHT_OPS + ATTENTION_OPS + SAMPLER_OPS:
            setattr(self, op, fns.get(op))
        self.fork = fork or branches.serial_fork
        self.fork_point = getattr(self.fork, "point", branches.serial_point)  # where a later fork may start from
        k = self.kernels
        # leaves
        self.dense_linear = k.get("dense_linear", linear.dense_reference)
        self.rms_norm = k.get("rms_norm", norms.rms_norm)
        self.unit_rms_norm = k.get("unit_rms_norm", norms.unit_rms_norm)
        self.mhc_post = k.get("mhc_post", mhc.hc_post)
        self.apply_rope = k.get("apply_rope", rope.apply_rope)
        self.swiglu_act = k.get("swiglu_act", moe.swiglu_act)
        # composites: the oracle's code over this set's leaves
        self.mhc_pre = k.get("mhc_pre") or partial(mhc.hc_pre, self)
        fused = "mhc_post_pre" in k and "mhc_post" in k and "mhc_pre" in k  # it reproduces exactly that pair
        self.mhc_post_pre = k["mhc_post_pre"] if fused else partial(mhc.hc_post_then_pre, self)
        self.unit_norm_rope = k.get("unit_norm_rope") or partial(rope.unit_norm_rope, self)
        self.linear = partial(linear.linear, dense=self.dense_linear)
        self.linear_f32 = partial(linear.linear_f32, fast=k.get("dense_linear"))
        self.hc_head = partial(mhc.hc_head, self)
        self.swiglu = partial(moe.swiglu, self)

    @property
    def quantized_weights(self) -> bool:
        """Weights stay in their checkpoint formats (FP8 / MXFP4), consumed by the weight ops."""
        return self.fp8_linear is not None

    @property
    def paged_attention(self) -> bool:
        """The step's attention runs batched over the paged cache (the ops of ``ATTENTION_OPS``)."""
        return self.sparse_attention is not None

    def describe(self) -> str:
        """Each backend with the ops it runs (one line for the start-up log)."""
        by: dict[str, list[str]] = {}
        for op in OPS:
            by.setdefault(self.backends[op], []).append(op)
        branches = getattr(self.fork, "label", "in order")
        return "; ".join(f"{name}: {', '.join(ops)}" for name, ops in by.items()) + f"; branches: {branches}"


REFERENCE: OpSet | None = None


def reference_ops() -> OpSet:
    """The oracle's op set (no kernels), shared: it holds only functions."""
    global REFERENCE
    if REFERENCE is None:
        REFERENCE = OpSet()
    return REFERENCE


def __getattr__(name: str):
    """``reference_<op>``: the oracle's function for a building block (what the registry names as the
    op's torch backend, e.g. ``dsv4.model.opset:reference_mhc_pre``)."""
    op = name[len("reference_"):] if name.startswith("reference_") else None
    if op in BLOCK_OPS:
        return getattr(reference_ops(), op)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
