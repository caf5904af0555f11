"""The expert-parallel all-to-all (``dsv4.parallel.expert``) against the single-process MoE layer.

Two real gloo ranks each hold half of the tiny model's routed experts and run a MoE layer on their
own random tokens; each rank's output must be bitwise the single-process layer's on the same
tokens (CPU, float32): the pairs are computed on the rank holding their expert and summed back on
the token's rank in the reference's order. Covered: a hash-routed and a score-routed layer, the
dequantized reference path and the grouped checkpoint-format path (the torch ``moe_experts``), a
rank with no tokens (it still serves the other's), the dense exchange of the decode graphs, and a
forward that fails between exchanges (``finish_forward``: the other rank's forward completes).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.reader import Checkpoint
from dsv4.model.moe import MoE, combine_pairs
from dsv4.model.opset import OpSet, reference_ops
from dsv4.model.weights import ModelWeights
from dsv4.parallel.expert import EPGroup

LAYERS = (0, 2)  # hash routing, score routing
ROUNDS = ((13, 0), (5, 24), (0, 0))  # tokens of (rank 0, rank 1) per round: an idle rank, both, neither
DENSE = 8  # tokens of each rank in the dense exchange (a decode graph's bucket: the same on every rank)


def _grouped_ops() -> OpSet:
    from dsv4.ops import torch_ops

    return OpSet({"fp8_linear": torch_ops.fp8_linear, "moe_route": torch_ops.moe_route,
                  "moe_experts": torch_ops.moe_experts}, {})


def _layer(ckpt, layer: int, shard, grouped: bool) -> MoE:
    prefix = f"layers.{layer}"
    ops = _grouped_ops() if grouped else reference_ops()
    w = ModelWeights(ckpt, torch.float32, progress=False, names=[n for n in ckpt.specs if n.startswith(prefix + ".")],
                     keep_quantized=grouped, fp8_linear=ops.fp8_linear, shard=shard)
    moe = MoE(w, f"{prefix}.ffn", ckpt.config, ckpt.config.is_hash_layer(layer), False, ops)
    moe.ep = shard
    return moe


def _inputs(cfg, rank: int, rnd: int, n: int):
    g = torch.Generator().manual_seed(100 * rnd + rank)
    return (torch.randn(n, cfg.hidden_size, generator=g),
            torch.randint(0, cfg.vocab_size, (n,), generator=g))


def _rank(rank: int, port: int, ckpt_dir: str, results) -> None:
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        ckpt = Checkpoint(ckpt_dir)
        cfg = ckpt.config
        ep = EPGroup(rank, 2, cfg.n_routed_experts, "cpu")
        checked = []
        for grouped in (False, True):
            for layer in LAYERS:
                ref, mine = _layer(ckpt, layer, None, grouped), _layer(ckpt, layer, ep, grouped)
                for rnd, sizes in enumerate(ROUNDS):
                    x, ids = _inputs(cfg, rank, rnd, sizes[rank])
                    got = mine.forward(x, ids)
                    assert got.shape == x.shape
                    if sizes[rank]:
                        want = ref.forward(x, ids)
                        assert torch.equal(got, want), (grouped, layer, rnd, (got - want).abs().max())
                    checked.append((grouped, layer, rnd, sizes[rank]))
                x, ids = _inputs(cfg, rank, 5, DENSE)  # the decode graphs' fixed-shape exchange
                with ep.dense_mode():
                    got = mine.forward(x, ids)
                assert torch.equal(got, ref.forward(x, ids)), (grouped, layer, "dense")
        # a forward that fails after its first MoE layer: the rest is joined with empty exchanges
        model = type("M", (), {})()
        model.blocks = [type("B", (), {"moe": _layer(ckpt, layer, ep, False)})() for layer in (1, 2, 3)]
        model.cfg, model.dtype, model.device = cfg, torch.float32, torch.device("cpu")
        x, ids = _inputs(cfg, rank, 9, 11)
        ep.begin_forward()
        outs = [model.blocks[0].moe.forward(x, ids)]
        if rank == 0:
            ep.finish_forward(model)  # "raised" here: layers 2 and 3 with no tokens
        else:
            outs += [b.moe.forward(x, ids) for b in model.blocks[1:]]
            refs = [_layer(ckpt, layer, None, False).forward(x, ids) for layer in (1, 2, 3)]
            assert all(torch.equal(a, b) for a, b in zip(outs, refs))
        assert ep.exchanges == 3 and ep.broken is None
        results.put((rank, checked))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def test_expert_parallel_moe_is_bitwise_the_single_process_layer(tiny_ckpt):
    from parallel_helpers import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tiny_ckpt), results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in range(2):
        assert not isinstance(got[r], str), got[r]
        assert len(got[r]) == 2 * len(LAYERS) * len(ROUNDS)


def test_combine_pairs_sums_like_the_reference_layer():
    """Slots in any order, with repeated experts: the sum is the reference's index_add_ sequence."""
    g = torch.Generator().manual_seed(0)
    t, k, h = 9, 4, 16
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(t)])
    ids[0] = torch.tensor([5, 2, 5, 1])  # a hash table may repeat an expert
    y, w = torch.randn(t, k, h, generator=g), torch.rand(t, k, generator=g)
    want = torch.zeros(t, h)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        want.index_add_(0, rows, y[rows, slot].float() * w[rows, slot, None])
    assert torch.equal(combine_pairs(y, ids, w), want)


def test_a_rank_reads_only_its_own_experts(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    ep = EPGroup(1, 2, ckpt.config.n_routed_experts, "cpu")
    assert ep.expert_range(16) == (8, 16)
    assert torch.equal(ep.read(ckpt, "layers.0.ffn.experts.9.w1.weight"), ckpt.get("layers.0.ffn.experts.9.w1.weight"))
    assert torch.equal(ep.read(ckpt, "layers.0.attn.wq_b.weight"), ckpt.get("layers.0.attn.wq_b.weight"))  # whole
    with pytest.raises(ValueError, match=r"rank 1 holds experts \[8, 16\).*'layers.0.ffn.experts.3.w1.weight'"):
        ep.read(ckpt, "layers.0.ffn.experts.3.w1.weight")
    with pytest.raises(ValueError, match="n_routed_experts=16 is not divisible by data_parallel_size=3"):
        EPGroup(0, 3, 16, "cpu")
