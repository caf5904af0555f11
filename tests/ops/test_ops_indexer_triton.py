"""Lightning Indexer over the paged cache: Triton kernel vs the torch op vs the oracle.

Tolerance of the logits. Both sides compute logit[t,e] = Σ_h w_h·ReLU(Σ_d q_hd·k_ed) in fp32 from
the same operands (FP8 pages: q and k are FP8 × 2^k, exact in bf16 and fp32; dense pages: the same
fp32/bf16 values), so they differ only by summation order: a 128-term dot, one multiply by w and an
Hi-term head sum, ≤ (129 + Hi)·u·Σ_h|w_h|Σ_d|q_hd k_ed| per side (ReLU is 1-Lipschitz, the key
scale is an exact power of two). u = 2^-23 instead of 2^-24 covers tensor-core adders that
truncate, and the two sides add up: tol = (129 + Hi)·2^-22·Σ|terms|. Any real error (a wrong
page, scale, format, or bf16-rounded operand: 2^-9) is orders of magnitude above it.
The top-k is checked against the reference logits with the same tolerance: every picked entry
must be within tol of beating every unpicked visible one, which forces the exact set wherever the
k-th/(k+1)-th margin is clear; exact ties are tested on their own (ties go to the lowest index).
"""

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

from dsv4.formats import FNUZ, OCP, alloc_indexer_pages, fake_quant_fp8_pow2, fake_quant_indexer_k, write_indexer_k  # noqa: E402
from dsv4.model.linear import stable_topk  # noqa: E402
from dsv4.ops import torch_indexer as ref  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import indexer as tri  # noqa: E402

D = 128
MODES = {"ocp": OCP, "fnuz": FNUZ, "dense_fp32": torch.float32, "dense_bf16": torch.bfloat16}


