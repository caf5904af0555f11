"""The model's concurrent branches on CUDA side streams (``dsv4.ops.streams``): a branch runs on its
lane's stream and its result is complete where it is joined; an engine whose decode graphs hold the
branches as parallel paths gives the logits of one that runs them in order, bitwise."""

import pytest
import torch
from step_control import add, decode_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_fork_runs_on_the_lane_stream_in_a_capture_and_join_orders_the_main_stream():
    """In a CUDA-graph capture a branch is issued on its lane's stream and the join orders the main
    stream after it (the replay's result is the eager one); eager, and past MAX_TOKENS, it runs in order
    on the main stream."""
    from dsv4.ops import streams

    a = torch.randn(2048, 2048, device="cuda")
    x = torch.randn(streams.MAX_TOKENS, 2048, device="cuda")  # as many rows as still branch
    seen = []

    def slow(t):  # long enough that an unjoined read would see it unfinished
        seen.append(torch.cuda.current_stream())
        for _ in range(20):
            t = torch.tanh(t @ a) * 0.5
        return t

    main = torch.cuda.current_stream()
    want = slow(x)
    assert streams.fork(slow, x, lane=1).result() is not None and seen[-1] == main  # eager: in order
    assert streams.fork(lambda t: torch.cuda.current_stream(), a).result() == main  # past MAX_TOKENS
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p = streams.fork(slow, x, lane=1)
        assert seen[-1] == streams.lane_stream(a.device, 1)
        got = p.result() + 0.0  # on the capture stream, after the join
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_fork_after_an_earlier_point_and_wait_from_another_lane():
    """``fork(after=point)``: the branch starts from the point (issued after the main path's later work, it
    reads only what came before the point); a branch on a third lane ``wait``s for it; the replay's values
    are the eager ones and every lane is joined (the capture ends)."""
    from dsv4.ops import streams

    a = torch.randn(1024, 1024, device="cuda")
    x = torch.randn(8, 1024, device="cuda")

    def chain(t, n=10):
        for _ in range(n):
            t = torch.tanh(t @ a) * 0.5
        return t

    def run():
        start = streams.fork.point()
        main = chain(x * 2.0)  # the critical path, issued before the branch
        first = streams.fork(chain, x, lane=1, after=start)
        second = streams.fork(lambda t: chain(t + first.wait()), x, lane=2)
        return main + second.result() + first.result()

    want = run()  # eager: in order
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = run()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("former_forms", [False, True])
def test_decode_graphs_with_branches_equal_in_order(flash_width_ckpt, monkeypatch, former_forms):
    """Real widths (split-K GEMMs in the branches and beside them, the indexer over real entries):
    decode-graph replays at batch 1 and 4 with the branches as parallel paths give the bits of graphs
    captured in order. ``former_forms``: the in-order graphs with the mHC collapse's loop form and its Sinkhorn in
    the gate launch (``NORM_ROWS`` and ``SINKHORN_BESIDE`` off): the defaults' rows form, with the Sinkhorn beside
    on lane 3, gives their bits (bf16 streams)."""
    from dsv4.engine.engine import EngineConfig, LLMEngine
    from dsv4.ops import streams
    from dsv4.ops.triton import mhc

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 120000, (n,), generator=g).tolist() for n in (200, 120, 61, 250)]
    rows, beside = mhc.CONFIG["NORM_ROWS"], mhc.SINKHORN_BESIDE

    def run(enabled):
        monkeypatch.setitem(mhc.CONFIG, "NORM_ROWS", rows and (enabled or not former_forms))
        monkeypatch.setattr(mhc, "SINKHORN_BESIDE", beside and (enabled or not former_forms))
        monkeypatch.setattr(streams, "ENABLED", enabled)
        eng = LLMEngine(EngineConfig(model=str(flash_width_ckpt), kv_cache_dtype="fp8_ds_mla", max_model_len=1024,
                                     max_num_seqs=8, kv_cache_memory=4 << 30, enable_prefix_caching=False,
                                     async_scheduling=False))
        assert eng.runner.graphs is not None
        out = []
        for b in (1, 4):
            reqs = [add(eng, p) for p in prompts[:b]]
            out += decode_logits(eng, reqs[0], reqs[1:], 5, target_at=b // 2)
            for r in reqs:
                eng.abort_request(r.request_id)
        return out

    in_order, branched = run(False), run(True)
    assert streams._streams, "no branch ran on a side stream"
    for s, (x, y) in enumerate(zip(in_order, branched)):
        assert torch.isfinite(x).all() and torch.equal(x, y), f"step {s}: max |Δ| {(x - y).abs().max().item():.3g}"
