"""Triton ``mhc_post_pre`` (hc_post fused with the next hc_pre) vs the two Triton kernels it fuses.

The fused op must give bitwise the results of ``hc_post`` followed by ``hc_pre`` on the fast path
(new streams, collapsed, post, comb), for bf16 and fp32 streams, at T = 1 … 70, for H whose SPLIT
slices lie in one stream (H % SPLIT == 0) or span two (H % MIX_BLOCK_K == 0 only), and — through
its fallback — for H that is not a multiple of MIX_BLOCK_K. Being bitwise the unfused pair, it is
batch-invariant; that is checked directly too. The torch backend is the oracle's hc_post + hc_pre.
"""

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen, spy_launches  # noqa: E402

from dsv4.model import mhc as ref  # noqa: E402
from dsv4.model.opset import OpSet, reference_ops  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import mhc as tm  # noqa: E402

ITERS, HC_EPS, RMS_EPS = 20, 1e-6, 1e-6


def _inputs(T, n, H, seed, dtype):
    """Streams, sub-layer output, the previous pre's post/comb, and the next pre's hc_* tensors
    (synthetic checkpoint scales: fn ~ N(0, 1/(n·H)), base ~ N(0, 0.5²), scale ~ U(0.5, 1))."""
    g = gen(seed)
    nmix = 2 * n + n * n
    s = (torch.randn(T, n, H, generator=g) * 3.0).to(dtype)
    out = (torch.randn(T, H, generator=g) * 2.0).to(dtype)
    post = 2.0 * torch.sigmoid(torch.randn(T, n, generator=g))
    comb = ref.sinkhorn(torch.softmax(torch.randn(T, n, n, generator=g), -1) + HC_EPS, ITERS, HC_EPS).float()
    fn = torch.randn(nmix, n * H, generator=g) / math.sqrt(n * H)
    base = torch.randn(nmix, generator=g) * 0.5
    scale = torch.rand(3, generator=g) * 0.5 + 0.5
    return tuple(t.to(DEV) for t in (s, out, post, comb, fn, base, scale))


def _pair(s, out, post, comb, fn, base, scale, config=None, norm=None):
    y = tm.hc_post(s, out, post, comb, config=config)
    return (y, *tm.hc_pre(y, fn, base, scale, ITERS, HC_EPS, RMS_EPS, norm, config=config))


def _fused(s, out, post, comb, fn, base, scale, config=None, norm=None):
    return tm.mhc_post_pre(s, out, post, comb, fn, base, scale, ITERS, HC_EPS, RMS_EPS, norm, config=config)


def _assert_same(got, want, what):
    assert len(got) == len(want) == 4
    for name, a, b in zip(("streams", "collapsed", "post", "comb"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name)
        assert torch.equal(a, b), (what, name, (a.double() - b.double()).abs().max().item())


def _spy_fused_launches(monkeypatch) -> list:
    """The grids of every ``_post_mix_kernel`` launch from now on (the launches still run)."""
    return spy_launches(monkeypatch, tm, "_post_mix_kernel")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [256, 96])  # slices within one stream / slices across two streams
def test_post_pre_bitwise_equals_post_then_pre(dtype, H):
    assert tm.fusable(H)
    for T in (1, 3, 37):  # 37: a full and a partial 32-token block
        args = _inputs(T, 4, H, 100 + T + H, dtype)
        _assert_same(_fused(*args), _pair(*args), (dtype, H, T))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_pre_with_the_sublayer_norm_bitwise_equals_post_then_pre(dtype):
    """``norm`` (the next sub-layer's RMSNorm weight): the fused op's normalised rows are hc_post then hc_pre's
    with the same norm, bit for bit, fused and apart (above POST_MIX_FUSED_MAX_T)."""
    w = (torch.rand(256, generator=gen(12)) + 0.5).to(DEV)
    for T in (1, 37):
        args = _inputs(T, 4, 256, 300 + T, dtype)
        want = _pair(*args, norm=w)
        _assert_same(_fused(*args, norm=w), want, (dtype, T))
        _assert_same(_fused(*args, config={"POST_MIX_FUSED_MAX_T": 0}, norm=w), want, (dtype, T, "apart"))