def _case(mode, seed, entries=(150, 40, 0), heads=8, epb=64, queries=None):
    """Pages with garbage everywhere, the sequences' keys written at random pages; query tokens
    with the given n_visible per sequence. Returns a dict of device tensors + float64 keys."""
    g = gen(seed)
    fmt = MODES[mode] if mode in ("ocp", "fnuz") else None
    nblk = [math.ceil(n / epb) for n in entries]
    n_pages = sum(nblk) + 2
    ids = torch.randperm(n_pages, generator=g)
    table = torch.full((len(entries), max(1, max(nblk))), -1, dtype=torch.long)
    pos = 0
    for s, nb in enumerate(nblk):
        table[s, :nb] = ids[pos: pos + nb]
        pos += nb
    if fmt is not None:
        pages = alloc_indexer_pages(n_pages, epb)
        garbage = torch.randint(0, 256, pages.shape, generator=g, dtype=torch.uint8)
        pages.copy_(garbage)  # stale bytes (NaN codes and scales included) must never be read
    else:
        pages = (torch.randn(n_pages, epb, D, generator=g) * 1e3).to(MODES[mode])
    keys = []
    for s, n in enumerate(entries):
        k = torch.randn(n, D, generator=g) * 2.0 ** torch.randint(-6, 7, (n, 1), generator=g).float()
        e = torch.arange(n)
        blk, off = table[s, e // epb], e % epb
        if fmt is not None:
            write_indexer_k(pages, blk, off, k, fmt, epb)
            keys.append(fake_quant_indexer_k(k, fmt).double())
        else:
            pages[blk, off] = k.to(pages.dtype)
            keys.append(pages[blk, off].double())
    if queries is None:  # n_visible per sequence: all, all-1, < k, 0 ...
        queries = [(0, entries[0]), (1, entries[1]), (0, 3), (2, 0), (0, 64), (1, 1), (0, entries[0] - 1),
                   (1, 0), (0, 33)]
    seq_ids = torch.tensor([s for s, _ in queries])
    n_vis = torch.tensor([v for _, v in queries])
    t = len(queries)
    q = torch.randn(t, heads, D, generator=g) * 2.0 ** torch.randint(-3, 4, (t, heads, 1), generator=g).float()
    if fmt is not None:  # as the model does: bf16, then FP8 with one power-of-two scale per (token, head)
        q = fake_quant_fp8_pow2(q.to(torch.bfloat16).float(), D, fmt)
    w = torch.randn(t, heads, generator=g) * (heads ** -0.5) * (D ** -0.5)
    return dict(q=q.to(DEV), w=w.to(DEV), seq_ids=seq_ids.to(DEV), n_vis=n_vis.to(DEV), pages=_to_dev(pages, epb),
                table=table.to(DEV), epb=epb, fmt=fmt, keys=keys, heads=heads)


def _to_dev(pages, epb):
    """Pages on DEV keeping the real block stride (a plain .to() would pack the rows)."""
    if pages.dtype != torch.uint8:
        return pages.to(DEV)
    out = alloc_indexer_pages(pages.shape[0], epb, DEV)
    out.copy_(pages)
    assert out.stride(0) == pages.stride(0) > pages.shape[1]
    return out


def _args(c, n_cols):
    return (c["q"], c["w"], c["seq_ids"], c["n_vis"], c["pages"], c["table"], c["epb"], n_cols)


def _tolerance(c, n_cols):
    """[T, n_cols] float64 bound (129 + Hi)·2^-22·Σ_h|w|Σ_d|q k| (0 where invisible)."""
    q, w = c["q"].double().cpu(), c["w"].double().cpu()
    tol = torch.zeros(q.shape[0], n_cols, dtype=torch.float64)
    for t in range(q.shape[0]):
        k = c["keys"][int(c["seq_ids"][t])]
        n = min(int(c["n_vis"][t]), n_cols)
        if n:
            tol[t, :n] = (w[t].abs()[:, None] * (q[t].abs() @ k[:n].abs().T)).sum(0)
    return (129 + c["heads"]) * 2.0 ** -22 * tol


def _check_logits(y, r, tol):
    y, r = y.cpu().double(), r.cpu().double()
    inv = torch.isinf(r)
    assert torch.equal(inv, torch.isinf(y)) and bool((r[inv] < 0).all()), "−inf mask differs"
    assert bool(torch.isfinite(y[~inv]).all()), "non-finite logits at visible entries"
    d = (y - r).abs().masked_fill(inv, 0.0)
    bad = d > tol
    assert not bool(bad.any()), (f"{int(bad.sum())} logits off; max |diff| {d.max():.3g}, "
                                 f"max diff/tol {(d / (tol + 1e-300)).max():.3g}")


def _check_topk_sets(idx, r, tol, n_vis, k):
    """The picked set S is a top-k of logits within tol of the reference:
    min over e∈S of (r+tol)[e] ≥ max over visible f∉S of (r−tol)[f]. Where the reference's
    k-th/(k+1)-th margin is clear this forces the exact set; at (near) ties either side is right."""
    r, idx, tol = r.cpu().double(), idx.cpu(), tol.cpu()
    for t in range(r.shape[0]):
        nv = min(int(n_vis[t]), r.shape[1])
        got = idx[t]
        m = min(nv, k)
        assert bool((got[m:] == -1).all()) and bool((got[:m] >= 0).all()), f"row {t}: −1 padding (n_visible {nv})"
        picked = got[:m]
        assert len(set(picked.tolist())) == m and bool((picked < nv).all()), f"row {t}: picks {picked.tolist()}"
        rest = torch.ones(nv, dtype=torch.bool)
        rest[picked] = False
        if m and bool(rest.any()):
            lo = (r[t, picked] + tol[t, picked]).min()
            hi = (r[t, :nv][rest] - tol[t, :nv][rest]).max()
            assert lo >= hi, f"row {t}: a picked entry is clearly below an unpicked one ({lo} < {hi})"


@pytest.mark.parametrize("mode", list(MODES))
def test_logits_and_topk_vs_torch_reference(mode):
    c = _case(mode, seed=11 + list(MODES).index(mode))
    n_cols, k = 320, 32  # wider than any n_visible (150): the extra columns are −inf
    r = ref.indexer_logits(*_args(c, n_cols), c["fmt"])
    y = tri.indexer_logits(*_args(c, n_cols), c["fmt"])
    assert y.shape == (c["q"].shape[0], n_cols) and y.dtype == torch.float32
    tol = _tolerance(c, n_cols)
    _check_logits(y, r, tol)
    # the op as the engine calls it, through the registry
    name, op = resolve("indexer", force={"indexer": "triton"})
    assert name == "triton"
    idx = op(*_args(c, n_cols), k, c["fmt"])
    assert idx.shape == (c["q"].shape[0], k) and idx.dtype == torch.int64
    _check_topk_sets(idx, r, tol, c["n_vis"], k)
    _, op_ref = resolve("indexer", force={"indexer": "torch"})
    assert torch.equal(op_ref(*_args(c, n_cols), k, c["fmt"]).cpu(), ref.indexer_topk(r, k).cpu())


@pytest.mark.parametrize("mode", ["ocp", "dense_fp32"])
def test_weight_scales_apply_where_the_op_reads_the_weights(mode):
    """The head weights as the GEMM leaves them (bf16) with ``weight_scales`` give, in each backend, the same
    logits bits as the weights scaled beforehand by the model's formula (fp32, then each factor in turn)."""
    c = _case(mode, seed=41)
    w16 = c["w"].to(torch.bfloat16)
    scales = (64 ** -0.5, 128 ** -0.5)
    assert torch.equal(ref.scaled_weights(w16, scales), w16.float() * scales[0] * scales[1])
    pre = {**c, "w": ref.scaled_weights(w16, scales)}
    for mod in (ref, tri):
        got = mod.indexer_logits(*_args({**c, "w": w16}, 192), c["fmt"], weight_scales=scales)
        assert torch.equal(got, mod.indexer_logits(*_args(pre, 192), c["fmt"])), mod.__name__
    k = 16
    got = tri.paged_indexer_topk(*_args({**c, "w": w16}, 192), k, c["fmt"], ascending=True, weight_scales=scales)
    assert torch.equal(got, tri.paged_indexer_topk(*_args(pre, 192), k, c["fmt"], ascending=True))
    with pytest.raises(ValueError, match="weight_scales"):
        tri.indexer_logits(*_args(c, 192), c["fmt"], weight_scales=(1.0, 2.0, 3.0))


@pytest.mark.parametrize("heads", [12, 64])
def test_multi_page_tiles_and_narrow_block_table(heads):
    """16 entries per page (a 64-entry tile spans 4 pages); n_cols beyond the table's width;
    Hi = 12 (padded to 16 in-kernel) and Hi = 64 (the real model)."""
    c = _case("ocp", seed=5, entries=(70, 20), epb=16, heads=heads,
              queries=[(0, 70), (1, 20), (0, 17), (1, 16), (0, 0)])
    n_cols = 192  # 12 blocks of 16 > the 5 columns of the block table
    r = ref.indexer_logits(*_args(c, n_cols), c["fmt"])
    y = tri.indexer_logits(*_args(c, n_cols), c["fmt"])
    _check_logits(y, r, _tolerance(c, n_cols))


def _select(c, rows):
    """The case restricted to some query tokens (same pages and tables)."""
    rows = torch.tensor(rows, device=DEV)
    return {**c, **{key: c[key][rows] for key in ("q", "w", "seq_ids", "n_vis")}}


@pytest.mark.parametrize("mode", ["ocp", "dense_fp32"])
def test_batch_invariance_bitwise(mode):
    queries = [(0, 60), (1, 200), (2, 130), (1, 7), (0, 0), (2, 64), (1, 129)] * 2
    c = _case(mode, seed=3, entries=(60, 200, 130), queries=queries)
    c["q"], c["w"] = c["q"][:7].repeat(2, 1, 1), c["w"][:7].repeat(2, 1)  # two copies of 7 tokens
    fmt = c["fmt"]
    full = tri.indexer_logits(*_args(c, 256), fmt)
    for cfg in ({"TILES": 1}, {"TILES": 4}):  # how many tiles one program walks
        assert torch.equal(tri.indexer_logits(*_args(c, 256), fmt, config=cfg), full), cfg
    for t in (1, 3, 5):
        alone = tri.indexer_logits(*_args(_select(c, [t]), 256), fmt)
        assert torch.equal(alone[0], full[t]), f"token {t} alone differs from the batch"
        assert torch.equal(full[t], full[t + 7])
        wide = tri.indexer_logits(*_args(_select(c, [t]), 320), fmt)
        assert torch.equal(wide[:, :256], alone) and bool((wide[:, 256:] == float("-inf")).all())
    few = _select(c, [0, 3, 4, 5])  # n_visible 60, 7, 0, 64: n_cols 64 vs 256
    a64 = tri.indexer_logits(*_args(few, 64), fmt)
    a256 = tri.indexer_logits(*_args(few, 256), fmt)
    assert torch.equal(a64, a256[:, :64]) and bool((a256[:, 64:] == float("-inf")).all())


class _Weights(dict):
    """The two indexer weights; every other tensor the Attention constructor names is a stub."""

    def __missing__(self, key):
        return torch.zeros(1)


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
def test_torch_op_reproduces_the_oracle(cache_dtype):
    """Attention.indexer_topk over a PagedSequenceView == the torch op over the same pages
    (bitwise, also with wider n_cols); the Triton op agrees wherever the margins allow."""
    from dsv4.cache.paged import CacheAllocation, CacheBudget, PagedKVCache, PagedSequenceView
    from dsv4.checkpoint.synthetic import build_config
    from dsv4.config import config_from_dict
    from dsv4.model.attention import Attention
    from dsv4.model.cache import CacheNumerics
    from dsv4.model.linear import linear
    from dsv4.model.opset import reference_ops
    from dsv4.model.rope import apply_rope, cos_sin
    from dsv4.model.step import SeqChunk

    cfg = config_from_dict(build_config("tiny"))
    layer, h = 1, cfg.index_n_heads  # layer 1 is CSA
    g = gen(31)
    p = f"layers.{layer}.attn.indexer"
    attn = Attention(_Weights({f"{p}.wq_b.weight": torch.randn(h * D, cfg.q_lora_rank, generator=g) * 0.1,
                               f"{p}.weights_proj.weight": torch.randn(h, cfg.hidden_size, generator=g) * 0.1}),
                     layer, cfg, reference_ops())
    numerics = CacheNumerics(cache_dtype)
    kvc = PagedKVCache(cfg, numerics, CacheBudget(6, 2, 1, 0, 0, 0), torch.float32)
    view = PagedSequenceView(kvc, CacheAllocation(blocks=[4, 1, 3], swa=[0, 1], slot=0))
    n = 150
    view.write_compressed(layer, "index", torch.arange(n), torch.randn(n, D, generator=g))
    chunk = SeqChunk(cache=view, start=560, length=40)  # n_visible 140..150
    x = torch.randn(chunk.length, cfg.hidden_size, generator=g)
    qr = torch.randn(chunk.length, cfg.q_lora_rank, generator=g)
    want = attn.indexer_topk(x, qr, chunk, n)
    # the op's inputs, formed as the model forms them
    pos = chunk.positions
    q = linear(qr, attn.idx_wq_b).view(chunk.length, h, D)
    q = apply_rope(q, *cos_sin(cfg.rope_compress, pos)).float()
    wts = linear(x, attn.idx_weights).float() * (h ** -0.5) * (D ** -0.5)
    fmt = numerics.fmt if numerics.quantized else None
    if fmt is not None:
        q = fake_quant_fp8_pow2(q.to(torch.bfloat16).float(), D, fmt)
    key = (layer, "index")
    k = min(cfg.index_topk, n)
    args = [q, wts, torch.zeros(chunk.length, dtype=torch.long), (pos + 1) // 4, kvc.comp[key],
            torch.tensor([[4, 1, 3]]), kvc.per_block(key)]
    for n_cols in (192, 256):
        assert torch.equal(ref.paged_indexer_topk(*args, n_cols, k, fmt), want), n_cols
    r = ref.indexer_logits(*args, 192, fmt)
    c = dict(q=q, w=wts, seq_ids=args[2], n_vis=args[3], heads=h,
             keys=[view.read_compressed(layer, "index", torch.arange(n)).double()])
    dev_args = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    dev_args[4] = _to_dev(args[4], kvc.per_block(key))
    y = tri.indexer_logits(*dev_args, 192, fmt)
    tol = _tolerance(c, 192)
    _check_logits(y, r, tol)
    _check_topk_sets(tri.indexer_topk(y, k), r, tol, args[3], k)


def test_topk_ties_go_to_the_lowest_index():
    g = gen(21)
    # constructed exact ties: few distinct values, +0 / −0, −inf (invisible) columns
    vals = torch.tensor([1.5, 0.0, -0.0, -2.0, 1.5, float("-inf")])
    logits = vals[torch.randint(0, len(vals), (9, 200), generator=g)]
    logits[3] = 0.0
    logits[4, :] = -0.0
    logits[4, 7::13] = 0.0
    logits[5] = float("-inf")
    logits = logits.to(DEV)
    for k in (1, 7, 64, 200, 260):
        a = tri.indexer_topk(logits, k).cpu()
        b = ref.indexer_topk(logits, k).cpu()
        assert torch.equal(a, b), f"k={k}"
        kk = min(k, 200)
        s = stable_topk(logits.cpu(), kk)
        s = torch.where(torch.gather(logits.cpu(), 1, s) == float("-inf"), -1, s)
        assert torch.equal(a[:, :kk], s) and bool((a[:, kk:] == -1).all())
    assert torch.equal(tri.indexer_topk(logits, 5)[3].cpu(), torch.arange(5))  # all-zero row: 0..4
    assert bool((tri.indexer_topk(logits, 5)[5] == -1).all())


def test_ties_from_duplicated_and_zero_keys_end_to_end():
    """Pages holding 4 distinct keys, copied, plus all-zero keys: duplicated keys give bitwise equal
    logits in the kernel, and the top-k keeps the lowest entry of every tie (as the torch op)."""
    g = gen(8)
    epb, n, heads = 64, 192, 8
    base = torch.randn(4, D, generator=g)
    keys = torch.cat([base, torch.zeros(1, D)])[torch.randint(0, 5, (n,), generator=g)]
    pages = alloc_indexer_pages(4, epb)
    table = torch.tensor([[2, 0, 3]])
    e = torch.arange(n)
    write_indexer_k(pages, table[0, e // epb], e % epb, keys, OCP, epb)
    q = fake_quant_fp8_pow2(torch.randn(3, heads, D, generator=g).to(torch.bfloat16).float(), D, OCP)
    w = torch.randn(3, heads, generator=g)
    w[2] = -w[2].abs()  # every logit ≤ 0: zero keys give −0 = +0 ties among the largest
    n_vis = torch.tensor([192, 100, 192], device=DEV)
    args = (q.to(DEV), w.to(DEV), torch.zeros(3, dtype=torch.long, device=DEV), n_vis, _to_dev(pages, epb),
            table.to(DEV), epb, 256)
    y = tri.indexer_logits(*args, OCP).cpu()
    for t in range(3):
        for j in range(5):
            same = (keys == torch.cat([base, torch.zeros(1, D)])[j]).all(1).nonzero().squeeze(1)
            same = same[same < int(args[3][t])]
            assert bool((y[t, same] == y[t, same[0]]).all()), f"token {t}: duplicated keys score differently"
    k = 40
    got = tri.paged_indexer_topk(*args, k, OCP).cpu()
    want = ref.paged_indexer_topk(*args, k, OCP).cpu()
    assert torch.equal(got, want)


def test_fewer_visible_than_k_pads_with_minus_one():
    c = _case("fnuz", seed=4, entries=(20, 5), queries=[(0, 20), (1, 5), (0, 0), (1, 1)])
    for op in (tri.paged_indexer_topk, ref.paged_indexer_topk):
        idx = op(*_args(c, 64), 32, c["fmt"]).cpu()
        assert idx.shape == (4, 32)
        for t, nv in enumerate((20, 5, 0, 1)):
            assert sorted(idx[t, :nv].tolist()) == list(range(nv)) and bool((idx[t, nv:] == -1).all())
        wide = op(*_args(c, 64), 100, c["fmt"]).cpu()  # k > n_cols: still k columns
        assert wide.shape == (4, 100) and bool((wide[:, 64:] == -1).all())


def test_errors_name_the_wrong_argument():
    c = _case("ocp", seed=1, entries=(10,), queries=[(0, 10)])
    with pytest.raises(ValueError, match="q must be"):
        tri.indexer_logits(c["q"][:, :, :64], *_args(c, 64)[1:], OCP)
    with pytest.raises(ValueError, match="weights must be"):
        tri.indexer_logits(c["q"], c["w"][:, :3], *_args(c, 64)[2:], OCP)
    with pytest.raises(ValueError, match="FP8 indexer pages"):
        tri.indexer_logits(*_args(c, 64)[:4], c["pages"][:, :100], *_args(c, 64)[5:], OCP)
    with pytest.raises(ValueError, match="dense indexer pages"):
        tri.indexer_logits(*_args(c, 64), None)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        tri.indexer_logits(*_args(c, 64), "e5m2")


@pytest.mark.parametrize("n,k,rows", [(64, 512, 4), (600, 512, 4), (2048, 512, 3), (200, 40, 5), (1, 1, 2),
                                      (64, 8, 6)])
def test_select_topk_ascending_equals_topk_then_sort(n, k, rows):
    """The selection kernel gives the set of ``indexer_topk``'s picks in ascending order, exactly:
    many tied maxima (small integers), −inf tails (invisible columns), NaN (above +inf, as torch.sort),
    −0 against +0 ties, k above and below the row width; then fresh normal logits."""
    g = gen(50 + n)
    x = torch.randint(-3, 3, (rows, n), generator=g).float()
    x[0, : n // 2] = float("-inf")
    x[1, 3 % n] = x[1, 5 % n] = float("nan")
    if rows > 2:
        x[2] = 0.0
        x[2, ::3] = -0.0
    if rows > 3:
        x[3, n // 3:] = float("-inf")
    for logits in (x, torch.randn(rows, n, generator=g)):
        want = ref.ascending_picks(ref.indexer_topk(logits, k), n)
        got = tri.select_topk_ascending(logits.to(DEV), k).cpu()
        assert torch.equal(got, want), (n, k)


def test_select_topk_ascending_wide_rows_sort_in_torch(monkeypatch):
    g = gen(60)
    x = torch.randn(2, 300, generator=g)
    monkeypatch.setattr(tri, "SELECT_MAX_COLS", 256)
    want = ref.ascending_picks(ref.indexer_topk(x, 40), 300)
    assert torch.equal(tri.select_topk_ascending(x.to(DEV), 40).cpu(), want)


def test_paged_indexer_ascending_triton_equals_torch():
    c = _case("ocp", seed=5, entries=(150, 70), queries=[(0, 150), (1, 70), (0, 3), (1, 0)])
    for k in (16, 64):
        got = tri.paged_indexer_topk(*_args(c, 192), k, c["fmt"], ascending=True).cpu()
        want = ref.paged_indexer_topk(*_args(c, 192), k, c["fmt"], ascending=True).cpu()
        assert torch.equal(got, want)
        assert torch.equal(want, ref.ascending_picks(ref.paged_indexer_topk(*_args(c, 192), k, c["fmt"]).cpu(), 192))
