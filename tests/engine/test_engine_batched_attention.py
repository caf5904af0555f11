"""The engine's batched paged attention (``dsv4.engine.paged_attention``) with the torch ops.

This is the path the GPU uses (with Triton ops); here its torch ops run it on CPU. It must give
the reference path's greedy tokens and logprobs bitwise — same stored bytes, same oracle math per
query — through prompts that cross every page/window/block boundary while decoding, with chunked
prefill mixing prefill chunks and decodes in a step, in both cache dtypes; and a request's decode
logits must not depend on the batch it is in.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import BOUNDARY_LENGTHS, BOUNDARY_NEW_TOKENS, greedy, make_llm, rand_prompts, signature
from step_control import add, decode_logits

DTYPES = ("auto", "fp8_ds_mla")


# every boundary length with the FP8 cache; with 'auto' (same code, dense pages) the ones that
# cross the window, the HCA ratio and the block end while decoding (CPU time)
LENGTHS = {"fp8_ds_mla": BOUNDARY_LENGTHS, "auto": (5, 126, 255, 300)}


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_batched_equals_reference_path(tiny_ckpt, kv_dtype):
    lengths = LENGTHS[kv_dtype]
    prompts = rand_prompts(5, lengths)
    params = greedy(BOUNDARY_NEW_TOKENS)
    ref = make_llm(tiny_ckpt, kv_dtype, max_num_batched_tokens=100, attention="reference")
    fast = make_llm(tiny_ckpt, kv_dtype, max_num_batched_tokens=100, attention="batched", backend="torch")
    assert not ref.engine.runner.paged_attention and fast.engine.runner.paged_attention
    want = [signature(o) for o in ref.generate(prompts, params)]
    got = [signature(o) for o in fast.generate(prompts, params)]
    for n, w, g in zip(lengths, want, got):
        assert w == g, f"prompt of {n} tokens: batched path {g} != reference {w}"


def test_batched_decode_is_batch_invariant(tiny_ckpt):
    from dsv4.engine.engine import EngineConfig, LLMEngine

    def engine():
        return LLMEngine(EngineConfig(model=str(tiny_ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=1024,
                                      max_num_seqs=8, kv_cache_memory=256 << 20, enable_prefix_caching=False,
                                      attention="batched", backend="torch", async_scheduling=False))

    target = rand_prompts(9, [254])[0]  # decoding crosses the 256-token block end and HCA/CSA entries
    e1 = engine()
    alone = decode_logits(e1, add(e1, target), [], 4)
    e2 = engine()
    t = add(e2, target)
    others = [add(e2, p) for p in rand_prompts(10, [30, 127, 300])]
    together = decode_logits(e2, t, others, 4, target_at=2)
    for s, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(a, b), f"decode step {s}: max |Δ| {(a - b).abs().max().item():.3g}"


def test_decode_graph_inputs_with_spare_lanes(tiny_ckpt):
    """The CUDA-graph decode path's static inputs, emulated eagerly on CPU: steps padded to a bucket
    with spare lanes (spare page/block/slot, position 0) and compressed-entry lists as wide as
    max_model_len give the same tokens and logprobs as the unpadded batched path, and leave every
    request's pages as the unpadded path leaves them."""
    from dsv4.engine.cuda_graphs import DecodeGraphs

    prompts = rand_prompts(21, [30, 126, 254])
    params = greedy(6)
    plain = make_llm(tiny_ckpt, "fp8_ds_mla", attention="batched", backend="torch", max_num_seqs=8)
    want = [signature(o) for o in plain.generate(prompts, params)]
    padded = make_llm(tiny_ckpt, "fp8_ds_mla", attention="batched", backend="torch", max_num_seqs=8)
    eng = padded.engine
    graphs = DecodeGraphs(eng.model, eng.kv_cache, 8, eng.max_model_len)
    graphs.capture()
    assert graphs.buckets == [1, 2, 4, 8]
    used, staged = [], []
    run = graphs.run
    graphs.run = lambda batch: used.append(graphs.bucket(len(batch.step.chunks))) or staged.append(batch.graph_staged) \
        or run(batch)
    eng.runner.graphs = graphs
    got = [signature(o) for o in padded.generate(prompts, params)]
    assert 4 in used, f"no padded decode step ran (buckets used: {used})"
    assert all(staged), "a decode step's inputs were not staged straight into the graph's tensors"
    assert got == want
    # the copy-in path (a TP worker's replay: tables built elsewhere, then ``load``ed) gives the same
    unstaged = make_llm(tiny_ckpt, "fp8_ds_mla", attention="batched", backend="torch", max_num_seqs=8)
    eng = unstaged.engine
    graphs = DecodeGraphs(eng.model, eng.kv_cache, 8, eng.max_model_len)
    graphs.capture()
    eng.runner.graphs = graphs
    eng.runner._stage_for_graph = lambda *a: None
    assert [signature(o) for o in unstaged.generate(prompts, params)] == want


def _one_by_one_reference_and_batched(ckpt, prompts, params, chunk: int):
    """The prompts' signatures generated one after the other in ``chunk``-token prefill chunks by the
    reference path (no prefix cache) and by the batched path (prefix cache on, so a later prompt can
    hit an earlier one's blocks): (want, got, the batched LLM)."""
    ref = make_llm(ckpt, "fp8_ds_mla", max_num_batched_tokens=chunk, attention="reference",
                   enable_prefix_caching=False)
    want = [signature(ref.generate([p], params)[0]) for p in prompts]
    fast = make_llm(ckpt, "fp8_ds_mla", max_num_batched_tokens=chunk, attention="batched", backend="torch")
    return want, [signature(fast.generate([p], params)[0]) for p in prompts], fast


