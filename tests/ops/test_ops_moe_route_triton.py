"""Triton MoE routing vs the torch op: ids and weights exactly equal (scores in float64 rounded to
float32 on both sides; the same float32 selection key; the same float64 normalisation)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, INTERPRET, gen, randn  # noqa: E402

from dsv4.ops import torch_ops  # noqa: E402
from dsv4.ops.triton import moe as tmoe  # noqa: E402


def _same(a, b):
    (ia, wa), (ib, wb) = a, b
    assert ia.dtype == ib.dtype == torch.int32 and wa.dtype == wb.dtype == torch.float32
    assert torch.equal(ia, ib), (ia, ib)
    torch.testing.assert_close(wa, wb, rtol=0, atol=0, equal_nan=True)


def _both(*args, **kw):
    return tmoe.moe_route(*args, **kw), torch_ops.moe_route(*args, **kw)


@pytest.mark.parametrize("t,e,seed", [(1, 256, 0), (3, 16, 1), (17, 64, 2), (64, 256, 3), (130, 32, 4)])
def test_scored_routing_exact(t, e, seed):
    g = gen(seed)
    logits = randn((t, e), g, 3.0)
    bias = randn((e,), g, 0.5)
    valid = torch.rand(t, generator=g).to(DEV) > 0.2
    for kw in (dict(bias=bias, valid=valid), dict(bias=None, valid=None)):
        a, b = _both(logits, kw["bias"], 6, 1.5, True, None, kw["valid"])
        _same(a, b)
    _same(*_both(logits, bias, 4, 2.5, False))  # no renormalisation, other scale, power-of-two k


def test_selection_uses_bias_but_weights_do_not():
    logits = torch.zeros(1, 8, device=DEV)
    logits[0, 0] = 5.0
    bias = torch.zeros(8, device=DEV)
    bias[7] = 100.0
    ids, w = tmoe.moe_route(logits, bias, 2, 1.0, True)
    assert ids.tolist() == [[7, 0]]
    s = torch.sqrt(F.softplus(logits[0, [7, 0]].double())).float()
    torch.testing.assert_close(w[0], (s.double() / s.double().sum()).float(), rtol=0, atol=0)


def test_ties_go_to_lowest_expert_id():
    e = 16
    logits = torch.zeros(4, e, device=DEV)
    logits[1, [3, 9, 12]] = 2.0  # three equal winners, then ties among zeros
    logits[2] = torch.arange(e, device=DEV).float().flip(0) // 4  # groups of 4 equal scores
    bias = torch.zeros(e, device=DEV)
    got = tmoe.moe_route(logits, bias, 6, 1.5, True)
    _same(got, torch_ops.moe_route(logits, bias, 6, 1.5, True))
    ids = got[0].tolist()
    assert ids[0] == [0, 1, 2, 3, 4, 5]
    assert ids[1] == [3, 9, 12, 0, 1, 2]
    assert ids[2] == [0, 1, 2, 3, 4, 5]
    # equal keys built from different scores: key[2] = s2 + (s5 - s2) == s5 = key[5] exactly
    # (s5 - s2 is exact by Sterbenz since s2 <= s5 <= 2 s2); the lower id wins although s2 < s5
    logits = torch.full((1, 8), -30.0, device=DEV)
    logits[0, 5], logits[0, 2] = 1.3, 0.9
    sc = torch.sqrt(F.softplus(logits.double())).float()[0]
    bias = torch.zeros(8, device=DEV)
    bias[2] = sc[5] - sc[2]
    assert bool(sc[2] + bias[2] == sc[5] + bias[5]) and bool(sc[2] < sc[5])
    got = tmoe.moe_route(logits, bias, 2, 1.0, True)
    _same(got, torch_ops.moe_route(logits, bias, 2, 1.0, True))
    assert got[0].tolist() == [[2, 5]]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN rows normalise to NaN
def test_nan_and_inf_logits():
    g = gen(5)
    e = 32
    logits = randn((6, e), g, 2.0)
    logits[0, 4] = float("nan")  # never chosen while finite scores remain
    logits[1, :] = float("nan")  # every key is -1e30: ids 0..5 by the tie rule, weights NaN
    logits[2, 7] = float("inf")  # +inf score -> FLT_MAX key, chosen first
    logits[3, 9] = float("-inf")  # score 0
    logits[4, :20] = float("nan")
    bias = randn((e,), g, 0.1)
    a, b = _both(logits, bias, 6, 1.5, True)
    _same(a, b)
    ids = a[0].tolist()
    assert 4 not in ids[0]
    assert ids[1] == [0, 1, 2, 3, 4, 5] and torch.isnan(a[1][1]).all()
    assert ids[2][0] == 7
    assert all(i >= 20 for i in ids[4])


def test_hash_layers():
    g = gen(6)
    t, e, k = 37, 64, 6
    logits = randn((t, e), g, 2.0)
    hash_ids = torch.randint(0, e, (t, k), generator=g).to(DEV)
    hash_ids[3] = 5  # repeated ids are allowed in the table
    valid = torch.ones(t, dtype=torch.bool, device=DEV)
    valid[[0, 10, 36]] = False
    for hid in (hash_ids, hash_ids.to(torch.int32), hash_ids.t().contiguous().t()):  # int64/int32/strided
        a, b = _both(logits, None, k, 1.5, True, hid, valid)
        _same(a, b)
    ids = a[0]
    assert torch.equal(ids[valid], hash_ids[valid].to(torch.int32))
    assert (ids[~valid] == -1).all() and (a[1][~valid] == 0).all()


def test_padding_rows():
    g = gen(7)
    logits = randn((9, 16), g)
    valid = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool, device=DEV)
    a, b = _both(logits, randn((16,), g), 6, 1.5, True, None, valid)
    _same(a, b)
    ids, w = a
    assert (ids[~valid] == -1).all() and (w[~valid] == 0).all()
    assert (ids[valid] >= 0).all() and (w[valid] > 0).all()
    ids0, w0 = tmoe.moe_route(logits, None, 6, 1.5, True, None, torch.zeros(9, dtype=torch.bool, device=DEV))
    assert (ids0 == -1).all() and (w0 == 0).all()


@pytest.mark.parametrize("cfg", [dict(BLOCK_T=1, num_warps=1), dict(BLOCK_T=2, num_warps=2),
                                 dict(BLOCK_T=8), dict(BLOCK_T=32, num_warps=8)])
def test_launch_config_does_not_change_results(cfg):
    """Rows are independent: any BLOCK_T / num_warps gives the default's ids and weights exactly
    (scored with bias and padding rows, hash layers, no renormalisation)."""
    g = gen(8)
    t, e, k = 19, 64, 6
    logits = randn((t, e), g, 2.0)
    bias = randn((e,), g, 0.3)
    valid = torch.rand(t, generator=g).to(DEV) > 0.25
    hash_ids = torch.randint(0, e, (t, k), generator=g).to(DEV)
    for args in ((logits, bias, k, 1.5, True, None, valid), (logits, None, k, 1.5, True, hash_ids, valid),
                 (logits, bias, 4, 2.5, False, None, None)):
        ref = tmoe.moe_route(*args)
        got = tmoe.moe_route(*args, config=cfg)
        _same(got, ref)
        _same(got, torch_ops.moe_route(*args))


def test_launch_config_validation():
    logits = torch.zeros(2, 8, device=DEV)
    if not INTERPRET:  # the default launch shape (H200 sweep); the interpreter takes 16 rows a program
        assert tmoe.route_config(256) == dict(BLOCK_T=1, num_warps=4)
        assert tmoe.route_config(256, t=8192) == dict(BLOCK_T=1, num_warps=1)
    for bad in (dict(BLOCK_T=3), dict(num_warps=0), dict(BLOCK_M=16)):
        with pytest.raises(ValueError):
            tmoe.moe_route(logits, None, 2, config=bad)