def test_post_pre_wide_h_and_other_tiles():
    """H = 512 (S = 8 slices), and a non-default tile set (the fused op follows the config)."""
    args = _inputs(5, 4, 512, 7, torch.bfloat16)
    _assert_same(_fused(*args), _pair(*args), "H=512")
    cfg = dict(SPLIT=128, MIX_BLOCK_T=16, MIX_BLOCK_K=16)
    args = _inputs(19, 4, 80, 8, torch.float32)
    assert tm.fusable(80, cfg) and not tm.fusable(80)
    _assert_same(_fused(*args, config=cfg), _pair(*args, config=cfg), "config")


def test_post_pre_fallback_when_h_not_a_multiple_of_block_k(monkeypatch):
    """H = 100: no fused launch; the op runs hc_post then hc_pre (bitwise the pair)."""
    assert not tm.fusable(100)
    calls = _spy_fused_launches(monkeypatch)
    for dtype in (torch.bfloat16, torch.float32):
        args = _inputs(6, 4, 100, 9, dtype)
        _assert_same(_fused(*args), _pair(*args), ("fallback", dtype))
    assert not calls
    args = _inputs(3, 4, 64, 10, torch.bfloat16)
    _fused(*args)
    assert len(calls) == 1  # the spy sees the fused launch where H allows it


def test_post_pre_runs_apart_above_fused_max_t(monkeypatch):
    """Above POST_MIX_FUSED_MAX_T tokens (prefill: the two kernels apart were faster on the H200) the op
    launches hc_post then hc_pre, bitwise the fused launch's results; at or below it, one fused launch."""
    calls = _spy_fused_launches(monkeypatch)
    cap = 4
    args = _inputs(cap + 3, 4, 64, 11, torch.bfloat16)
    apart = _fused(*args, config={"POST_MIX_FUSED_MAX_T": cap})
    assert not calls
    fused = _fused(*args, config={"POST_MIX_FUSED_MAX_T": None})
    assert len(calls) == 1
    _assert_same(apart, fused, "apart vs fused")
    _fused(*_inputs(cap, 4, 64, 12, torch.bfloat16), config={"POST_MIX_FUSED_MAX_T": cap})
    assert len(calls) == 2
    assert tm.CONFIG["POST_MIX_FUSED_MAX_T"] == 64  # decode batches fused, prefill apart


def test_post_pre_batch_invariant():
    """A row's four results are the same alone and at any position of batches of 3, 37 and 70."""
    pool, n, H = 70, 4, 256
    args = _inputs(pool, n, H, 21, torch.bfloat16)
    probe = [0, 5, 41, 69]
    alone = [_fused(*(t[r:r + 1] if t.dim() >= 2 and t.shape[0] == pool else t for t in args)) for r in probe]
    g = gen(3)
    for m in (3, 37, 70):
        others = [r for r in torch.randperm(pool, generator=g).tolist() if r not in probe]
        rows = torch.tensor((probe[: min(m, 4)] + others)[:m])
        rows = rows[torch.randperm(m, generator=g)]
        idx = rows.to(DEV)
        got = _fused(*(t[idx] if t.dim() >= 2 and t.shape[0] == pool else t for t in args))
        for k, r in enumerate(probe[: min(m, 4)]):
            pos = int((rows == r).nonzero())
            for a, b in zip(got, alone[k]):
                assert torch.equal(a[pos], b[0]), (m, r, pos)


def test_post_pre_noncontiguous_and_empty():
    s, out, post, comb, fn, base, scale = _inputs(9, 4, 64, 11, torch.float32)
    s_nc = s.transpose(0, 1).contiguous().transpose(0, 1)  # [T, n, H] with stride(1) != H
    out_nc = torch.stack([out, out], -1)[..., 0]  # stride(1) == 2
    args = (s_nc, out_nc, post, comb, fn, base, scale)
    _assert_same(_fused(*args), _pair(s, out.contiguous(), post, comb, fn, base, scale), "noncontiguous")
    empty = _fused(s[:0], out[:0], post[:0], comb[:0], fn, base, scale)
    assert [tuple(t.shape) for t in empty] == [(0, 4, 64), (0, 64), (0, 4), (0, 4, 4)]
    with pytest.raises(ValueError, match="fn must be"):
        _fused(s, out, post, comb, fn[:, :-1], base, scale)
    with pytest.raises(TypeError, match="out dtype"):
        _fused(s, out.to(torch.bfloat16), post, comb, fn, base, scale)


