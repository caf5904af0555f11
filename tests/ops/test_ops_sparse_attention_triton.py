"""Triton paged sparse attention vs the torch backend (the oracle's ``sparse_attention`` on gathered keys).

Tolerance. Both sides use the same key values (decoded records) and reduce exact products in fp32
(the kernel splits q and p into bf16 parts that sum to them exactly, see the kernel docstring);
they differ in summation order (the oracle: one fp32 bmm per query block, float64 softmax, 64-key
blocks of p·v; the kernel: 16-deep MMA steps, online exp2 softmax over 32-key blocks). For output
element (t, h, d) with reference probabilities p_j (sink included) and key values v_j:

* p·v accumulation: ≲ n·2^-24 · Σ_j p_j |v_jd| for n summation steps;
* a logit error δ_j (fp32 dot of 512 exact products: ≲ n·2^-24 · G_j with G_j = scale·Σ_i |q_i k_ji|,
  plus the exp2 argument rounding ≲ 2^-24·|logit|) moves p_j by p_j·(δ_j + Σ_i p_i δ_i), i.e. the
  output by ≤ 2·max_j δ_j · Σ_j p_j |v_jd|.

So |Δ| ≤ REL·(1 + 2·max_j G_j)·Σ_j p_j |v_jd| with REL = 1e-5 (≈ 170 fp32 roundings: the summations
are 512 terms deep at most, and both sides' errors add). 16-bit outputs add one spacing of the output
format at |ref| (both sides round once, so a value near a rounding boundary may go either way) and
the 2-part split of p (≤ 2^-16·Σ_j p_j |v_jd|).

That bound is a worst case (the measured error is ~0.5 % of it), so fp32 outputs are also held to the
oracle's own accuracy: max_(t,h,d) |out - exact|/Σ_j p_j|v_jd| (exact = float64 over the same keys)
at most ACCURACY times the oracle's. Both are fp32 computations of the same quantity with about the
same number of roundings (measured in the interpreter: kernel/oracle 0.4-1.0); 4x leaves room for
the GPU's MMA accumulation and exp2 approximation, while a wrong term (sink weight off by 0.1 %, a
missing key, a wrong scale byte) is far larger.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, assert_bits_if_compiled, gen  # noqa: E402

from dsv4.formats import FNUZ, OCP, alloc_kv_pages  # noqa: E402
from dsv4.ops import torch_attention  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import sparse_attention as tsa  # noqa: E402

REL = 1e-5
SWA = 64
MANT_BITS = {torch.bfloat16: 7, torch.float16: 10}
ACCURACY = 4  # fp32 outputs: error vs float64 at most 4x the oracle's (CPU interpreter: ≤ 1x measured)


def _kv(n, g, scale=1.0):
    """KV rows with per-64-tile scales spread over 2^-4..2^4 and a normal rope part."""
    tiles = torch.exp2(torch.randint(-4, 5, (n, 8, 1), generator=g).float())
    return (torch.randn(n, 8, 64, generator=g) * tiles).reshape(n, 512) * scale


class Scene:
    """Sequences of different lengths in shuffled pages, and queries (prefill chunks and decodes) on them.

    kind "csa": 64 entries a page, entries = len // 4, each query lists a random top-k of its
    visible entries ((p+1)//4), ascending, −1 padded; "hca": 2 entries a page, entries = len // 8,
    each query lists all its visible entries ((p+1)//8); "swa": no compressed entries (Lc = 0).
    Window pages entirely before every query's window are freed (−1 in the table).
    """

    def __init__(self, fmt, kind, lens, queries, window, g, dense_dtype=torch.bfloat16, topk=12):
        self.fmt, self.window = fmt, window
        S = len(lens)
        n_swa = max(-(-n // SWA) for n in lens)
        n_pages = S * n_swa + 2
        ratio, per = {"csa": (4, 64), "hca": (8, 2), "swa": (None, None)}[kind]
        if fmt is None:
            self.swa_pages = torch.zeros(n_pages, SWA, 512, dtype=dense_dtype, device=DEV)
        else:
            self.swa_pages = alloc_kv_pages(n_pages, SWA, DEV, stride=37440 + 576)
        perm = torch.randperm(n_pages, generator=g)
        self.swa_table = torch.full((S, n_swa), -1, dtype=torch.long)
        for s, n in enumerate(lens):
            used = -(-n // SWA)
            self.swa_table[s, :used] = perm[s * n_swa: s * n_swa + used]
        self.swa_table = self.swa_table.to(DEV)
        for s, n in enumerate(lens):
            pos = torch.arange(n)
            pg = self.swa_table[s, pos // SWA]
            torch_attention.kv_insert(self.swa_pages, pg, (pos % SWA).to(DEV), _kv(n, g).to(DEV), fmt, SWA)
        self.per = per or 1
        self.comp_pages = self.block_table = None
        ent = [n // ratio if ratio else 0 for n in lens]
        if ratio:
            n_blk = max(1, max(-(-e // per) for e in ent))
            n_cp = S * n_blk + 1
            if fmt is None:
                self.comp_pages = torch.zeros(n_cp, per, 512, dtype=dense_dtype, device=DEV)
            else:
                self.comp_pages = alloc_kv_pages(n_cp, per, DEV)
            cperm = torch.randperm(n_cp, generator=g)
            self.block_table = cperm[: S * n_blk].view(S, n_blk).to(DEV)
            for s, e in enumerate(ent):
                idx = torch.arange(e)
                torch_attention.kv_insert(self.comp_pages, self.block_table[s, idx // per], (idx % per).to(DEV),
                                          _kv(e, g).to(DEV), fmt, per, round_bf16=True)
        pos, sid, rows = [], [], []
        for s, p in queries:
            pos.append(p)
            sid.append(s)
            if kind == "csa":
                vis = (p + 1) // ratio
                sel = torch.randperm(vis, generator=g)[:topk].sort().values.tolist() if vis else []
                rows.append(sel)
            elif kind == "hca":
                rows.append(list(range((p + 1) // ratio)))
            else:
                rows.append([])
        lc = max(len(r) for r in rows) if kind == "csa" else (max(ent) if ratio else 0)
        padded = [r + [-1] * (lc - len(r)) for r in rows]
        self.comp_idx = torch.tensor(padded, dtype=torch.long).view(len(rows), lc).to(DEV)
        self.positions = torch.tensor(pos, dtype=torch.long, device=DEV)
        self.seq_ids = torch.tensor(sid, dtype=torch.int32, device=DEV)
        # free window pages no query can see
        lo = {}
        for s, p in queries:
            lo[s] = min(lo.get(s, p), max(0, p - window + 1))
        for s, first in lo.items():
            self.swa_table[s, : first // SWA] = -1
        self.freed = int((self.swa_table[:, 0] < 0).sum())

    def args(self, sl=slice(None), comp_idx=None):
        ci = self.comp_idx[sl] if comp_idx is None else comp_idx
        return (self.positions[sl], self.seq_ids[sl], self.swa_pages, self.swa_table, self.comp_pages,
                self.block_table, self.per, ci)


def _run(fn, sc, q, sink, scale, sl=slice(None), comp_idx=None):
    return fn(q[sl], *sc.args(sl, comp_idx), sink, scale, sc.window, sc.fmt)


def _float64_reference(sc, q, sink, scale):
    """(exact out, Σ_j p_j|v_j|, max_j G_j) in float64 over the same gathered keys."""
    table, idx = torch_attention.gather_attention_keys(*sc.args(), sc.window, sc.fmt)
    k = table.double()[idx.clamp(min=0)] * (idx >= 0)[..., None]  # [T, L, 512]
    qd = q.double()
    logits = torch.einsum("thd,tld->thl", qd, k) * scale
    logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
    full = torch.cat([sink.double()[None, :, None].expand(q.shape[0], -1, 1), logits], dim=-1)
    p = torch.softmax(full, dim=-1)[..., 1:]
    g = (torch.einsum("thd,tld->thl", qd.abs(), k.abs()) * scale).masked_fill((idx < 0)[:, None, :], 0)
    return torch.einsum("thl,tld->thd", p, k), torch.einsum("thl,tld->thd", p, k.abs()), g.amax(-1, keepdim=True)


def _bound(q, ref, a, gmax):
    """REL·(1 + 2·max_j G_j)·Σ_j p_j|v_j| (+ the 16-bit output terms)."""
    bound = REL * (1 + 2 * gmax) * a
    if q.dtype != torch.float32:
        _, e = torch.frexp(ref.float().abs())  # |ref| in [2^(e-1), 2^e): 16-bit spacing 2^(e-1-mantissa bits)
        spacing = torch.ldexp(torch.ones_like(ref, dtype=torch.float64), e - 1 - MANT_BITS[q.dtype])
        bound = bound + spacing + 2.0 ** -16 * a
    return bound


def _check(sc, H, qdtype, seed, scale=512 ** -0.5, config=None):
    g = gen(seed)
    T = sc.positions.shape[0]
    q = (torch.randn(T, H, 512, generator=g) * 2).to(qdtype).to(DEV)
    sink = torch.randn(H, generator=g).to(DEV)
    out = _run(lambda *a: tsa.paged_sparse_attention(*a, config=config), sc, q, sink, scale)
    ref = _run(torch_attention.paged_sparse_attention, sc, q, sink, scale)
    assert out.dtype == qdtype and out.shape == (T, H, 512)
    assert torch.isfinite(out).all()
    exact, a, gmax = _float64_reference(sc, q, sink, scale)
    d = (out.double() - ref.double()).abs()
    worst = (d / (_bound(q, ref, a, gmax) + 1e-300)).max().item()
    assert worst <= 1.0, f"max |diff|/bound = {worst:.3g} (max |diff| {d.max().item():.3g})"
    if qdtype == torch.float32:  # and as accurate as the oracle (errors relative to Σ p|v|)
        err_k = ((out.double() - exact).abs() / a).max().item()
        err_o = ((ref.double() - exact).abs() / a).max().item()
        assert err_k <= ACCURACY * err_o + 2.0 ** -24, f"kernel error {err_k:.3g} vs the oracle's {err_o:.3g}"
    return q, sink, out


# (sequence, position) queries: a short prefill (all positions < window), a prefill chunk crossing the
# window, decodes far past the window (freed pages before it)
LENS = [3, 90, 200]
QUERIES = [(0, 0), (0, 1), (0, 2), (1, 60), (1, 61), (1, 89), (2, 150), (2, 199)]


@pytest.mark.parametrize("fmt", [OCP, FNUZ], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_fp8_pages_fp32(fmt, kind):
    sc = Scene(fmt, kind, LENS, QUERIES, 40, gen(1 + (kind == "hca")))
    assert sc.freed >= 1  # a freed page outside the window is part of the scene
    _check(sc, 4, torch.float32, 10)


def test_fp8_pages_bf16_h16_window128():
    sc = Scene(OCP, "csa", LENS, QUERIES, 128, gen(3))
    _check(sc, 16, torch.bfloat16, 11)


def test_h64_default_16_head_blocks_and_one_64_head_block():
    """The H200 head count: four 16-head programs per token by default (the sweep's fastest tile,
    the same for every H), and one 64-head program per token when asked."""
    sc = Scene(OCP, "hca", LENS, [(1, 89), (2, 199)], 128, gen(7))
    assert {h: tsa.pick_config(h, torch.device(DEV))["BLOCK_H"] for h in (4, 16, 32, 64)} == \
        {4: 16, 16: 16, 32: 16, 64: 16}
    _check(sc, 64, torch.bfloat16, 15)
    _check(sc, 64, torch.bfloat16, 15, config={"BLOCK_H": 64, "num_warps": 8, "num_stages": 2})


def test_swa_only_lc0_and_h20():
    sc = Scene(OCP, "swa", LENS, QUERIES, 40, gen(4))
    assert sc.comp_idx.shape[1] == 0 and sc.comp_pages is None
    _check(sc, 20, torch.float32, 12)  # H not a multiple of the head block


@pytest.mark.parametrize("dense_dtype", [torch.bfloat16, torch.float32])
def test_dense_pages(dense_dtype):
    sc = Scene(None, "csa", LENS, QUERIES, 40, gen(5), dense_dtype=dense_dtype)
    _check(sc, 4, torch.float32, 13)


@pytest.mark.parametrize("fmt", [OCP, None], ids=["fp8", "dense"])
def test_batch_invariance_bitwise(fmt):
    """A token's output is bitwise the same alone (its own, narrower comp_idx row) as in the batch."""
    sc = Scene(fmt, "csa", LENS, QUERIES, 40, gen(6))
    q, sink, out = _check(sc, 16, torch.bfloat16, 14)
    for t in (0, 4, 7):
        row = sc.comp_idx[t: t + 1]
        own = row[:, : int((row >= 0).sum())]
        alone = _run(tsa.paged_sparse_attention, sc, q, sink, 512 ** -0.5, slice(t, t + 1), own)
        assert torch.equal(alone, out[t: t + 1]), f"token {t} differs alone"
    pair = _run(tsa.paged_sparse_attention, sc, q, sink, 512 ** -0.5, slice(3, 5))
    assert torch.equal(pair, out[3:5])


def test_padding_token_reads_nothing():
    """A padding token (position −1, no entries, seq row −1) gets zeros and leaves the others alone."""
    sc = Scene(OCP, "csa", LENS, QUERIES[:3], 40, gen(8))
    g = gen(16)
    q = torch.randn(4, 16, 512, generator=g).to(DEV)
    sink = torch.randn(16, generator=g).to(DEV)
    args = list(sc.args())
    args[0] = torch.cat([args[0], torch.tensor([-1], device=DEV)])
    args[1] = torch.cat([args[1], torch.tensor([-1], dtype=args[1].dtype, device=DEV)])
    args[7] = torch.cat([args[7], torch.full((1, args[7].shape[1]), -1, dtype=args[7].dtype, device=DEV)])
    out = tsa.paged_sparse_attention(q, *args, sink, 512 ** -0.5, sc.window, sc.fmt)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert torch.equal(out[:3], _run(tsa.paged_sparse_attention, sc, q[:3], sink, 512 ** -0.5))


def test_registry_resolves_both_backends():
    assert resolve("sparse_attention", force={"sparse_attention": "torch"})[1] is \
        torch_attention.paged_sparse_attention
    assert resolve("sparse_attention", force={"sparse_attention": "triton"})[1] is tsa.paged_sparse_attention


def test_out_of_shared_memory_steps_down_to_a_smaller_tile(monkeypatch):
    """A tile that does not fit the GPU's shared memory (the H200 refused BLOCK_H=64 with 2 stages
    for one bf16 specialization: 254 KB needed, 232 KB there) falls back to fewer stages, then fewer
    heads per program; the choice is remembered per head count and dtypes, never per batch."""
    from triton.runtime.errors import OutOfResources

    sc = Scene(OCP, "hca", LENS, [(1, 89), (2, 199)], 128, gen(7))
    g = gen(16)
    q = (torch.randn(2, 64, 512, generator=g) * 2).to(torch.bfloat16).to(DEV)
    sink = torch.randn(64, generator=g).to(DEV)
    want = _run(lambda *a: tsa.paged_sparse_attention(*a, config={"BLOCK_H": 32, "num_warps": 8, "num_stages": 2}),
                sc, q, sink, 512 ** -0.5)
    real = tsa._sparse_attn_kernel
    tried = []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append((kw["BLOCK_H"], kw["num_stages"]))
                if kw["BLOCK_H"] == 64:
                    raise OutOfResources(254464, 232448, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tsa, "_sparse_attn_kernel", Refusing())
    monkeypatch.setattr(tsa, "_WORKING", {})
    default = tsa.pick_config  # start the ladder from the earlier 64-head, 2-stage default
    monkeypatch.setattr(tsa, "pick_config", lambda h, dev, config=None, predecoded=False: default(
        h, dev, config or {"BLOCK_H": 64, "num_warps": 8, "num_stages": 2}, predecoded))
    got = _run(tsa.paged_sparse_attention, sc, q, sink, 512 ** -0.5)
    assert tried[:3] == [(64, 2), (64, 1), (32, 2)]
    assert torch.equal(got, want)  # the step-down config's own result
    tried.clear()
    _run(tsa.paged_sparse_attention, sc, q, sink, 512 ** -0.5)
    assert tried == [(32, 2)]  # remembered: no more failed attempts


def test_an_explicit_tile_does_not_become_the_default(monkeypatch):
    """A call with ``config`` (a benchmark's or a test's tile) leaves the default of later calls alone."""
    monkeypatch.setattr(tsa, "_WORKING", {})
    sc = Scene(OCP, "hca", LENS, [(1, 89), (2, 199)], 128, gen(7))
    g = gen(16)
    q = (torch.randn(2, 32, 512, generator=g) * 2).to(torch.bfloat16).to(DEV)
    sink = torch.randn(32, generator=g).to(DEV)
    default = _run(tsa.paged_sparse_attention, sc, q, sink, 512 ** -0.5)
    _run(lambda *a: tsa.paged_sparse_attention(*a, config={"BLOCK_H": 32, "BLOCK_N": 16}), sc, q, sink, 512 ** -0.5)
    assert all(c["BLOCK_H"] == 16 and c["BLOCK_N"] == 32 for c in tsa._WORKING.values())
    assert torch.equal(_run(tsa.paged_sparse_attention, sc, q, sink, 512 ** -0.5), default)



@pytest.mark.parametrize("kind,qdtype,chunks,chunk_min", [("csa", torch.bfloat16, 4, 1), ("hca", torch.bfloat16, 3, 2),
                                                          ("swa", torch.float32, 4, 1), ("hca", torch.float32, 2, 1)])
def test_chunks_split_over_programs_give_the_one_program_bits(kind, qdtype, chunks, chunk_min, monkeypatch):
    """Each chunk of a query's keys in its own program, joined by the tile's last program (decode-sized
    steps), against one program joining the same chunks as it goes: the same joins in the same order, so
    bitwise the same compiled; both held to the oracle's bound. 16-key blocks and a 128-token window (40 for
    fp32 q: on the 128-token scene the H200 kernel's fp32 error is 4.5x the oracle's, above ``ACCURACY``, with
    every chunking alike, one chunk of 32-key blocks included: its logits', not the joins') give the queries
    1 to 10 blocks: chunks of one to several blocks, straddling the compressed and window keys, and programs
    with no chunk to compute (they only arrive). A query of one chunk has its program store the output
    (``ONE_CHUNK_DIRECT``): the bits of that chunk's partial joined by the last to arrive. Under the
    interpreter (BLAS dots) the forms are held to the sum of their bounds."""
    sc = Scene(OCP, kind, LENS, QUERIES, 128 if qdtype == torch.bfloat16 else 40, gen(30 + len(kind)))
    cfg = {"BLOCK_N": 16, "chunks": chunks, "chunk_min": chunk_min}
    q, sink, split = _check(sc, 16, qdtype, 31, config=dict(cfg, split=True))
    _, _, joined = _check(sc, 16, qdtype, 31, config=dict(cfg, split=False))
    _, a, gmax = _float64_reference(sc, q, sink, 512 ** -0.5)
    ref = _run(torch_attention.paged_sparse_attention, sc, q, sink, 512 ** -0.5)
    assert_bits_if_compiled(split, joined, 2 * _bound(q, ref, a, gmax))
    again = _run(lambda *a: tsa.paged_sparse_attention(*a, config=dict(cfg, split=True)), sc, q, sink, 512 ** -0.5)
    assert torch.equal(again, split)  # the arrival counters were put back: a second launch joins the same way
    assert _chunks_of(sc, 16, chunks, chunk_min).count(1) >= 1  # some queries have one chunk: the direct store ran
    monkeypatch.setattr(tsa, "ONE_CHUNK_DIRECT", False)
    partials = _run(lambda *a: tsa.paged_sparse_attention(*a, config=dict(cfg, split=True)), sc, q, sink,
                    512 ** -0.5)
    assert_bits_if_compiled(split, partials, 2 * _bound(q, ref, a, gmax))


def _chunks_of(sc, block_n, chunks, chunk_min) -> list[int]:
    """Each query's number of key chunks, by the kernel's rule (its compressed blocks up to its last valid
    column, then its window's blocks, cut into at most ``chunks`` runs of at least ``chunk_min`` blocks)."""
    out = []
    for row, p in zip(sc.comp_idx.tolist(), sc.positions.tolist()):
        n = max((j + 1 for j, e in enumerate(row) if e >= 0), default=0)
        nb = -(-n // block_n) + -(-(p + 1 - max(p - sc.window + 1, 0)) // block_n)
        per = max(-(-nb // chunks), chunk_min)
        out.append(-(-nb // per))
    return out


def test_chunk_settings_are_checked():
    sc = Scene(OCP, "swa", LENS, QUERIES[:2], 40, gen(4))
    q = torch.zeros(2, 16, 512, device=DEV)
    with pytest.raises(ValueError, match="chunks and chunk_min"):
        _run(lambda *a: tsa.paged_sparse_attention(*a, config={"chunks": 0}), sc, q, torch.zeros(16, device=DEV), 1.0)


@pytest.mark.parametrize("fmt", [OCP, FNUZ], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("kind,qdtype,H", [("csa", torch.bfloat16, 16), ("hca", torch.float32, 16),
                                           ("swa", torch.bfloat16, 16), ("csa", torch.bfloat16, 64)])
def test_keys_decoded_once_give_the_same_bits(fmt, kind, qdtype, H):
    """The prefill form (every listed record decoded to bf16 once, then dense pages, PREDECODE_TILE's
    32-head programs) against the in-register decode (16-head programs): the same MMA inputs in the
    same order, so bitwise the same output compiled (only if both dots get the same operand grouping:
    the kernel docstring's "MMA operand grouping"). Under the interpreter the two forms' dots have
    other shapes, whose BLAS sums differ by CPU, so there each is held to the oracle's bound and the
    two to the sum of their bounds."""
    sc = Scene(fmt, kind, LENS, QUERIES, 40, gen(20 + (kind == "hca")))
    q, sink, inreg = _check(sc, H, qdtype, 21, config={"predecode": False})
    _, _, once = _check(sc, H, qdtype, 21, config={"predecode": True})
    _, a, gmax = _float64_reference(sc, q, sink, 512 ** -0.5)
    ref = _run(torch_attention.paged_sparse_attention, sc, q, sink, 512 ** -0.5)
    assert_bits_if_compiled(once, inreg, 2 * _bound(q, ref, a, gmax))


def test_decode_pages_compacts_the_table_and_decodes_each_record():
    """``decode_pages``: entry (s, j) of the table becomes page s·n + j holding that page's records as
    the torch codec decodes them (bf16-exact), and −1 entries stay −1."""
    sc = Scene(OCP, "csa", LENS, QUERIES, 40, gen(22))
    dec, tab = tsa.decode_pages(sc.swa_pages, sc.swa_table, SWA, False, False)
    S, n = sc.swa_table.shape
    assert dec.shape == (S * n, SWA, 512) and dec.dtype == torch.bfloat16
    want_tab = torch.where(sc.swa_table >= 0, torch.arange(S * n, device=DEV).view(S, n), -1)
    assert torch.equal(tab, want_tab)
    for s in range(S):
        for j in range(n):
            page = int(sc.swa_table[s, j])
            if page < 0:
                continue
            off = torch.arange(SWA, device=DEV)
            ref = torch_attention._read(sc.swa_pages, torch.full_like(off, page), off, sc.fmt, SWA)
            assert torch.equal(dec[s * n + j].float(), ref.float()), (s, j)


def test_predecode_rule_uses_step_size_and_table_records():
    """Auto: T ≥ PREDECODE_MIN_T and at most PREDECODE_RECORDS_PER_TOKEN table records per token (a
    decode batch over long contexts keeps the in-register decode); ``config["predecode"]`` wins."""
    t = tsa.PREDECODE_MIN_T
    swa = torch.zeros(1, 128, dtype=torch.long)
    blk = torch.zeros(1, 32, dtype=torch.long)
    assert tsa._predecode(None, 8192, swa, 64, blk, 64)
    assert not tsa._predecode(None, t - 1, swa[:, :1], 64, None, 1)
    assert tsa._predecode(None, t, swa[:, :1], 64, None, 1)
    many = torch.zeros(64, 1024, dtype=torch.long)  # 64 sequences at 64K
    assert not tsa._predecode(None, 4096, many, 64, None, 1)
    assert tsa._predecode({"predecode": True}, 1, swa, 64, blk, 64)
    assert not tsa._predecode({"predecode": False}, 8192, swa, 64, blk, 64)
