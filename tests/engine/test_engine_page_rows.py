"""The host copies of a request's page lists (``PageRow``) stay equal to the lists through every
way the cache manager changes them: growth, window release below a watermark, replacement."""

import array
import random

import torch

from dsv4.cache.paged import CacheAllocation, PageRow
from dsv4.model.step import _pad_rows, upload


def test_page_row_follows_appends_releases_and_replacements():
    rng = random.Random(0)
    alloc, row = CacheAllocation(), PageRow()
    next_page = 0
    for step in range(400):
        op = rng.random()
        if op < 0.6:  # allocate: append pages
            for _ in range(rng.randint(0, 3)):
                alloc.swa.append(next_page)
                next_page += 1
        elif op < 0.9:  # release_out_of_window: -1 below a rising watermark
            end = rng.randint(alloc.swa_released, len(alloc.swa))
            for i in range(alloc.swa_released, end):
                alloc.swa[i] = -1
            alloc.swa_released = end
        elif op < 0.95:  # a prefix hit: a new list with leading -1s
            alloc.swa = [-1] * rng.randint(0, 5) + [next_page, next_page + 1]
            alloc.swa_released = 0
            next_page += 2
        else:  # free (preemption): empty lists, watermark reset
            alloc.swa, alloc.swa_released = [], 0
        got = row.sync(alloc.swa, alloc.swa_released)
        assert got.tolist() == alloc.swa, f"step {step}"


def _table(rows: list, device) -> torch.Tensor:
    """A page table as the step builds it: rows padded with -1 (``_pad_rows``), then uploaded."""
    flat, width = _pad_rows(rows)
    return upload([(flat, (len(rows), width))], device)[0]


def test_tables_pad_with_minus_one():
    rows = [array.array("q", [3, 4, 5]), array.array("q"), array.array("q", [7])]
    assert _table(rows, torch.device("cpu")).tolist() == [[3, 4, 5], [-1, -1, -1], [7, -1, -1]]
    assert _table([array.array("q")], torch.device("cpu")).tolist() == [[-1]]
    assert _table([], torch.device("cpu")).shape == (0, 1)