def test_batched_prefill_with_prefix_cache_hit_equals_reference(tiny_ckpt):
    """Prefill chunks pool their compressed entries from the step's own state rows and the ring, and
    hold the rows for the block-boundary snapshot a later prefix-cache hit restores: a prompt that
    hits another's first block, in 100-token chunks, gives the reference path's tokens bitwise."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 1000, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 70)]
    want, got, fast = _one_by_one_reference_and_batched(tiny_ckpt, prompts, greedy(12), chunk=100)
    assert fast.engine.kv.hits >= 256  # the second prompt hit the first's block
    assert got == want


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_batched_with_hooks_equals_fused(tiny_ckpt, kv_dtype):
    """With validation hooks installed the batched path computes the window KV unfused (the hooks see
    it) and stores it with kv_insert; without them kv_norm_rope_insert does all three: same tokens."""
    prompts = rand_prompts(31, [30, 129])
    params = greedy(3)
    plain = make_llm(tiny_ckpt, kv_dtype, attention="batched", backend="torch")
    want = [signature(o) for o in plain.generate(prompts, params)]
    hooked = make_llm(tiny_ckpt, kv_dtype, attention="batched", backend="torch")
    seen = set()
    hooked.engine.model.set_hooks(lambda name, t: seen.add(name) if name.endswith("k_window") else None)
    got = [signature(o) for o in hooked.generate(prompts, params)]
    n_layers = len(hooked.engine.model.blocks)
    assert {f"layers.{i}.attn.k_window" for i in range(n_layers)} <= seen
    assert got == want


def test_block_boundary_snapshot_reads_the_ring_and_the_held_chunk(tiny_ckpt, monkeypatch):
    """After each forward, ``advance`` snapshots every closed block's last state rows (what a later
    prefix-cache hit restores) from positions known on the host, so it never waits on the device. In
    254-token chunks the block ending at 256 takes rows 252, 253 from the ring and 254, 255 from the
    chunk still held: the rows equal ``read_state``'s, and a prompt that hits that block later gives
    the reference path's tokens."""
    from dsv4.cache.paged import PagedSequenceView

    orig = PagedSequenceView._rows_at
    mixed = []

    def spy(self, key, positions):
        got = orig(self, key, positions)
        pos = torch.arange(positions.start, positions.stop, device=got.device)
        assert torch.equal(got, self.read_state(key[0], key[1], pos))
        start = self._chunk.get(key, (None, None))[0]
        mixed.append(start is not None and positions.start < start < positions.stop)
        return got

    monkeypatch.setattr(PagedSequenceView, "_rows_at", spy)
    g = torch.Generator().manual_seed(8)
    shared = torch.randint(3, 1000, (520,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 40)]
    want, got, fast = _one_by_one_reference_and_batched(tiny_ckpt, prompts, greedy(4), chunk=254)
    assert any(mixed), "no snapshot took rows from both the ring and the held chunk"
    assert fast.engine.kv.hits >= 256
    assert got == want


def test_decode_graphs_only_with_graph_safe_ops():
    """The torch attention ops check page bounds on the host (a sync stream capture forbids): with
    them a CUDA engine decodes eagerly instead of failing at capture; kernel ops are captured."""
    from dsv4.engine.engine import _graph_capturable
    from dsv4.model.opset import ATTENTION_OPS, OpSet
    from dsv4.ops import resolve_op_set

    torch_ops = resolve_op_set("torch", "batched", "cpu")
    assert torch_ops.paged_attention and not _graph_capturable(torch_ops)

    def kernel(*a):
        return None

    kernel.__module__ = "dsv4.ops.triton.sparse_attention"
    assert _graph_capturable(OpSet({op: kernel for op in ATTENTION_OPS}))
    assert not _graph_capturable(OpSet())  # no batched attention: nothing to capture


def test_deferred_branches_give_the_same_tokens(tiny_ckpt, monkeypatch):
    """The batched attention's concurrent branches (the compressors and the window KV insert on one
    lane, the indexer's compressor and the indexer on another, ``PagedAttention.attend``) run as late
    as their joins allow (``DeferredLanes``): the in-order tokens and logprobs bitwise, through prefill
    chunks, decodes and the CSA/HCA entries they close, and every branch joined."""
    from deferred_lanes import DeferredLanes

    from dsv4.model import branches

    prompts = rand_prompts(23, [30, 126, 254])
    params = greedy(6)
    want = [signature(o) for o in make_llm(tiny_ckpt, "fp8_ds_mla", attention="batched", backend="torch",
                                           max_num_batched_tokens=100).generate(prompts, params)]
    lanes = DeferredLanes()
    monkeypatch.setattr(branches, "serial_fork", lanes)  # the op set's default fork
    llm = make_llm(tiny_ckpt, "fp8_ds_mla", attention="batched", backend="torch", max_num_batched_tokens=100)
    assert llm.engine.model.ops.fork is lanes
    got = [signature(o) for o in llm.generate(prompts, params)]
    assert lanes.forks > 0 and lanes.unjoined() == 0
    assert got == want
