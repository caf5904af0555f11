"""The op set (``dsv4.model.opset``): every op bound to one function when a model is built."""

from __future__ import annotations

import pytest
import torch

from dsv4.model import mhc, norms, rope
from dsv4.model.opset import ATTENTION_OPS, OPS, OpSet, reference_ops


def test_the_reference_set_is_the_oracles_own_code():
    ops = reference_ops()
    assert ops.rms_norm is norms.rms_norm and ops.apply_rope is rope.apply_rope and ops.mhc_post is mhc.hc_post
    assert ops.kernels == {} and not ops.quantized_weights and not ops.paged_attention and ops.greedy_pick is None
    assert ops.mhc_pre.func is mhc.hc_pre and ops.mhc_pre.args == (ops,)  # composites over the set's own blocks


def test_a_kernel_replaces_exactly_its_op_and_composites_use_it():
    calls = []

    def norm(x, eps):
        calls.append("unit_rms_norm")
        return norms.unit_rms_norm(x, eps)

    ops = OpSet({"unit_rms_norm": norm})
    assert ops.unit_rms_norm is norm and ops.rms_norm is norms.rms_norm
    x = torch.randn(3, 2, 128)
    cos, sin = rope.cos_sin(__import__("dsv4.config", fromlist=["RopeParams"]).RopeParams(theta=1e4, dim=64),
                            torch.arange(3))
    assert torch.equal(ops.unit_norm_rope(x, cos, sin, 1e-6), reference_ops().unit_norm_rope(x, cos, sin, 1e-6))
    assert calls == ["unit_rms_norm"]


def test_the_fused_post_pre_kernel_needs_its_pair():
    def fused(*a):
        raise AssertionError("not used without mhc_post and mhc_pre kernels")

    assert OpSet({"mhc_post_pre": fused}).mhc_post_pre is not fused
    both = OpSet({"mhc_post_pre": fused, "mhc_post": mhc.hc_post, "mhc_pre": lambda *a: None})
    assert both.mhc_post_pre is fused


def test_bad_op_sets_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown op.*'rms_nrom'"):
        OpSet({"rms_nrom": norms.rms_norm})
    with pytest.raises(ValueError, match="needs all of.*missing"):
        OpSet({"sparse_attention": lambda *a: None})
    assert len(set(OPS)) == len(OPS) and set(ATTENTION_OPS) <= set(OPS)


def test_resolve_op_set_is_the_one_selection():
    from dsv4.ops import resolve_op_set

    ref = resolve_op_set("auto", "auto", "cpu")
    assert not ref.quantized_weights and not ref.paged_attention and ref.kernels == {}
    batched = resolve_op_set("torch", "batched", "cpu")
    assert batched.paged_attention and not batched.quantized_weights
    assert all(batched.backends[op] == "torch" for op in ATTENTION_OPS)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_op_set("cuda", "auto", "cpu")
