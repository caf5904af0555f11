"""Shard reads (no processes): every rank's slice, put back together, is the checkpoint's tensor.

Aligned shards (attention heads / groups, vocab, MXFP4 experts) concatenate to the full tensor;
block-padded ones (the tiny model's 128-wide shared expert split in two, FP8 experts) keep the
checkpoint's bytes and scales inside the rank's range and zeros outside, so they *sum* to it.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.reader import Checkpoint
from dsv4.formats import dequantize_block_fp8, dequantize_mxfp4
from dsv4.parallel.group import DistSpec, TPGroup


def _groups(n: int, ep: bool = False) -> list[TPGroup]:
    return [TPGroup(DistSpec(n, ep), r, torch.device("cpu")) for r in range(n)]


def _deq(ckpt, get, name):
    """Dequantized weight ``name`` (…weight) read through ``get``."""
    spec = ckpt.specs[name]
    w, s = get(name), get(name[: -len(".weight")] + ".scale")
    if spec.role == "fp4_weight":
        return dequantize_mxfp4(w.view(torch.uint8), s.view(torch.uint8), dtype=torch.float32)
    return dequantize_block_fp8(w, s, out_dtype=torch.float32)


def _same_bytes(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_exact_shards_concatenate(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    gs = _groups(2)
    cases = [("layers.1.attn.wq_b.weight", 0), ("layers.1.attn.wo_a.weight", 0), ("layers.1.attn.wo_b.weight", 1),
             ("mtp.0.attn.wq_b.weight", 0), ("layers.3.ffn.experts.5.w1.weight", 0),
             ("layers.3.ffn.experts.5.w2.weight", 1)]
    for name, dim in cases:
        full = _deq(ckpt, ckpt.get, name)
        parts = [_deq(ckpt, lambda n, g=g: g.read(ckpt, n), name) for g in gs]
        assert all(p.shape[dim] == full.shape[dim] // 2 for p in parts), name
        assert torch.equal(torch.cat(parts, dim), full), name
    for name in ("embed.weight", "head.weight", "layers.1.attn.attn_sink"):
        assert torch.equal(torch.cat([g.read(ckpt, name) for g in gs]), ckpt.get(name)), name
    # replicated: the shared KV head, the indexer's own wq_b, the gate
    for name in ("layers.1.attn.wkv.weight", "layers.1.attn.indexer.wq_b.weight", "layers.1.ffn.gate.weight"):
        assert all(_same_bytes(g.read(ckpt, name), ckpt.get(name)) for g in gs), name


@pytest.mark.parametrize("fixture, name, dim", [
    ("tiny_ckpt", "layers.1.ffn.shared_experts.w1.weight", 0),
    ("tiny_ckpt", "layers.1.ffn.shared_experts.w2.weight", 1),
    ("tiny_ckpt_fp8_experts", "layers.2.ffn.experts.3.w3.weight", 0),
    ("tiny_ckpt_fp8_experts", "layers.2.ffn.experts.3.w2.weight", 1),
])
def test_unaligned_fp8_shards_are_zero_padded_blocks(request, fixture, name, dim):
    """64 of 128 intermediate rows per rank: the whole 128-block is read, its scale kept, the other half zeroed."""
    ckpt = Checkpoint(request.getfixturevalue(fixture))
    full = _deq(ckpt, ckpt.get, name)
    parts = [_deq(ckpt, lambda n, g=g: g.read(ckpt, n), name) for g in _groups(2)]
    assert all(p.shape == full.shape for p in parts)  # 128 = one whole block along the split dim
    assert torch.equal(parts[0] + parts[1], full)
    half = full.shape[dim] // 2
    assert not parts[0].narrow(dim, half, half).any() and not parts[1].narrow(dim, 0, half).any()
    assert torch.equal(parts[0].narrow(dim, 0, half), full.narrow(dim, 0, half))


def test_expert_parallel_reads_own_experts_only(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    g0, g1 = _groups(2, ep=True)
    assert g0.expert_range(16) == (0, 8) and g1.expert_range(16) == (8, 16)
    name = "layers.2.ffn.experts.9.w2.weight"
    assert torch.equal(g1.read(ckpt, name), ckpt.get(name))  # whole expert, not split
    with pytest.raises(ValueError, match=r"rank 0 holds experts \[0, 8\).*experts\.9\.w2\.weight"):
        g0.read(ckpt, name)
    # the shared expert is still intermediate-split under EP
    assert g0.read(ckpt, "layers.2.ffn.shared_experts.w1.weight").shape[0] == 128


def test_layouts_that_do_not_divide_are_refused(tiny_ckpt):
    from dsv4.config import load_config

    cfg = load_config(tiny_ckpt)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        TPGroup(DistSpec(3), 0, torch.device("cpu")).shard_plan(cfg)
    with pytest.raises(ValueError, match="nnodes=2 must divide tensor_parallel_size=3"):
        DistSpec.from_config(type("C", (), {"tensor_parallel_size": 3, "nnodes": 2})())
