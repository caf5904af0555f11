"""Triton grouped expert GEMMs (MXFP4 and FP8 experts) vs the torch op on fresh random inputs.

Tolerances. fp32 activations: both sides accumulate the same exact products in fp32 (order differs)
and the kernel's silu runs in fp32 instead of float64: relative differences ~1e-6, checked at
1e-5 of the output scale. bf16 activations: the kernel rounds g, u, h and y to bf16 exactly where
the reference does, so differences come only from an fp32 accumulation-order change flipping one of
those roundings: allowed one bf16 spacing (2^-8) of each element plus 2^-8 of the output scale.
Padding rows (id -1) must be exactly zero.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import BF16_ULP, DEV, fp8_experts, gen, mxfp4_experts, randn  # noqa: E402

from dsv4.ops import stack_experts, torch_ops  # noqa: E402
from dsv4.ops.invariance import set_batch_invariant  # noqa: E402
from dsv4.ops.triton import moe as tmoe  # noqa: E402

E, K, H, I = 8, 6, 128, 64  # top-6 as in Flash; few experts keep the interpreter fast


def _route(t, g, n_exp=E, topk=K, valid=None):
    return torch_ops.moe_route(randn((t, n_exp), g, 2.0), randn((n_exp,), g, 0.1), topk, 1.5, True, None, valid)


def _check(y, ref, x_dtype):
    assert y.dtype == ref.dtype == x_dtype and y.shape == ref.shape
    yf, rf = y.float(), ref.float()
    scale = rf.abs().max().item() + 1e-30
    if x_dtype == torch.float32:
        lim = 1e-5 * scale
    else:
        lim = BF16_ULP * rf.abs() + BF16_ULP * scale
    d = (yf - rf).abs()
    assert bool((d <= lim).all()), f"max |diff| {d.max().item():.3g} (output scale {scale:.3g})"


@pytest.fixture(scope="module")
def fp4_layer():
    return stack_experts(*mxfp4_experts(E, H, I, gen(1)))


# (interpreter cost grows with the number of programs: BLOCK_N 128 halves it where the default
# configuration is already covered)
@pytest.mark.parametrize("t,dtype,seed,cfg", [(1, torch.float32, 0, None), (3, torch.bfloat16, 1, {"BLOCK_N": 128}),
                                              (17, torch.float32, 2, None), (17, torch.bfloat16, 3, {"BLOCK_N": 128})])
def test_fp4_experts_match_torch(fp4_layer, t, dtype, seed, cfg):
    g = gen(seed)
    x = randn((t, H), g, dtype=dtype)
    valid = torch.ones(t, dtype=torch.bool, device=DEV)
    if t > 1:
        valid[t // 2] = False  # one padding row
    ids, w = _route(t, g, valid=valid)
    before = set_batch_invariant(False)  # the fastest per-T choice: GEMV (direct) kernels for small T
    try:
        mode = tmoe.pick_moe_config(t, K, E, "fp4")
        assert mode["direct"] == (t * K <= tmoe.DIRECT_MAX_SLOTS)
        y = tmoe.moe_experts(x, ids, w, *fp4_layer, config=cfg)
    finally:
        set_batch_invariant(before)
    ref = torch_ops.moe_experts(x, ids, w, *fp4_layer)
    _check(y, ref, dtype)
    assert (y[~valid] == 0).all()


@pytest.mark.parametrize("cfg", [{"direct": False, "BLOCK_M": 16, "BLOCK_N": 128, "num_stages": 2},
                                 {"direct": False, "BLOCK_M": 32, "BLOCK_K": 256}])
def test_fp4_grouped_mode_configs_and_padding(fp4_layer, cfg):
    g = gen(4)
    t = 7
    x = randn((t, H), g)
    valid = torch.tensor([1, 0, 1, 1, 0, 1, 0], dtype=torch.bool, device=DEV)
    ids, w = _route(t, g, valid=valid)
    y = tmoe.moe_experts(x, ids, w, *fp4_layer, config=cfg)
    ref = torch_ops.moe_experts(x, ids, w, *fp4_layer)
    _check(y, ref, torch.float32)
    assert (y[~valid] == 0).all() and (ref[~valid] == 0).all()
    assert (y[valid].abs().sum(-1) > 0).all()


def test_all_padding_gives_zeros(fp4_layer):
    g = gen(5)
    x = randn((4, H), g)
    ids = torch.full((4, K), -1, dtype=torch.int32, device=DEV)
    w = torch.zeros(4, K, device=DEV)
    for cfg in ({"BLOCK_N": 128}, {"direct": False, "BLOCK_N": 128}):
        y = tmoe.moe_experts(x, ids, w, *fp4_layer, config=cfg)
        assert (y == 0).all()


def test_limit_clamps_are_applied(fp4_layer):
    """Large activations: gate clamped from above only, up on both sides (limit 10 vs 0.5)."""
    g = gen(6)
    x = randn((1, H), g, 40.0)
    ids, w = _route(1, g)
    y = tmoe.moe_experts(x, ids, w, *fp4_layer, limit=0.5, config={"BLOCK_N": 128})
    ref = torch_ops.moe_experts(x, ids, w, *fp4_layer, limit=0.5)
    _check(y, ref, torch.float32)
    assert not torch.allclose(ref, torch_ops.moe_experts(x, ids, w, *fp4_layer, limit=1e9))


@pytest.mark.parametrize("scale_fmt,dtype", [("fp32", torch.float32), ("ue8m0", torch.bfloat16)])
def test_fp8_experts_match_torch(scale_fmt, dtype):
    """Base-checkpoint FP8 experts; I = 160 is not a multiple of 128 (W3's scale rows start at 2)."""
    g = gen(7)
    n_exp, topk, hidden, inter = 8, 2, 128, 160
    layer = stack_experts(*fp8_experts(n_exp, hidden, inter, g, scale_fmt))
    assert layer[0].dtype == torch.float8_e4m3fn and layer[1].shape == (n_exp, 4, 1)
    t = 3
    x = randn((t, hidden), g, dtype=dtype)
    valid = torch.tensor([True, False, True], device=DEV)
    ids, w = _route(t, g, n_exp, topk, valid)
    y = tmoe.moe_experts(x, ids, w, *layer)
    ref = torch_ops.moe_experts(x, ids, w, *layer)
    _check(y, ref, dtype)
    assert (y[1] == 0).all()


def test_group_slots_layout():
    g = gen(8)
    t, n_exp, bm = 11, 8, 4
    ids = torch.randint(0, n_exp, (t, 3), generator=g).to(torch.int32)
    ids[2] = -1
    ids[5, 1] = -1
    slot_ids, bexp = tmoe.group_slots(ids.to(DEV), n_exp, bm)
    slot_ids, bexp = slot_ids.cpu(), bexp.cpu()
    flat = ids.reshape(-1)
    placed = slot_ids[slot_ids >= 0]
    assert sorted(placed.tolist()) == [i for i in range(flat.numel()) if flat[i] >= 0]  # each valid slot once
    assert bexp.numel() == -(-flat.numel() // bm) + min(n_exp, flat.numel())
    used = (bexp >= 0).sum().item()
    assert (bexp[used:] == -1).all() and (bexp[:used] >= 0).all()
    assert torch.equal(bexp[:used], bexp[:used].sort().values)  # experts in ascending order
    for b in range(used):
        rows = slot_ids[b * bm:(b + 1) * bm]
        rows = rows[rows >= 0]
        assert rows.numel() > 0 and (flat[rows.long()] == bexp[b]).all()
    assert (slot_ids[used * bm:] == -1).all()
