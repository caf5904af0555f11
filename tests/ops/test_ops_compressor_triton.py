"""Triton ``compressor_pool_insert`` vs its torch backend (today's batched-compressor arithmetic).

Inputs are fresh random state rows and rings; pages start as random bytes, so comparing whole
pages also checks that skipped entries (page −1, blocks that do not close) and every other byte are
left alone. What is asserted, and why:

* the ring after a decode-form call is bitwise the torch one (a plain copy of the rows), and a
  chunk-form call does not touch it;
* dense float32 pages hold the fp32 entries themselves: they agree to a few fp32 ulps. The only
  order that differs on the CPU is the RMSNorm's Σx² (``tl.sum``'s tree vs torch's vectorised
  cascade), which moves 1/rms by about an ulp; the softmax (fp64, rounded to fp32) and the Σ kv·w
  (groups of 16 rows in order, as torch's CPU cascade sum) are bit-identical except where numpy's
  and torch's fp64 exp/cos differ by an ulp across an fp32 rounding boundary (~2^-29 per value);
* record pages (OCP / FNUZ ``fp8_ds_mla`` and indexer keys): all bytes outside the entries' slots are
  identical, the entries' bytes identical in ≥ 99 % of positions (an ulp in fp32 flips a bf16 or
  an FP8 rounding only when the value sits on a rounding boundary), and decoded entries differ by
  at most one FP8 step of their tile (one bf16 step in the rope part) where they differ at all;
* an entry does not depend on the other entries of the launch (each alone gives the same bytes),
  and the decode form (rows from the ring) and the chunk form (rows from the step's rows) give the
  same bytes for the same entry — as the engine's chunking invariance needs.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

from dsv4.checkpoint.synthetic import build_config  # noqa: E402
from dsv4.config import config_from_dict  # noqa: E402
from dsv4.formats import (  # noqa: E402
    FNUZ,
    OCP,
    alloc_indexer_pages,
    alloc_kv_pages,
    indexer_page_stride,
    page_stride,
    read_indexer_k,
    read_kv,
)
from dsv4.model.step import PagedStep, SeqChunk  # noqa: E402
from dsv4.ops import torch_compressor  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import compressor as tcomp  # noqa: E402

CFG = config_from_dict(build_config("tiny"))
BLOCK = 256
N_BLOCKS = 20
N_SLOTS = 6

# (ratio, overlap, kind): the CSA kv and indexer compressors (ratio 4, overlapping windows of 8 rows)
# and the HCA kv compressor (ratio 128, no overlap)
CASES = [(4, True, "kv"), (4, True, "index"), (128, False, "kv")]
CASE_IDS = ["r4-kv", "r4-index", "r128-kv"]


def _dim(kind):
    return CFG.head_dim if kind == "kv" else CFG.index_head_dim


def _pages(kind, fmt, per, g):
    """Compressed pages of N_BLOCKS blocks + the spare one, filled with random bytes / values."""
    d = _dim(kind)
    if fmt is None:
        return torch.randn(N_BLOCKS + 1, per, d, generator=g).to(DEV)
    if kind == "kv":
        pages = alloc_kv_pages(N_BLOCKS + 1, per, DEV, stride=page_stride(per) + 576)
    else:
        pages = alloc_indexer_pages(N_BLOCKS + 1, per, DEV, stride=indexer_page_stride(per) + 576)
    flat = pages.as_strided((pages.stride(0) * (N_BLOCKS + 1),), (1,))
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    return pages


def _state(ratio, overlap, kind, g, n_rows):
    """(ring, rows, norm): scores spread over a few orders of magnitude, so the softmax weights range
    from near-one-hot to flat."""
    d = _dim(kind)
    width = 2 * d if overlap else d
    size = 8 if ratio == 4 else ratio

    def rand(*shape):
        x = torch.randn(*shape, 2 * width, generator=g)
        x[..., width:] *= torch.exp2(torch.randint(-3, 4, (*shape, 1), generator=g).float())
        return x

    return rand(N_SLOTS + 1, size).to(DEV), rand(n_rows).to(DEV), (torch.rand(d, generator=g) + 0.5).to(DEV)


def _block_table(n_req, g, holes=True):
    """[n_req, N_BLOCKS // n_req] distinct blocks; with ``holes`` a few are −1 (entries skipped)."""
    per_req = N_BLOCKS // n_req
    bt = torch.randperm(N_BLOCKS, generator=g)[: n_req * per_req].view(n_req, per_req)
    if holes:
        bt[0, 0] = -1
    return bt.to(DEV)


def _run(fn, pages, ring, *args):
    p, r = pages.clone(), ring.clone()
    fn(p, r, *args)
    return p, r


def _call_args(rows, positions, seq_ids, slots, bt, closing, norm, ratio, overlap, kind, fmt, per):
    return (rows, positions, seq_ids, slots, bt, closing, norm, CFG.rms_norm_eps, CFG.rope_compress, ratio,
            overlap, kind, fmt, per)


def _entries(positions, seq_ids, bt, ratio, per, token_ids=None):
    """(page, offset) of the entries closed by the given tokens (page −1 where none / skipped)."""
    pos = positions if token_ids is None else positions[token_ids]
    seq = seq_ids if token_ids is None else seq_ids[token_ids]
    e = ((pos + 1) // ratio - 1).clamp(min=0)
    page = torch.where((pos + 1) % ratio == 0, bt[seq, (e // per).clamp(max=bt.shape[1] - 1)], -1)
    return page, e % per


def _decode_case(ratio, overlap, kind, g):
    """One token per request at positions that close a block (entry 0 included: no previous block)
    or not; request 0's first block is −1 in the table (its entry is skipped)."""
    n_req = 5
    per = BLOCK // ratio
    pos_choices = [ratio - 1, 2 * ratio - 1, 5 * ratio - 1, 2 * ratio + 1, per * ratio + ratio - 1]
    positions = torch.tensor(pos_choices, dtype=torch.long).to(DEV)
    positions[0] = ratio - 1  # request 0: entry 0 of block 0, which the table marks −1
    seq_ids = torch.arange(n_req, device=DEV)
    slots = torch.randperm(N_SLOTS, generator=g)[:n_req].to(DEV)
    bt = _block_table(n_req, g)
    ring, rows, norm = _state(ratio, overlap, kind, g, n_req)
    return positions, seq_ids, slots, bt, ring, rows, norm, per


def _chunk_case(ratio, overlap, kind, g):
    """Prefill chunks (and one decode token) whose closing blocks straddle the chunk start (rows
    before it from the ring) or lie inside it; the first chunk starts at 0 (entry 0)."""
    per = BLOCK // ratio
    starts_lens = [(0, 2 * ratio + 3), (ratio + 2, 2 * ratio), (3 * ratio - 1, 1), (per * ratio - 3, ratio + 5)]
    if ratio > 16:  # fewer entries of 128 rows: the interpreter takes seconds per entry
        starts_lens = [(0, ratio + 3), (ratio + 2, 2 * ratio), (3 * ratio - 1, 1)]
    chunks, off = [], 0
    for s, n in starts_lens:
        chunks.append(SeqChunk(None, s, n, off, DEV))
        off += n
    positions = torch.cat([c.positions for c in chunks])
    seq_ids = torch.cat([torch.full((c.length,), i, dtype=torch.long, device=DEV) for i, c in enumerate(chunks)])
    slots = torch.randperm(N_SLOTS, generator=g)[: len(chunks)].to(DEV)
    bt = _block_table(len(chunks), g, holes=False)
    ring, rows, norm = _state(ratio, overlap, kind, g, off)
    fake = SimpleNamespace(chunks=chunks, _emitting={}, kvc=SimpleNamespace(device=torch.device(DEV)),
                           static_closing=None)
    closing = PagedStep.closing(fake, ratio)
    assert closing is not None and closing.shape[1] >= 4
    return positions, seq_ids, slots, bt, ring, rows, norm, per, closing


def _fp8_step(values, kind, fmt):
    """One FP8 code step at the top of each value's tile: e4m3 has 3 mantissa bits, so a step is
    ≤ 2^-3·amax (also when the tile's scale byte flips and its codes are re-rounded on a grid twice
    as coarse: each moves by at most half a step of either grid)."""
    d = values.shape[-1]
    blk = 64 if kind == "kv" else d
    t = values.reshape(*values.shape[:-1], d // blk, blk)
    amax = t.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    return (amax * 2.0 ** -3).expand_as(t).reshape(values.shape)


def _compare(kind, fmt, pages_ref, pages_tri, page, off, per, *, min_equal=0.99):
    """Assert the pages agree as the module docstring says; returns (max |diff| of decoded entries,
    fraction of identical bytes in the written records)."""
    ok = page >= 0
    # everything but the written slots (and the spare page, which the torch backend writes) is untouched
    mask = torch.ones_like(pages_ref, dtype=torch.bool)
    mask[-1] = False
    if fmt is None:
        mask[page[ok], off[ok]] = False
        a, b = pages_ref[page[ok], off[ok]].float(), pages_tri[page[ok], off[ok]].float()
        ulp = torch.finfo(torch.float32).eps * a.abs().amax(-1, keepdim=True)
        diff = (a - b).abs()
        assert torch.equal(pages_ref[mask], pages_tri[mask])
        assert bool((diff <= 4 * ulp).all()), f"max |diff| {diff.max().item():.3g} > 4 ulp of the entry's max"
        return diff.max().item(), (a == b).float().mean().item()
    rec = 584 if kind == "kv" else 132
    val = 576 if kind == "kv" else 128
    sc = 8 if kind == "kv" else 4
    for p, o in zip(page[ok].tolist(), off[ok].tolist()):
        mask[p, o * val:(o + 1) * val] = False
        mask[p, per * val + o * sc: per * val + (o + 1) * sc] = False
    assert torch.equal(pages_ref[mask], pages_tri[mask]), "bytes outside the written records changed"
    if kind == "kv":
        a = read_kv(pages_ref, page[ok], off[ok], fmt, per)
        b = read_kv(pages_tri, page[ok], off[ok], fmt, per)
    else:
        a = read_indexer_k(pages_ref, page[ok], off[ok], fmt, per)[0]
        b = read_indexer_k(pages_tri, page[ok], off[ok], fmt, per)[0]
    diff = (a - b).abs()
    lim = _fp8_step(a, kind, fmt)
    if kind == "kv":
        lim[..., 448:] = a[..., 448:].abs() * 2.0 ** -7 + 1e-30  # rope: one bf16 step
    assert bool((diff <= lim).all()), f"decoded entries differ by more than one code: {diff.max().item():.3g}"
    written = ~mask[:-1]
    same = (pages_ref[:-1][written] == pages_tri[:-1][written]).float().mean().item()
    assert same >= min_equal, f"only {same:.4%} of the record bytes are identical"
    assert rec * int(ok.sum()) == int(written.sum())
    return diff.max().item(), same


FMTS = [None, OCP, FNUZ]
FMT_IDS = ["dense", "ocp", "fnuz"]


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
@pytest.mark.parametrize("ratio,overlap,kind", CASES, ids=CASE_IDS)
def test_decode_form_matches_torch(ratio, overlap, kind, fmt):
    g = gen(zlib.crc32(f"decode {ratio} {kind} {fmt}".encode()))
    positions, seq_ids, slots, bt, ring, rows, norm, per = _decode_case(ratio, overlap, kind, g)
    pages = _pages(kind, fmt, per, g)
    args = _call_args(rows, positions, seq_ids, slots, bt, None, norm, ratio, overlap, kind, fmt, per)
    p_ref, r_ref = _run(torch_compressor.compressor_pool_insert, pages, ring, *args)
    p_tri, r_tri = _run(tcomp.compressor_pool_insert, pages, ring, *args)
    assert torch.equal(r_ref, r_tri), "ring rows differ"
    page, off = _entries(positions, seq_ids, bt, ratio, per)
    assert int((page >= 0).sum()) >= 3 and int((page < 0).sum()) >= 2  # skipped: not closing, and page −1
    _compare(kind, fmt, p_ref, p_tri, page, off, per)


@pytest.mark.parametrize("ratio,overlap,kind,fmt", [(4, True, "kv", OCP), (4, True, "index", OCP),
                                                    (128, False, "kv", None)])
def test_decode_form_forms_the_state_rows_from_raw_rows_and_ape(ratio, overlap, kind, fmt):
    """With ``ape`` the decode form takes the raw [wkv; wgate] rows (bf16, as the stacked GEMM gives them)
    and forms the state rows itself: the ring and the pages equal, bitwise, those of the same op given the
    state rows ``Compressor.state_rows`` would form (fp32, score half + ape[position % ratio]) — in each
    backend — and the two backends agree as in the plain decode form. -0.0 in the kv half stays -0.0."""
    g = gen(zlib.crc32(f"ape {ratio} {kind} {fmt}".encode()))
    positions, seq_ids, slots, bt, ring, rows, norm, per = _decode_case(ratio, overlap, kind, g)
    width = rows.shape[1] // 2
    raw = rows.to(torch.bfloat16)
    raw[0, 0] = -0.0
    ape = (torch.randn(ratio, width, generator=g) * 0.5).to(DEV)
    state = raw.float()
    state[:, width:] += ape[positions % ratio]
    pages = _pages(kind, fmt, per, g)
    plain = _call_args(state, positions, seq_ids, slots, bt, None, norm, ratio, overlap, kind, fmt, per)
    args = _call_args(raw, positions, seq_ids, slots, bt, None, norm, ratio, overlap, kind, fmt, per)
    for op in (torch_compressor.compressor_pool_insert, tcomp.compressor_pool_insert):
        p_plain, r_plain = _run(op, pages, ring, *plain)
        p_ape, r_ape = pages.clone(), ring.clone()
        op(p_ape, r_ape, *args, ape=ape)
        assert torch.equal(r_ape, r_plain) and torch.equal(p_ape, p_plain), op.__module__
        assert torch.equal(r_ape[slots[0], positions[0] % ring.shape[1], 0], torch.tensor(-0.0, device=DEV))
        assert torch.signbit(r_ape[slots[0], positions[0] % ring.shape[1], 0])
    p_ref, _ = _run(torch_compressor.compressor_pool_insert, pages, ring, *plain)
    page, off = _entries(positions, seq_ids, bt, ratio, per)
    _compare(kind, fmt, p_ref, p_ape, page, off, per)
    closing = torch.zeros(4, 1, dtype=torch.long, device=DEV)
    for op in (torch_compressor.compressor_pool_insert, tcomp.compressor_pool_insert):
        with pytest.raises(ValueError, match="decode form only"):
            op(pages.clone(), ring.clone(), *_call_args(raw, positions, seq_ids, slots, bt, closing, norm, ratio,
                                                         overlap, kind, fmt, per), ape=ape)
        with pytest.raises(ValueError, match="ape must be"):
            op(pages.clone(), ring.clone(), *args, ape=ape[:, 1:])


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
@pytest.mark.parametrize("ratio,overlap,kind", CASES, ids=CASE_IDS)
def test_chunk_form_matches_torch(ratio, overlap, kind, fmt):
    g = gen(zlib.crc32(f"chunk {ratio} {kind} {fmt}".encode()))
    positions, seq_ids, slots, bt, ring, rows, norm, per, closing = _chunk_case(ratio, overlap, kind, g)
    pages = _pages(kind, fmt, per, g)
    args = _call_args(rows, positions, seq_ids, slots, bt, closing, norm, ratio, overlap, kind, fmt, per)
    p_ref, r_ref = _run(torch_compressor.compressor_pool_insert, pages, ring, *args)
    p_tri, r_tri = _run(tcomp.compressor_pool_insert, pages, ring, *args)
    assert torch.equal(r_tri, ring) and torch.equal(r_ref, ring), "the chunk form must not write the ring"
    page, off = _entries(positions, seq_ids, bt, ratio, per, closing[0])
    assert bool((page >= 0).all())
    _compare(kind, fmt, p_ref, p_tri, page, off, per)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("ratio,overlap,kind", CASES, ids=CASE_IDS)
def test_a_table_listing_every_token_writes_only_the_closing_entries(ratio, overlap, kind, backend):
    """A speculative verify graph's fixed closing table lists every token of its chunks: the tokens
    that close no block write no page, and the pages are those of the table of closing tokens."""
    if backend == "triton" and ratio > 16:
        pytest.skip("the kernel's skip is the same code at every ratio; 128-row entries take seconds interpreted")
    g = gen(zlib.crc32(f"every {ratio} {kind}".encode()))
    positions, seq_ids, slots, bt, ring, rows, norm, per, closing = _chunk_case(ratio, overlap, kind, g)
    seq = seq_ids.cpu()
    first = {int(s): i for i, s in reversed(list(enumerate(seq.tolist())))}
    every = torch.stack([torch.arange(len(seq)), positions.cpu()[[first[int(s)] for s in seq]],
                         torch.tensor([first[int(s)] for s in seq]), seq]).to(DEV)
    assert every.shape[1] > closing.shape[1]
    op = torch_compressor.compressor_pool_insert if backend == "torch" else tcomp.compressor_pool_insert
    pages = _pages(kind, OCP, per, g)
    out = []
    for table in (closing, every):
        out.append(_run(op, pages, ring, *_call_args(rows, positions, seq_ids, slots, bt, table, norm, ratio, overlap,
                                                     kind, OCP, per)))
    # (the torch op sends masked writes to the spare page past the last one: not compared)
    assert torch.equal(out[0][0][:-1], out[1][0][:-1]) and torch.equal(out[1][1], ring)


@pytest.mark.parametrize("ratio,overlap,kind", CASES, ids=CASE_IDS)
def test_entry_independent_of_launch_and_form(ratio, overlap, kind):
    """Each entry alone gives the bytes it gets in the full launch, and the decode form (its block's
    earlier rows from the ring) gives the bytes of the chunk form (all rows from the step's rows)."""
    fmt = OCP
    g = gen(zlib.crc32(f"indep {ratio} {kind}".encode()))
    positions, seq_ids, slots, bt, ring, rows, norm, per, closing = _chunk_case(ratio, overlap, kind, g)
    pages = _pages(kind, fmt, per, g)
    op = tcomp.compressor_pool_insert
    full, _ = _run(op, pages, ring, *_call_args(rows, positions, seq_ids, slots, bt, closing, norm, ratio, overlap,
                                                 kind, fmt, per))
    alone = pages.clone()
    for i in range(closing.shape[1]):
        op(alone, ring.clone(), *_call_args(rows, positions, seq_ids, slots, bt, closing[:, i:i + 1], norm, ratio,
                                            overlap, kind, fmt, per))
    assert torch.equal(full, alone)
    # decode form: commit each closing token's earlier rows into a ring, then pool from there
    size = ring.shape[1]
    tok = closing[0]
    for i, t in enumerate(tok.tolist()):
        s, c_off, sq = (int(v) for v in closing[1:, i])
        p = int(positions[t])
        ring_d = ring.clone()
        for q in range(max(s, p - size + 1), p):  # this chunk's rows before the closing one
            ring_d[slots[sq], q % size] = rows[c_off + q - s]
        dec = pages.clone()
        op(dec, ring_d.clone(), *_call_args(rows[t:t + 1], positions[t:t + 1], seq_ids[t:t + 1], slots, bt, None,
                                            norm, ratio, overlap, kind, fmt, per))
        page, off = _entries(positions, seq_ids, bt, ratio, per, tok[i:i + 1])
        pg, o = int(page[0]), int(off[0])
        val, sc = (576, 8) if kind == "kv" else (128, 4)
        for lo, hi in ((o * val, (o + 1) * val), (per * val + o * sc, per * val + (o + 1) * sc)):
            assert torch.equal(dec[pg, lo:hi], full[pg, lo:hi]), f"entry of token {t}: decode ≠ chunk form"


def test_registry_resolves_both_backends():
    assert resolve("compressor_pool_insert", force={"compressor_pool_insert": "triton"})[1] is \
        tcomp.compressor_pool_insert
    assert resolve("compressor_pool_insert", force={"compressor_pool_insert": "torch"})[1] is \
        torch_compressor.compressor_pool_insert


@pytest.mark.parametrize("ratio,overlap,kind", CASES, ids=CASE_IDS)
def test_agreement_report(ratio, overlap, kind, capsys):
    """Several seeds of the chunk form on OCP records and fp32 pages; prints the measured agreement."""
    out = []
    for fmt in (None, OCP):
        worst, same = 0.0, []
        for seed in range(2 if ratio <= 16 else 1):
            g = gen(zlib.crc32(f"report {ratio} {kind} {fmt} {seed}".encode()))
            positions, seq_ids, slots, bt, ring, rows, norm, per, closing = _chunk_case(ratio, overlap, kind, g)
            pages = _pages(kind, fmt, per, g)
            args = _call_args(rows, positions, seq_ids, slots, bt, closing, norm, ratio, overlap, kind, fmt, per)
            p_ref, _ = _run(torch_compressor.compressor_pool_insert, pages, ring, *args)
            p_tri, _ = _run(tcomp.compressor_pool_insert, pages, ring, *args)
            page, off = _entries(positions, seq_ids, bt, ratio, per, closing[0])
            d, s = _compare(kind, fmt, p_ref, p_tri, page, off, per)
            worst, same = max(worst, d), same + [s]
        out.append(f"{'dense-fp32' if fmt is None else fmt.name}: max|diff| {worst:.3g}, "
                   f"identical {100 * min(same):.3f}%..{100 * max(same):.3f}%")
    with capsys.disabled():
        print(f"\n[compressor_pool_insert r={ratio} {kind}] " + "; ".join(out))