@pytest.mark.parametrize("rows", [False, True])
def test_sinkhorn_as_its_own_launch_gives_the_same_bits(monkeypatch, rows):
    """Where the op branches (a decode graph's capture: ``streams.point``), the post/comb program is a launch of its
    own through the lane fork, the collapse another: the same programs (``pid_h0``), so bitwise the one
    launch's results; post and comb come back pending and every hc_post (this one's and the oracle's)
    resolves them. Here the fork runs in order, as the lane's stream would in a replay. ``rows``: with the norm, the
    collapse in the rows form and the post/comb program as ``_comb_kernel`` (bitwise the loop form's too)."""
    from dsv4.model.branches import Pending, serial_fork
    from dsv4.ops import streams

    monkeypatch.setitem(tm.CONFIG, "NORM_ROWS", rows)
    w = (torch.rand(256, generator=gen(13)) + 0.5).to(DEV)
    for T, norm in ((1, w), (3, None)):
        args = _inputs(T, 4, 256, 400 + T, torch.bfloat16)
        want = _fused(*args, norm=norm, config={"NORM_ROWS": False})
        want_pre = tm.hc_pre(want[0], *args[4:], ITERS, HC_EPS, RMS_EPS, norm, config={"NORM_ROWS": False})
        lanes = []

        start = object()

        def fork(fn, *inputs, lane=0, after=None):
            assert after is start  # from the point before the collapse's launch
            lanes.append(lane)
            return Pending(serial_fork(fn, *inputs, lane=lane).result(), lambda: None)

        monkeypatch.setattr(tm, "SINKHORN_BESIDE", True)
        monkeypatch.setattr(streams, "point", lambda: start)
        monkeypatch.setattr(streams, "fork", fork)
        got = _fused(*args, norm=norm)
        got_pre = tm.hc_pre(want[0], *args[4:], ITERS, HC_EPS, RMS_EPS, norm)
        monkeypatch.undo()
        monkeypatch.setitem(tm.CONFIG, "NORM_ROWS", rows)
        assert lanes == [tm.SINKHORN_LANE] * 2
        assert all(isinstance(v, Pending) for v in (*got[2:], *got_pre[1:]))
        _assert_same([got[0], got[1], got[2].result(), got[3].result()], want, ("beside", T))
        for a, b in zip((got_pre[0], got_pre[1].result(), got_pre[2].result()), want_pre):
            assert torch.equal(a, b), ("hc_pre beside", T)
        out = (torch.randn(T, 256, generator=gen(14)) * 2.0).to(torch.bfloat16).to(DEV)
        pend = (Pending(want[2], lambda: None), Pending(want[3], lambda: None))
        assert torch.equal(tm.hc_post(want[0], out, *pend), tm.hc_post(want[0], out, want[2], want[3]))
        assert torch.equal(ref.hc_post(want[0], out, *pend), ref.hc_post(want[0], out, want[2], want[3]))


@pytest.mark.skipif(DEV != "cuda", reason="a CUDA-graph capture needs the GPU")
@pytest.mark.parametrize("rows", [False, True])
def test_sinkhorn_beside_in_a_graph_replays_the_eager_bits(monkeypatch, rows):
    """Captured in a CUDA graph (streams enabled), mhc_post_pre forks its Sinkhorn onto the lane's stream and
    returns post / comb pending; the replay's four results, joined, equal the eager loop-form op's bit for bit,
    with either collapse form."""
    from dsv4.model.branches import Pending, resolve
    from dsv4.ops import streams

    monkeypatch.setattr(tm, "SINKHORN_BESIDE", True)
    monkeypatch.setitem(tm.CONFIG, "NORM_ROWS", rows)
    w = (torch.rand(4096, generator=gen(15)) + 0.5).to(DEV)
    for T in (1, 8):
        args = _inputs(T, 4, 4096, 500 + T, torch.bfloat16)
        want = _fused(*args, norm=w, config={"NORM_ROWS": False})
        assert not isinstance(want[3], Pending)  # eager: in order, plain tensors
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = _fused(*args, norm=w)
            assert isinstance(got[3], Pending) and streams.lane_stream(w.device, tm.SINKHORN_LANE) is not None
            got = [resolve(v) + 0 for v in got]  # joined on the capture stream
        g.replay()
        torch.cuda.synchronize()
        _assert_same(got, want, ("graph", T))