def _rebuilt(chunks, allocs):
    """The step's tables rebuilt from the page lists with plain tensor ops (what ``PagedStep.build``
    must equal)."""
    pos = [p for c in chunks for p in range(c.start, c.start + c.length)]
    sid = [i for i, c in enumerate(chunks) for _ in range(c.length)]

    def table(rows):
        width = max(1, max(len(r) for r in rows))
        return torch.tensor([list(r) + [-1] * (width - len(r)) for r in rows], dtype=torch.long)

    positions, seq_ids = torch.tensor(pos, dtype=torch.long), torch.tensor(sid, dtype=torch.long)
    swa_table = table([a.swa for a in allocs])
    return {"positions": positions, "seq_ids": seq_ids, "swa_table": swa_table,
            "block_table": table([a.blocks for a in allocs]),
            "slots": torch.tensor([a.slot for a in allocs], dtype=torch.long),
            "swa_page": swa_table[seq_ids, positions // 64], "swa_off": positions % 64}


def test_step_tables_equal_the_rebuilt_ones():
    """``host_tables`` (per request, per window page) and the one-copy staging give the tables
    the plain rebuild gives: decode tokens, prefill chunks crossing pages, released windows."""
    import types

    from dsv4.model.step import PagedStep, SeqChunk

    rng = random.Random(1)
    kvc = types.SimpleNamespace(device=torch.device("cpu"))
    allocs = [CacheAllocation(slot=i) for i in range(6)]
    done = [0] * 6
    for step in range(60):
        chunks, live = [], []
        off = 0
        for i, a in enumerate(allocs):
            if rng.random() < 0.3:
                continue
            n = 1 if rng.random() < 0.6 else rng.randint(2, 300)
            end = done[i] + n
            while len(a.swa) < -(-end // 64):
                a.swa.append(rng.randint(0, 10_000))
            while len(a.blocks) < -(-end // 256):
                a.blocks.append(rng.randint(0, 10_000))
            chunks.append(SeqChunk(None, done[i], n, offset=off))
            live.append(a)
            off += n
            done[i] = end
            rel = min(max(0, (end - 1) // 64 - 2), len(a.swa))  # the window's pages stay
            for j in range(a.swa_released, rel):
                a.swa[j] = -1
            a.swa_released = max(a.swa_released, rel)
        if not chunks:
            continue
        got = PagedStep.build(kvc, chunks, live)
        for name, want in _rebuilt(chunks, live).items():
            assert torch.equal(getattr(got, name), want), f"step {step}: {name}"
        assert got.decode_only == all(c.length == 1 for c in chunks)
        assert got.max_end == max(c.start + c.length for c in chunks)


def test_staging_splits_parts_in_order():
    from dsv4.engine.staging import HostStaging

    parts = [(array.array("q", [1, 2, 3]), (3,)), (array.array("q"), (0,)),
             (array.array("q", range(6)), (2, 3)), (array.array("q", [9]), (1,))]
    a, b, c, d = HostStaging("cpu").upload(parts)
    assert a.tolist() == [1, 2, 3] and b.shape == (0,) and c.tolist() == [[0, 1, 2], [3, 4, 5]] and d.tolist() == [9]
    assert c.is_contiguous() and a.dtype == torch.long
    staging = HostStaging("cpu")
    first = staging.upload(parts[:1])[0]
    staging.upload([(array.array("q", [7, 7, 7]), (3,))])
    assert first.tolist() == [1, 2, 3]  # a later step never overwrites a kept tensor
    assert HostStaging("cpu").upload([(array.array("q"), (0, 1))])[0].shape == (0, 1)


def test_decode_tables_equal_the_rebuilt_ones_with_spare_lanes():
    """``decode_tables`` (a decode step padded to a graph's bucket, rows filled in place) equals
    the plain rebuild on the real lanes, and the lanes past them are spare; a request wider than
    the graph's tables gives None."""
    import types

    from dsv4.model.step import SeqChunk, decode_tables

    rng = random.Random(2)
    kvc = types.SimpleNamespace(device=torch.device("cpu"), spare_swa_page=901, spare_block=902, spare_slot=903)
    lanes, n_swa, n_blk = 8, 12, 4
    for step in range(40):
        n = rng.randint(1, lanes)
        allocs, chunks = [], []
        for i in range(n):
            start = rng.randint(0, 700)
            a = CacheAllocation(slot=rng.randint(0, 50))
            a.swa = [rng.randint(0, 10_000) for _ in range(start // 64 + 1)]
            a.blocks = [rng.randint(0, 10_000) for _ in range(start // 256 + 1)]
            a.swa_released = max(0, start // 64 - 2)
            a.swa[:a.swa_released] = [-1] * a.swa_released
            allocs.append(a)
            chunks.append(SeqChunk(None, start, 1, offset=i))
        parts = decode_tables(chunks, allocs, lanes, n_swa, n_blk, kvc)
        got = dict(zip(("positions", "seq_ids", "swa_page", "swa_off", "slots", "swa_table", "block_table"),
                       upload(parts, torch.device("cpu"))))
        want = _rebuilt(chunks, allocs)
        for name in ("positions", "seq_ids", "swa_page", "swa_off", "slots"):
            assert torch.equal(got[name][:n], want[name]), f"step {step}: {name}"
        for name, width in (("swa_table", n_swa), ("block_table", n_blk)):
            w = want[name].shape[1]
            assert torch.equal(got[name][:n, :w], want[name]), f"step {step}: {name}"
            assert (got[name][:n, w:] == -1).all() and got[name].shape == (lanes, width)
        assert got["seq_ids"].tolist() == list(range(lanes))
        assert (got["positions"][n:] == 0).all() and (got["swa_off"][n:] == 0).all()
        assert (got["swa_page"][n:] == 901).all() and (got["slots"][n:] == 903).all()
        assert (got["swa_table"][n:] == 901).all() and (got["block_table"][n:] == 902).all()
    wide = CacheAllocation(slot=0, swa=list(range(n_swa + 1)), blocks=[0])
    assert decode_tables([SeqChunk(None, 64 * n_swa, 1)], [wide], lanes, n_swa, n_blk, kvc) is None
