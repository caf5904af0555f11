"""The Triton greedy pick vs the torch op (``torch.argmax`` + ``isfinite(..).all()``), exactly.

Finite rows: the same id (the lowest among equal maxima) and flag 1, whatever the chunk a maximum
falls in, ties across chunks and lanes included. Rows with NaN or ±inf: flag 0 and an id in range
(the engine samples those rows on the host). A row's pick does not depend on the other rows.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

from dsv4.ops import torch_ops  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import greedy as tg  # noqa: E402


def _check(x):
    got = tg.greedy_pick(x)
    ref = torch_ops.greedy_pick(x)
    assert got.dtype == torch.int64 and got.shape == (2, x.shape[0]) and got.device == x.device
    assert torch.equal(got[1], ref[1]), "all-finite flags differ"
    fin = ref[1].bool()
    assert torch.equal(got[0][fin], ref[0][fin]), "picks of finite rows differ"
    assert bool(((got[0] >= 0) & (got[0] < x.shape[1])).all()), "a pick out of range"
    return got


@pytest.mark.parametrize("V", [1, 37, tg.BLOCK, tg.CHUNK, tg.CHUNK + 1, 3 * tg.CHUNK - 5, 20_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_with_ties(V, dtype):
    g = gen(V)
    x = torch.randint(-4, 4, (5, V), generator=g).float()  # small integers: many tied maxima
    x[1] = torch.randn(V, generator=g)
    _check(x.to(dtype).to(DEV))


def test_ties_across_chunks_lanes_and_signed_zeros():
    V = 3 * tg.CHUNK + 100
    x = torch.full((6, V), -1.0)
    x[0, [5, tg.BLOCK + 5, tg.CHUNK + 2]] = 2.0  # same lane of two steps and another chunk: the first
    x[1, [tg.CHUNK + 7, 2 * tg.CHUNK + 3, 3 * tg.CHUNK + 1]] = 3.0  # the maximum only in later chunks
    x[2, [tg.CHUNK - 1, tg.CHUNK]] = 1.0  # both sides of a chunk boundary
    x[3] = 0.0
    x[3, 0] = -0.0  # -0.0 == 0.0: a tie, the lowest id wins
    x[4, V - 1] = 5.0  # the last id
    x[5] = -3.0e38  # the most negative finite values
    got = _check(x.to(DEV))
    assert got[0].tolist() == [5, tg.CHUNK + 7, tg.CHUNK - 1, 0, V - 1, 0]


def test_non_finite_rows_are_flagged_and_stay_in_range():
    V = 2 * tg.CHUNK + 9
    x = torch.randn(5, V, generator=gen(7))
    x[0, 3] = float("nan")
    x[1, tg.CHUNK + 4] = float("inf")
    x[2, V - 1] = float("-inf")
    x[3] = float("nan")  # every value NaN
    got = _check(x.to(DEV))
    assert got[1].tolist() == [0, 0, 0, 0, 1]


def test_a_row_alone_equals_the_row_in_a_batch_and_strided_input():
    x = torch.randn(9, 5000, generator=gen(11)).to(DEV)
    every = tg.greedy_pick(x)
    for r in (0, 4, 8):
        assert torch.equal(tg.greedy_pick(x[r:r + 1]), every[:, r:r + 1])
    wide = torch.randn(9, 6000, generator=gen(12)).to(DEV)
    assert torch.equal(tg.greedy_pick(wide[:, :5000]), torch_ops.greedy_pick(wide[:, :5000]))


def test_empty_batch_and_bad_input():
    assert tg.greedy_pick(torch.zeros(0, 10, device=DEV)).shape == (2, 0)
    with pytest.raises(ValueError, match="float \\[n, V\\]"):
        tg.greedy_pick(torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="float \\[n, V\\]"):
        tg.greedy_pick(torch.zeros(2, 3, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="no columns"):
        tg.greedy_pick(torch.zeros(2, 0, device=DEV))


def test_registry_resolves_both_backends():
    assert resolve("greedy_pick", force={"greedy_pick": "torch"})[1] is torch_ops.greedy_pick
    assert resolve("greedy_pick", force={"greedy_pick": "triton"})[1] is tg.greedy_pick


def test_the_engine_uses_it_where_the_model_runs_the_fast_path():
    from dsv4.ops import resolve_op_set

    assert resolve_op_set("torch", "reference", "cuda").greedy_pick is None
    assert resolve_op_set("auto", "reference", "cpu").greedy_pick is None
    assert resolve_op_set("triton", "reference", "cpu").greedy_pick is tg.greedy_pick
