"""The sharded layers in one process: the ranks' partial outputs sum to the unsharded layer's.

Each simulated rank loads its shard (``ModelWeights(shard=...)``) and runs the layer with an
identity "all-reduce"; the test then does the all-reduce itself (a sum over ranks). This checks
every layout cheaply — including TP=4 on the tiny model, where two ranks share one output group
(the Flash layout at TP=16) — without starting processes. fp32: only the summation order differs
from the single-rank layer. Also on the FP8 fast path's weights (kept FP8, the torch ``fp8_linear``
op), where each rank stacks its [wq_a; wkv] and its shared expert's [w1 shard; w3 shard].
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv4.checkpoint.reader import Checkpoint
from dsv4.model.attention import Attention
from dsv4.model.cache import CacheNumerics, DenseSequenceCache
from dsv4.model.moe import MoE
from dsv4.model.opset import OpSet, reference_ops
from dsv4.model.step import SeqChunk, Step
from dsv4.model.weights import ModelWeights
from dsv4.ops import torch_ops
from dsv4.parallel.group import DistSpec, TPGroup


class LocalRank(TPGroup):
    """One rank of a simulated group: collectives are the identity, the test sums the ranks."""

    def all_reduce(self, t):
        return t


def _weights(ckpt, prefix, shard=None, ops=None):
    names = [n for n in ckpt.specs if n.startswith(prefix + ".")]
    op = None if ops is None else ops.fp8_linear
    return ModelWeights(ckpt, torch.float32, progress=False, names=names, shard=shard, keep_quantized=op is not None,
                        fp8_linear=op)


def _ops(fp8: bool) -> OpSet:
    """The oracle's op set, or the FP8 weights' (weights kept FP8, the torch fp8_linear op)."""
    return OpSet({"fp8_linear": torch_ops.fp8_linear}) if fp8 else reference_ops()


def _close(parts, full):
    got = torch.stack(parts).sum(0)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5 * float(full.abs().max()))


@pytest.mark.parametrize("fp8", [False, True], ids=["dequantized", "fp8"])
@pytest.mark.parametrize("n", [2, 4])
def test_attention_shards_sum_to_the_layer(tiny_ckpt, n, fp8):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    layer = 1  # CSA: window + compressor + indexer
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ops = _ops(fp8)

    def run(shard):
        attn = Attention(_weights(ckpt, f"layers.{layer}", shard, ops), layer, cfg, ops)
        assert (attn.wq_a_kv is not None) == fp8
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


@pytest.mark.parametrize("fp8", [False, True], ids=["dequantized", "fp8"])
@pytest.mark.parametrize("n, ep", [(2, False), (2, True), (4, False), (4, True)])
def test_moe_shards_sum_to_the_layer(tiny_ckpt, n, ep, fp8):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    layer = 2  # scored routing (not hash)
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(2))
    ops = _ops(fp8)

    def run(shard):
        moe = MoE(_weights(ckpt, f"layers.{layer}", shard, ops), f"layers.{layer}.ffn", cfg, cfg.is_hash_layer(layer),
                  False, ops)
        assert (moe.shared_w13 is not None) == fp8
        moe.tp = shard
        return moe.forward(x, ids)

    full = run(None)
    parts = [run(LocalRank(DistSpec(n, ep), r, torch.device("cpu"))) for r in range(n)]
    _close(parts, full)


@pytest.mark.parametrize("n", [2, 4])
def test_a_ranks_stacked_weights_are_its_own_shards(tiny_ckpt, n):
    """The shared expert's stacked weight on a rank is [its w1 shard; its w3 shard] (the intermediate split,
    an unaligned shard read as whole scale blocks with the rows outside it zero), scales alike; [wq_a; wkv]
    is whole on every rank (both replicated)."""
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    ops = _ops(True)
    for r in range(n):
        rank = LocalRank(DistSpec(n), r, torch.device("cpu"))
        w = _weights(ckpt, "layers.2", rank, ops)
        moe = MoE(w, "layers.2.ffn", cfg, cfg.is_hash_layer(2), False, ops)
        attn = Attention(w, 2, cfg, ops)
        for both, names, read in ((moe.shared_w13, ("ffn.shared_experts.w1", "ffn.shared_experts.w3"), rank.read),
                                  (attn.wq_a_kv, ("attn.wq_a", "attn.wkv"), Checkpoint.get)):
            for part, key in (("weight", "weight"), ("scale", "scale")):
                want = torch.cat([read(ckpt, f"layers.2.{nm}.{key}") for nm in names])
                got = getattr(both, part)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8).to(got.device)), (r, names, part)


def test_vocab_parallel_embedding_and_head(tiny_ckpt_release_vocab):
    """The release vocabulary's two halves (rows 64,639 / 64,640 meet at the ranks' boundary)."""
    ckpt = Checkpoint(tiny_ckpt_release_vocab)
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
