"""The step plan carries what a worker needs to rebuild each request's allocation exactly."""

import pickle
from types import SimpleNamespace

import torch

from dsv4.cache.paged import CacheAllocation
from dsv4.model.step import PagedStep, SeqChunk
from dsv4.parallel.plan import plan_step


def test_plan_sends_only_the_unreleased_window_pages_and_rebuilds_the_allocation():
    released = 1000  # a 64K-token context: its first 1000 window pages are released
    a = CacheAllocation(blocks=list(range(257)), swa=[-1] * released + [5, 6, 7], slot=3, num_computed=65600,
                        swa_released=released)
    fresh = CacheAllocation(blocks=[9], swa=[1, 2], slot=0, num_computed=100)
    chunks = [SeqChunk(SimpleNamespace(alloc=x), x.num_computed, 1) for x in (a, fresh)]
    plan = plan_step(torch.tensor([1, 2]), chunks, None, [], paged=True)
    assert plan.chunks[0].swa == [5, 6, 7] and plan.chunks[0].swa_released == released
    assert len(pickle.dumps(plan)) < 4000  # the 1000 released pages are not in the message
    for c, x in zip(pickle.loads(pickle.dumps(plan)).chunks, (a, fresh)):
        b = c.allocation()
        assert (b.blocks, b.swa, b.slot, b.num_computed, b.swa_released) == \
               (x.blocks, x.swa, x.slot, x.num_computed, x.swa_released)


def test_a_worker_rebuilds_every_step_and_decode_graph_input_from_the_plan(tiny_ckpt):
    """The tensor-parallel step protocol at TP=1 in one process, with the decode graphs (emulated on
    CPU): every forward of an engine is described by its pickled step plan, and a mirror "worker"
    (its own model, paged cache and graphs) replays it with ``run_step``. Each graph replay's static
    inputs — staged on rank 0 straight into its graph's buffer by the runner, loaded on the worker
    from the tables it rebuilt from the plan — must be the same bytes, spare lanes included, and
    every step's logits the same bits."""
    import pickle

    from parallel_helpers import ENGINE, greedy_llm

    from dsv4 import LLM
    from dsv4.cache.paged import PagedKVCache
    from dsv4.engine.cuda_graphs import DecodeGraphs
    from dsv4.model.model import ReferenceModel
    from dsv4.ops.selection import resolve_op_set
    from dsv4.parallel.plan import run_step

    llm = LLM(str(tiny_ckpt), attention="batched", backend="torch", **{**ENGINE, "enable_prefix_caching": False})
    eng = llm.engine
    eng.capture_decode_graphs()
    graphs = eng.runner.graphs
    model = ReferenceModel(str(tiny_ckpt), dtype=torch.float32, ops=resolve_op_set("torch", "batched", "cpu"))
    kvc = PagedKVCache(model.cfg, eng.numerics, eng.kv_cache.budget, torch.float32, "cpu")
    mirror = DecodeGraphs(model, kvc, eng.config.max_num_seqs, eng.max_model_len)
    mirror.capture()
    seen = {}  # the worker's logits of the step it just replayed (run_step keeps them to itself)
    forward, replay = model.forward, mirror.run

    def worker_forward(*a, **k):
        out = forward(*a, **k)
        seen["logits"] = out.logits
        return out

    def worker_replay(batch, bucket=None):
        assert bucket is None  # (TP alone: the batch's own bucket; inside DP ranks the agreed one)
        seen["logits"] = replay(batch)  # (an emulated replay's forward is recorded first, then this)
        return seen["logits"]

    model.forward, mirror.run = worker_forward, worker_replay
    execute, replays = eng.runner.execute, []

    def mirrored(batch):
        graph = graphs.can_run(batch)
        plan = plan_step(batch.token_ids, batch.step.chunks, batch.logits_rows, [], isinstance(batch.step, PagedStep),
                         graph=graph)
        out = execute(batch)
        seen.clear()
        run_step(pickle.loads(pickle.dumps(plan)), model, kvc, torch.device("cpu"), mirror)
        assert torch.equal(seen["logits"], out)
        if graph:
            b = graphs.bucket(len(batch.step.chunks))
            assert batch.graph_staged and torch.equal(mirror.inputs[b], graphs.inputs[b])
            replays.append(b)
        return out

    eng.runner.execute = mirrored
    greedy_llm(llm)
    assert 4 in replays and 1 in replays, replays  # a padded bucket (3 requests in 4 lanes) and a full one
