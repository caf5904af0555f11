"""The sharded layers in one process: the ranks' partial outputs sum to the unsharded layer's.

Each simulated rank loads its shard (``ModelWeights(shard=...)``) and runs the layer with an
identity "all-reduce"; the test then does the all-reduce itself (a sum over ranks). This checks
every layout cheaply — including TP=4 on the tiny model, where two ranks share one output group
(the Flash layout at TP=16) — without starting processes. fp32: only the summation order differs
from the single-rank layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv4.checkpoint.reader import Checkpoint
from dsv4.model.attention import Attention
from dsv4.model.cache import CacheNumerics, DenseSequenceCache
from dsv4.model.moe import MoE
from dsv4.model.opset import reference_ops
from dsv4.model.step import SeqChunk, Step
from dsv4.model.weights import ModelWeights
from dsv4.parallel.group import DistSpec, TPGroup


class LocalRank(TPGroup):
    """One rank of a simulated group: collectives are the identity, the test sums the ranks."""

    def all_reduce(self, t):
        return t


def _weights(ckpt, prefix, shard=None):
    names = [n for n in ckpt.specs if n.startswith(prefix + ".")]
    return ModelWeights(ckpt, torch.float32, progress=False, names=names, shard=shard)


def _close(parts, full):
    got = torch.stack(parts).sum(0)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5 * float(full.abs().max()))


@pytest.mark.parametrize("n", [2, 4])
def test_attention_shards_sum_to_the_layer(tiny_ckpt, n):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    layer = 1  # CSA: window + compressor + indexer
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(0))

    def run(shard):
        attn = Attention(_weights(ckpt, f"layers.{layer}", shard), layer, cfg, reference_ops())
        attn.tp = shard
        cache = DenseSequenceCache(cfg, CacheNumerics("auto"))
        return attn.forward(x, Step.of([SeqChunk(cache, 0, x.shape[0])], x.device))

    full = run(None)
    ranks = [LocalRank(DistSpec(n), r, torch.device("cpu")) for r in range(n)]
    parts = [run(tp) for tp in ranks]
    if n == 4:  # 4 heads, 2 groups: ranks 0 and 1 share group 0, each with its own head's wo_a columns
        w = _weights(ckpt, f"layers.{layer}", ranks[1])
        assert tuple(w[f"layers.{layer}.attn.wo_a.weight"].shape) == (cfg.o_lora_rank, cfg.head_dim)
    _close(parts, full)


@pytest.mark.parametrize("n, ep", [(2, False), (2, True), (4, False), (4, True)])
def test_moe_shards_sum_to_the_layer(tiny_ckpt, n, ep):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    layer = 2  # scored routing (not hash)
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(2))

    def run(shard):
        moe = MoE(_weights(ckpt, f"layers.{layer}", shard), f"layers.{layer}.ffn", cfg, cfg.is_hash_layer(layer),
                  False, reference_ops())
        moe.tp = shard
        return moe.forward(x, ids)

    full = run(None)
    parts = [run(LocalRank(DistSpec(n, ep), r, torch.device("cpu"))) for r in range(n)]
    _close(parts, full)


def test_vocab_parallel_embedding_and_head(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    ids = torch.tensor([0, 5, 64639, 64640, 64641, cfg.vocab_size - 1])
    ranks = [LocalRank(DistSpec(2), r, torch.device("cpu")) for r in range(2)]
    tables = [r.read(ckpt, "embed.weight") for r in ranks]
    full = ckpt.get("embed.weight")
    assert torch.equal(torch.stack([r.embed(t, ids) for r, t in zip(ranks, tables)]).sum(0), full[ids])


def test_group_layouts_that_do_not_fit_are_refused():
    cfg = SimpleNamespace(num_attention_heads=12, o_groups=4, n_shared_experts=1, moe_intermediate_size=256,
                          n_routed_experts=12, head_dim=512, o_lora_rank=1024)
    with pytest.raises(ValueError, match="o_groups=4 and tensor_parallel_size=6: one must divide the other"):
        TPGroup(DistSpec(6), 0, torch.device("cpu")).shard_plan(cfg)
    flash = SimpleNamespace(num_attention_heads=64, o_groups=8, n_shared_experts=1, moe_intermediate_size=2048,
                            n_routed_experts=256, head_dim=512, o_lora_rank=1024)
    want = {2: [(0, 4096, 8192)], 8: [(0, 7168, 8192)],  # the last rank's wo_a: whole groups ...
            16: [(0, 7168, 8192), (1, 2048, 4096)],  # ... or, at TP=16/32, its heads' columns of a shared group
            32: [(0, 7168, 8192), (1, 3072, 4096)]}
    for n, ranges in want.items():
        plan = TPGroup(DistSpec(n, True), n - 1, torch.device("cpu")).shard_plan(flash)
        assert plan.ranges("mtp.0.attn.wo_a.weight") == ranges, n
        assert plan.ranges("layers.0.attn.wo_b.weight") == [(1, 7168 if n >= 8 else 4096, 8192)], n
