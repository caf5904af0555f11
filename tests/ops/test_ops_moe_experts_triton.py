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

from dsv4.formats.experts import stack_experts
from dsv4.ops import torch_ops  # noqa: E402
from dsv4.ops.invariance import set_batch_invariant  # noqa: E402
from dsv4.ops.triton import moe as tmoe  # noqa: E402
from dsv4.ops.triton._common import interpreting  # noqa: E402

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


def _padded_batch(t, seed, dtype, pad_row):
    """(x, ids, weights, valid) of t tokens with row ``pad_row`` a padding row (id -1)."""
    g = gen(seed)
    x = randn((t, H), g, dtype=dtype)
    valid = torch.ones(t, dtype=torch.bool, device=DEV)
    valid[pad_row] = False
    ids, w = _route(t, g, valid=valid)
    return x, ids, w, valid


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


def test_register_caps_reach_the_launch_and_keep_the_bits(fp4_layer, monkeypatch):
    """``maxnreg`` / ``down_maxnreg`` (tuning keys) go to the grouped kernels' launches and nowhere
    else; the output is the uncapped launch's (compiled, only register allocation differs)."""
    g = gen(13)
    x = randn((5, H), g)
    ids, w = _route(5, g)
    cfg = {"direct": False, "BLOCK_N": 128}
    want = tmoe.moe_experts(x, ids, w, *fp4_layer, config=cfg)
    seen = {}
    for name in ("_moe_up_kernel", "_moe_down_kernel"):
        kern = getattr(tmoe, name)

        class Spy:
            def __getitem__(self, grid, kern=kern, name=name):
                def launch(*args, **kw):
                    seen[name] = kw.get("maxnreg")
                    return kern[grid](*args, **kw)
                return launch

        monkeypatch.setattr(tmoe, name, Spy())
    got = tmoe.moe_experts(x, ids, w, *fp4_layer, config=dict(cfg, maxnreg=96, down_maxnreg=64))
    assert seen == {"_moe_up_kernel": 96, "_moe_down_kernel": 64}
    assert torch.equal(got, want)
    tmoe.moe_experts(x, ids, w, *fp4_layer, config=cfg)
    assert seen == {"_moe_up_kernel": None, "_moe_down_kernel": None}