def test_registry_and_model_function():
    """Registry backends; an op set uses the kernel only with mhc_post and mhc_pre kernels beside it,
    and is otherwise the oracle's hc_post + hc_pre (over the set's own two blocks)."""
    oracle = reference_ops()
    assert resolve("mhc_post_pre", force="mhc=torch")[1] is oracle.mhc_post_pre
    assert resolve("mhc_post_pre", force={"mhc_post_pre": "triton"})[1] is tm.mhc_post_pre
    args = _inputs(5, 4, 64, 12, torch.float32)
    tail = (ITERS, HC_EPS, RMS_EPS)
    y = ref.hc_post(*args[:4])
    want = (y, *oracle.mhc_pre(y, *args[4:], *tail))
    _assert_same(oracle.mhc_post_pre(*args, *tail), want, "oracle")
    _assert_same(ref.hc_post_then_pre(oracle, *args, *tail), want, "torch backend")
    calls = []

    def spy(*a):
        calls.append(1)
        return tm.mhc_post_pre(*a)

    partial = OpSet({"mhc_post_pre": spy})  # the pair it reproduces has no kernels: the oracle
    _assert_same(partial.mhc_post_pre(*args, *tail), want, "partial kernels")
    assert not calls
    fast = OpSet({"mhc_post_pre": spy, "mhc_post": tm.hc_post, "mhc_pre": tm.hc_pre})
    got = fast.mhc_post_pre(*args, *tail)
    pair = ref.hc_post_then_pre(fast, *args, *tail)
    assert calls == [1]
    _assert_same(got, pair, "fast path")


def test_model_forward_with_fused_post_pre_is_bitwise_the_unfused_fast_path(tiny_ckpt):
    """ReferenceModel on the mHC kernels (tiny, bf16): with mhc_post_pre the logits, the streams, the
    per-layer hook's streams and the MTP logits are bitwise those of mhc_post + mhc_pre; the fused
    op runs for every post but each stack's last (2·layers − 1 in the decoder, 1 in an MTP block)."""
    from dsv4.model.model import ReferenceModel
    from dsv4.model.step import SeqChunk

    weights = ReferenceModel(tiny_ckpt, dtype=torch.bfloat16, device=DEV).w
    calls = []

    def spy(*a):
        calls.append(1)
        return tm.mhc_post_pre(*a)

    runs = {}
    for name, ops in (("pair", {"mhc_pre": tm.hc_pre, "mhc_post": tm.hc_post}),
                      ("fused", {"mhc_pre": tm.hc_pre, "mhc_post": tm.hc_post, "mhc_post_pre": spy})):
        model = ReferenceModel(weights, ops=OpSet(ops))
        ids = torch.randint(2, model.cfg.vocab_size, (6,), generator=gen(1)).to(DEV)
        seen = []
        with torch.no_grad():
            out = model.forward(ids, [SeqChunk(model.new_cache(), 0, len(ids))],
                                hook=lambda n, t: seen.append((n, t.clone())))
            mtp = model.mtp_forward(ids[1:], out.streams[:-1], [SeqChunk(model.new_cache(), 0, len(ids) - 1)]).logits
        runs[name] = (out.logits, out.streams, seen, mtp)
    assert len(calls) == 2 * model.cfg.num_hidden_layers - 1 + 1
    (la, sa, ha, ma), (lb, sb, hb, mb) = runs["pair"], runs["fused"]
    assert torch.equal(la, lb) and torch.equal(sa, sb) and torch.equal(ma, mb)
    assert [n for n, _ in ha] == [n for n, _ in hb] == [f"layers.{i}" for i in range(model.cfg.num_hidden_layers)]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ha, hb))