@pytest.mark.parametrize("block_k,dtype", [(64, torch.float32), (64, torch.bfloat16), (128, torch.bfloat16)])
def test_scale_look_ahead_gives_the_same_bits(fp4_layer, block_k, dtype):
    """``scale_ahead`` (default) loads each K step's MXFP4 scale bytes one step early (the last load
    runs past the scales, masked) and ``even_k`` (default) drops the K masks: the same values reach
    the same instructions, so the output is the plain loop's bit for bit, and the torch op's within
    the bf16 tolerance. BLOCK_K 64 gives the up kernel two K steps (H = 128), so a step really uses
    the bytes the step before loaded."""
    t = 9
    x, ids, w, valid = _padded_batch(t, 21, dtype, pad_row=4)
    cfg = {"direct": False, "BLOCK_N": 128, "BLOCK_K": block_k}
    assert tmoe.pick_moe_config(t, K, E, "fp4", cfg)["scale_ahead"]  # the default
    want = tmoe.moe_experts(x, ids, w, *fp4_layer, config=dict(cfg, scale_ahead=False, even_k=False))
    got = tmoe.moe_experts(x, ids, w, *fp4_layer, config=cfg)
    assert torch.equal(got, want)
    _check(got, torch_ops.moe_experts(x, ids, w, *fp4_layer), dtype)
    assert (got[~valid] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_major_scales_give_the_same_bits(fp4_layer, dtype):
    """MXFP4 scales stored groups-major (a transposed view: a K step's bytes of adjacent rows are
    adjacent) hold the same values at other addresses: the kernels read them through the strides
    and give the checkpoint layout's output bit for bit; so does the torch op."""
    w13, s13, w2, s2 = fp4_layer
    s13g, s2g = (s.transpose(1, 2).contiguous().transpose(1, 2) for s in (s13, s2))
    assert s13g.stride(1) == 1 and torch.equal(s13g, s13)
    g = gen(23)
    t = 11
    x = randn((t, H), g, dtype=dtype)
    ids, w = _route(t, g)
    cfg = {"direct": False, "BLOCK_N": 128, "BLOCK_K": 64}
    want = tmoe.moe_experts(x, ids, w, w13, s13, w2, s2, config=cfg)
    assert torch.equal(tmoe.moe_experts(x, ids, w, w13, s13g, w2, s2g, config=cfg), want)
    assert torch.equal(torch_ops.moe_experts(x, ids, w, w13, s13g, w2, s2g),
                       torch_ops.moe_experts(x, ids, w, *fp4_layer))


@pytest.mark.parametrize("kperm,dtype", [(False, torch.bfloat16), (True, torch.float32), (True, torch.bfloat16)])
def test_k_order_of_the_mma_operands(fp4_layer, kperm, dtype):
    """``kperm`` (the default) feeds the MMA the weight bytes and activation columns in the register
    operand's order; off, in memory order. Both are the torch op within the bf16 tolerance; with
    several K steps (BLOCK_K 64) and a padding row."""
    assert tmoe.pick_moe_config(9, K, E, "fp4")["kperm"] and not tmoe.pick_moe_config(9, K, E, "fp8")["kperm"]
    x, ids, w, valid = _padded_batch(9, 51, dtype, pad_row=2)
    got = tmoe.moe_experts(
        x, ids, w, *fp4_layer, config={"direct": False, "BLOCK_N": 128, "BLOCK_K": 64, "kperm": kperm}
    )
    _check(got, torch_ops.moe_experts(x, ids, w, *fp4_layer), dtype)
    assert (got[~valid] == 0).all()


@pytest.mark.parametrize(
    "dtype,expert_dtype", [(torch.float32, "fp4"), (torch.bfloat16, "fp4"), (torch.bfloat16, "fp8")]
)
def test_tail_blocks_at_half_the_rows_give_the_same_bits(fp4_layer, dtype, expert_dtype):
    """``tail``: blocks whose second half holds no slot run in a second launch of BLOCK_M / 2 rows. 40
    tokens × 6 over 8 experts at BLOCK_M 32 give both kinds of block (checked on the grouping), and padding
    rows. Compiled, each token's row must be the single launch's bitwise (the same K steps; the MMA's
    N width does not change a row's sums). Under the interpreter a dot is numpy's fp32 matmul, whose
    summation order depends on the operands' shapes (1-ulp differences in fp32), so there both launches
    are held to the torch op's tolerance instead."""
    layer = fp4_layer if expert_dtype == "fp4" else stack_experts(*fp8_experts(E, H, I, gen(8), "ue8m0"))
    x, ids, w, valid = _padded_batch(40, 61, dtype, pad_row=5)
    cfg = {"direct": False, "BLOCK_M": 32, "BLOCK_N": 64}
    on = tmoe.pick_moe_config(40, K, E, expert_dtype, cfg, dtype)
    assert on["tail"] and on["tail_BLOCK_N"] == 64 and on["tail_num_warps"] == 4
    slot_ids, bexp = tmoe.group_slots(ids.to(torch.int32), E, 32)
    used = bexp >= 0
    second_half = slot_ids.view(-1, 32)[:, 16] >= 0
    assert (used & second_half).any() and (used & ~second_half).any(), "want full and tail blocks"
    got = tmoe.moe_experts(x, ids, w, *layer, config=cfg)
    want = tmoe.moe_experts(x, ids, w, *layer, config=dict(cfg, tail=False))
    ref = torch_ops.moe_experts(x, ids, w, *layer)
    if interpreting():
        _check(want, ref, dtype)
    else:
        assert torch.equal(got, want)
    _check(got, ref, dtype)
    assert (got[~valid] == 0).all()
    assert not tmoe.pick_moe_config(1, K, 256, "fp4")["tail"]  # the decode tile: one launch
    assert tmoe.pick_moe_config(8192, K, 256, "fp4")["tail"]
    with pytest.raises(ValueError, match="tail needs"):
        tmoe.pick_moe_config(1, K, 256, "fp4", {"tail": True})


@pytest.mark.parametrize("t,dtype,cfg", [(1, torch.bfloat16, {}), (9, torch.float32, {"BLOCK_K": 64}),
                                         (40, torch.bfloat16, {"BLOCK_M": 32, "tail": False})])
def test_gate_and_up_rows_in_one_mma_operand_give_the_same_bits(fp4_layer, t, dtype, cfg):
    """``merge_gu``: the up kernel multiplies the gate rows and the up rows as one 2·BLOCK_N-row tile. A
    row's products and their order are the separate tiles', so compiled the output is theirs bit for bit
    (a decode step, several K steps, several tokens per expert, a padding row); under the interpreter a dot
    is numpy's matmul, whose order follows the operands' shapes, so there both are held to the torch op's
    tolerance. FP8 experts ignore the key."""
    x, ids, w, valid = _padded_batch(max(t, 2), 71, dtype, pad_row=0 if t > 1 else 1)
    x, ids, w, valid = x[:t], ids[:t], w[:t], valid[:t]  # t = 1: the batch's valid row alone
    base = dict({"direct": False, "BLOCK_N": 64}, **cfg)
    got = tmoe.moe_experts(x, ids, w, *fp4_layer, config=dict(base, merge_gu=True))
    want = tmoe.moe_experts(x, ids, w, *fp4_layer, config=dict(base, merge_gu=False))
    ref = torch_ops.moe_experts(x, ids, w, *fp4_layer)
    if not interpreting():
        assert torch.equal(got, want)
    _check(got, ref, dtype)
    _check(want, ref, dtype)
    assert (got[~valid] == 0).all()


def test_ptx_decode_asked_where_it_cannot_run_is_refused_by_name(fp4_layer):
    from dsv4.ops.triton._common import ptx_fp4

    x = torch.zeros(2, H, device=DEV)  # fp32 activations: never the PTX decode
    ids, w = _route(2, gen(7))
    assert not ptx_fp4(torch.device(DEV), torch.float32)
    with pytest.raises(ValueError, match="ptx_fp4=True needs bf16"):
        tmoe.moe_experts(x, ids, w, *fp4_layer, config={"ptx_fp4": True})


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
        rows = slot_ids[b * bm : (b + 1) * bm]
        rows = rows[rows >= 0]
        assert rows.numel() > 0 and (flat[rows.long()] == bexp[b]).all()
    assert (slot_ids[used * bm :] == -1).all()


def _group_cases():
    """(name, ids [T, topk], n_experts, block_m) on fresh random inputs plus the corner cases."""
    g = gen(9)
    cases = []
    for t, k, n_exp, bm in (
        (1, 6, 256, 16),
        (1, 1, 8, 16),
        (3, 6, 8, 16),
        (8, 6, 256, 32),
        (11, 6, 64, 16),
        (64, 6, 256, 16),
        (64, 6, 256, 32),
        (64, 6, 8, 16),
        (40, 4, 64, 32),
        (300, 2, 8, 16),  # an eager step's size: a prefill chunk beside decodes
        (96, 6, 64, 32),
    ):
        ids = torch.randint(0, n_exp, (t, k), generator=g)
        cases.append((f"random t={t} k={k} E={n_exp} bm={bm}", ids, n_exp, bm))
        pad = ids.clone()
        pad[torch.rand(t, generator=g) < 0.3] = -1  # padding tokens
        pad.view(-1)[torch.rand(t * k, generator=g) < 0.1] = -1
        cases.append((f"with -1 t={t} k={k} E={n_exp} bm={bm}", pad, n_exp, bm))
    cases.append(("one expert", torch.full((64, 6), 5), 256, 16))
    cases.append(("one expert, last", torch.full((20, 6), 63), 64, 32))
    cases.append(("every slot its own expert", torch.randperm(256, generator=g)[:36].reshape(6, 6), 256, 16))
    cases.append(("every expert used", torch.randperm(64, generator=g).reshape(8, 8), 64, 16))
    cases.append(("all -1", torch.full((5, 6), -1), 64, 16))
    cases.append(("n = 1, padding", torch.full((1, 1), -1), 8, 16))
    cases.append(("full blocks", torch.arange(8).repeat_interleave(32).reshape(32, 8), 8, 32))
    return cases


@pytest.mark.parametrize("name,ids,n_exp,bm", _group_cases(), ids=[c[0] for c in _group_cases()])
def test_group_slots_triton_equals_torch(name, ids, n_exp, bm):
    """The decode-size Triton grouping returns exactly the torch version's tensors."""
    for dt in (torch.int32, torch.int64):
        ref = tmoe.group_slots(ids.to(dt).to(DEV), n_exp, bm)
        got = tmoe.group_slots_triton(ids.to(dt).to(DEV), n_exp, bm)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, (a.shape, b.shape)
            assert torch.equal(a, b), (name, a.tolist(), b.tolist())


def test_group_slots_triton_chunks():
    """Several programs (small chunk): each recounts the histogram, slots and blocks split across them."""
    g = gen(10)
    ids = torch.randint(-1, 16, (37, 6), generator=g).to(DEV)
    ref = tmoe.group_slots(ids, 16, 16)
    for chunk in (8, 16):
        got = tmoe.group_slots_triton(ids, 16, 16, chunk=chunk)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


# --- the PTX MXFP4 decode (CUDA sm_80+, bf16): bit-identical to the portable decode -------------


def _ptx_available():
    from dsv4.ops.triton._common import ptx_fp4

    return DEV != "cpu" and ptx_fp4(torch.device(DEV), torch.bfloat16)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _decode_tile_kernel(
    w_ptr,
    s_ptr,
    lo_ptr,
    hi_ptr,
    KH,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PTX: tl.constexpr,
    FOLD: tl.constexpr = False,
):
    rows = tl.arange(0, BLOCK_N)
    sb = tmoe._fp4_scale_bytes(s_ptr, rows, rows < BLOCK_N, 0, KH, BLOCK_K // 32, 1, BLOCK_K)
    lo, hi = tmoe._w_tile_fp4(
        w_ptr, sb, rows, rows < BLOCK_N, 0, KH, BLOCK_K // 2, 1, BLOCK_N, BLOCK_K, tl.bfloat16, False, PTX, FOLD=FOLD
    )
    j = tl.arange(0, BLOCK_K // 2)
    off = rows[:, None] * (BLOCK_K // 2) + j[None, :]
    tl.store(lo_ptr + off, lo)
    tl.store(hi_ptr + off, hi)


@pytest.mark.skipif(not _ptx_available(), reason="PTX MXFP4 decode needs a CUDA sm_80+ GPU (compiled)")
def test_ptx_fp4_decode_is_the_portable_decode_bitwise():
    """Every byte (both nibbles) under scale codes from the subnormal end (0, 1, 2) through the
    weights' range to the top (253, 254) and NaN (255): the same bf16 bits as the portable path."""
    n, kb = 64, 128  # 64 rows × 128 k = 64 bytes a row, 4 scale groups a row
    codes = torch.tensor(
        [0, 1, 2, 3, 60, 100, 118, 120, 122, 124, 125, 126, 127, 128, 129, 130, 140, 200, 252, 253, 254, 255],
        dtype=torch.uint8,
    )
    w = (torch.arange(n * kb // 2) % 256).to(torch.uint8).view(n, kb // 2)
    w = w[torch.randperm(n, generator=torch.Generator().manual_seed(0))].contiguous()
    s = codes[torch.arange(n * kb // 32) % len(codes)].view(n, kb // 32).contiguous()
    out = {}
    for ptx in (False, True):
        lo = torch.empty(n, kb // 2, dtype=torch.bfloat16, device=DEV)
        hi = torch.empty_like(lo)
        _decode_tile_kernel[(1,)](w.to(DEV), s.to(DEV), lo, hi, kb, BLOCK_N=n, BLOCK_K=kb, PTX=ptx)
        out[ptx] = (lo.cpu(), hi.cpu())
    for a, b in zip(out[False], out[True]):
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b))
        assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))
    assert int(torch.isnan(out[False][0]).sum()) > 0 and int((out[False][0] == 0).sum()) > 0


@pytest.mark.skipif(not _ptx_available(), reason="PTX MXFP4 decode needs a CUDA sm_80+ GPU (compiled)")
@pytest.mark.parametrize("t,direct", [(2, True), (2, False), (40, False)])
def test_ptx_fp4_experts_equal_the_portable_decode_bitwise(fp4_layer, t, direct):
    g = gen(40 + t)
    x = randn((t, H), g, dtype=torch.bfloat16)
    ids, w = _route(t, g)
    ys = [tmoe.moe_experts(x, ids, w, *fp4_layer, config={"direct": direct, "ptx_fp4": p}) for p in (False, True)]
    assert torch.equal(ys[0], ys[1])
    _check(ys[1], torch_ops.moe_experts(x, ids, w, *fp4_layer), torch.bfloat16)


@pytest.mark.skipif(not _ptx_available(), reason="PTX MXFP4 decode needs a CUDA sm_80+ GPU (compiled)")
def test_folded_ptx_decode_is_the_portable_decode_bitwise():
    """The folded decode (E2M1 bias in the scale) over every byte and every code it is used for,
    0..128: the portable decode's bits (the emulated check of the same asm is
    ``test_ops_fp4_ptx_emulated.py``)."""
    n, kb = 64, 128
    codes = torch.arange(129, dtype=torch.uint8)
    w = (torch.arange(n * kb // 2) % 256).to(torch.uint8).view(n, kb // 2)
    w = w[torch.randperm(n, generator=torch.Generator().manual_seed(1))].contiguous()
    out = {}
    for shift in (0, 128):  # 256 scale slots a tile: codes 0..128 all appear over the two tiles
        s = codes[(torch.arange(n * kb // 32) + shift) % len(codes)].view(n, kb // 32).contiguous()
        for mode in ("portable", "fold"):
            lo = torch.empty(n, kb // 2, dtype=torch.bfloat16, device=DEV)
            hi = torch.empty_like(lo)
            _decode_tile_kernel[(1,)](
                w.to(DEV), s.to(DEV), lo, hi, kb, BLOCK_N=n, BLOCK_K=kb, PTX=mode == "fold", FOLD=mode == "fold"
            )
            out[shift, mode] = (lo.cpu().view(torch.int16), hi.cpu().view(torch.int16))
        assert all(torch.equal(a, b) for a, b in zip(out[shift, "portable"], out[shift, "fold"]))


@pytest.mark.skipif(not _ptx_available(), reason="PTX MXFP4 decode needs a CUDA sm_80+ GPU (compiled)")
@pytest.mark.parametrize("t,direct", [(1, False), (2, True), (40, False), (300, False)])
def test_folded_scales_give_the_same_bits(fp4_layer, t, direct):
    """moe_experts with the folded decode (the default where the codes allow it) and without it."""
    s13, s2 = fp4_layer[1], fp4_layer[3]
    assert tmoe._fold_ok(s13, s13.view(torch.uint8)) and tmoe._fold_ok(s2, s2.view(torch.uint8))
    g = gen(70 + t)
    x = randn((t, H), g, dtype=torch.bfloat16)
    ids, w = _route(t, g)
    ys = [tmoe.moe_experts(x, ids, w, *fp4_layer, config={"direct": direct, "fold_scales": f}) for f in (False, True)]
    assert torch.equal(ys[0], ys[1])


@pytest.mark.skipif(not _ptx_available(), reason="PTX MXFP4 decode needs a CUDA sm_80+ GPU (compiled)")
def test_a_scale_code_above_128_keeps_the_two_multiply_decode(fp4_layer):
    """One expert's scale of 2^2 (code 129) in W1: the up kernel must not fold (2^128 is no bf16), the
    down kernel still may; the output equals the portable decode's bit for bit."""
    w13, s13, w2, s2 = (t.clone() for t in fp4_layer)  # the module's layer stays unchanged
    s13.view(torch.uint8)[3, 5, 1] = 129
    assert not tmoe._fold_ok(s13, s13.view(torch.uint8)) and tmoe._fold_ok(s2, s2.view(torch.uint8))
    g = gen(91)
    x = randn((24, H), g, dtype=torch.bfloat16)
    ids, w = _route(24, g)
    ys = [tmoe.moe_experts(x, ids, w, w13, s13, w2, s2, config={"ptx_fp4": p}) for p in (False, True)]
    assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_is_a_torch_add_of_the_rounded_sum(fp4_layer, dtype):
    """``add`` (the shared expert's output, added in the combine launch) gives exactly what adding it to the
    op's result in x.dtype gives, in both backends; a padding row (no expert) returns add itself; a wrong
    shape or dtype is refused by name."""
    x, ids, w, valid = _padded_batch(5, 41, dtype, pad_row=2)
    a = randn((5, H), gen(42), dtype=dtype)
    for op in (tmoe.moe_experts, torch_ops.moe_experts):
        assert torch.equal(op(x, ids, w, *fp4_layer, add=a), op(x, ids, w, *fp4_layer) + a), op
    assert torch.equal(tmoe.moe_experts(x, ids, w, *fp4_layer, add=a)[2], a[2])
    with pytest.raises(ValueError, match="add must be"):
        tmoe.moe_experts(x, ids, w, *fp4_layer, add=a[:4])
    with pytest.raises(ValueError, match="add must be"):
        tmoe.moe_experts(x, ids, w, *fp4_layer, add=a.double())


def test_add_as_a_pending_branch_is_joined_once_before_the_combine(fp4_layer):
    """``add`` as a ``Pending`` (the shared expert forked beside the routed ones): both backends join it once
    and give the tensor's result; the Triton op has joined it when it launches the combine, which adds it."""
    from dsv4.model.branches import Pending

    x, ids, w, _ = _padded_batch(5, 43, torch.bfloat16, pad_row=1)
    a = randn((5, H), gen(44), dtype=torch.bfloat16)
    launched, joins = [], []
    real = tmoe._moe_combine_kernel

    class Spy:  # records when the combine launches, relative to the join
        def __getitem__(self, grid):
            launched.append(len(joins))
            return real[grid]

    for op in (tmoe.moe_experts, torch_ops.moe_experts):
        p = Pending(a, join=lambda: joins.append(op))
        tmoe._moe_combine_kernel = Spy()
        try:
            got = op(x, ids, w, *fp4_layer, add=p)
        finally:
            tmoe._moe_combine_kernel = real
        assert torch.equal(got, op(x, ids, w, *fp4_layer, add=a)) and joins.count(op) == 1, op
    assert launched == [1]  # the Triton combine launched after the one join


def test_add_as_a_deferred_branch_is_forked_after_the_up_kernel(fp4_layer):
    """``add`` as a ``Deferred`` (the shared expert's activation and w2, forked beside the routed experts): the
    Triton op forks it after its up kernel's launch and before the down kernel's, the torch op where it adds it; both
    fork and join it once and give the tensor's result."""
    from dsv4.model.branches import Deferred, Pending

    x, ids, w, _ = _padded_batch(5, 45, torch.bfloat16, pad_row=1)
    a = randn((5, H), gen(46), dtype=torch.bfloat16)
    events = []
    real = {name: getattr(tmoe, name) for name in ("_moe_up_kernel", "_moe_down_kernel")}

    class Spy:  # records each launch in order with the forks
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            events.append(self.name)
            return real[self.name][grid]

    for op in (tmoe.moe_experts, torch_ops.moe_experts):
        events.clear()
        d = Deferred(lambda after: events.append(("fork", after)) or Pending(a, join=lambda: events.append("join")))
        for name in real:
            setattr(tmoe, name, Spy(name))
        try:
            got = op(x, ids, w, *fp4_layer, add=d)
        finally:
            for name, k in real.items():
                setattr(tmoe, name, k)
        assert torch.equal(got, op(x, ids, w, *fp4_layer, add=a)), op
        forks = [e for e in events if isinstance(e, tuple)]
        assert len(forks) == 1 and events.count("join") == 1, (op, events)
        if op is tmoe.moe_experts:
            assert events == ["_moe_up_kernel", ("fork", None), "_moe_down_kernel", "join"], events
        else:
            assert forks == [("fork", None)], events


@pytest.mark.parametrize("t,direct", [(1, True), (5, False)])
def test_act_quant_rounds_x_and_h_as_the_torch_op(t, direct):
    """``act_quant``: x and the SwiGLU output h FP8-rounded per 128 columns before the up and the down kernels (GEMV
    and grouped forms) against the torch op's rounding; and the rounding does change the result."""
    layer = stack_experts(*mxfp4_experts(E, H, 128, gen(5)))
    g = gen(6)
    x = randn((t, H), g, dtype=torch.bfloat16)
    ids, w = _route(t, g)
    before = set_batch_invariant(False)
    try:
        y = tmoe.moe_experts(x, ids, w, *layer, act_quant=True, act_fmt="ocp", config={"direct": direct})
    finally:
        set_batch_invariant(before)
    ref = torch_ops.moe_experts(x, ids, w, *layer, act_quant=True, act_fmt="ocp")
    _check(y, ref, torch.bfloat16)
    assert not torch.equal(ref, torch_ops.moe_experts(x, ids, w, *layer))
    with pytest.raises(ValueError, match="intermediate h's width"):
        tmoe.moe_experts(x, ids, w, *stack_experts(*mxfp4_experts(E, H, I, gen(7))), act_quant=True)
