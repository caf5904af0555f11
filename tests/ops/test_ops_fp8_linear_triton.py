"""Triton FP8 block-scaled linear vs the torch op on fresh random inputs.

Tolerances: the kernel and the torch op multiply the same operands (the weight is dequantized to
x.dtype in both) and accumulate in fp32, so with fp32 outputs they differ only by summation order:
|Δ| ≤ 1e-5 · Σ_k |x_k w_k| (see ops_kernel_helpers). With bf16 outputs each side rounds once more:
at most one bf16 spacing (up to 2^-7 relative, ``BF16_SPACING_MAX``) on top of that.
"""

import pytest
import torch

from dsv4.ops.invariance import DECODE_MAX_ROWS, set_batch_invariant

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import BF16_SPACING_MAX, DEV, INTERPRET, assert_fp32_accum_close, gen, randn  # noqa: E402

from dsv4.formats import FNUZ, OCP, dequantize_block_fp8, fake_quant_fp8_pow2, quantize_block_fp8  # noqa: E402
from dsv4.ops import torch_ops  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import fp8_linear as tfl  # noqa: E402

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _weights(n, k, g, scale_fmt="ue8m0", fmt=OCP):
    w = torch.randn(n, k, generator=g) * 0.05
    w[: min(n, 40), : min(k, 50)] *= 30.0  # tiles of very different scale
    wq, s = quantize_block_fp8(w, scale_fmt=scale_fmt, fmt=fmt)
    return wq.to(DEV), s.to(DEV)


def _absprod(x, wq, s):
    wd = dequantize_block_fp8(wq, s, out_dtype=x.dtype).float()
    return x.float().abs() @ wd.abs().T


@pytest.mark.parametrize("m", [1, 3, 17, 64, 130])
def test_fp32_activations_partial_edge_blocks(m):
    g = gen(100 + m)
    n, k = (130, 200) if m != 64 else (200, 328)  # N, K not multiples of 128
    wq, s = _weights(n, k, g)
    x = randn((m, k), g)
    y = tfl.fp8_linear(x, wq, s)
    ref = torch_ops.fp8_linear(x, wq, s)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert_fp32_accum_close(y, ref, _absprod(x, wq, s))


@pytest.mark.parametrize("m,seed", [(1, 1), (17, 2), (70, 3)])
def test_bf16_activations(m, seed):
    g = gen(seed)
    n, k = 136, 200
    wq, s = _weights(n, k, g)
    x = randn((m, k), g, dtype=torch.bfloat16)
    ap = _absprod(x, wq, s)
    # fp32 output: same bf16 operands, fp32 accumulation on both sides
    y32 = tfl.fp8_linear(x, wq, s, out_dtype=torch.float32)
    ref32 = torch_ops.fp8_linear(x, wq, s, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert_fp32_accum_close(y32, ref32, ap)
    # bf16 output: one extra rounding on each side
    y = tfl.fp8_linear(x, wq, s)
    ref = torch_ops.fp8_linear(x, wq, s)
    assert y.dtype == torch.bfloat16
    d = (y.float() - ref.float()).abs()
    assert bool((d <= BF16_SPACING_MAX * ref.float().abs() + 1e-5 * ap + 1e-30).all()), d.max()


def test_fp32_block_scales_base_checkpoint_and_scale_dtypes():
    g = gen(7)
    n, k = 160, 256
    wq, s32 = _weights(n, k, g, scale_fmt="fp32")
    assert s32.dtype == torch.float32
    x = randn((5, k), g)
    assert_fp32_accum_close(tfl.fp8_linear(x, wq, s32), torch_ops.fp8_linear(x, wq, s32), _absprod(x, wq, s32))
    xb = x.to(torch.bfloat16)  # non-power-of-two scales: w·s rounded to bf16 on both sides
    assert_fp32_accum_close(tfl.fp8_linear(xb, wq, s32, out_dtype=torch.float32),
                            torch_ops.fp8_linear(xb, wq, s32, out_dtype=torch.float32), _absprod(xb, wq, s32))
    wq8, s8 = _weights(n, k, g)  # UE8M0 given as float8_e8m0fnu, uint8 bytes; weight as fp8 or uint8
    ref = torch_ops.fp8_linear(x, wq8, s8)
    for w_ in (wq8, wq8.view(torch.uint8)):
        for s_ in ([s8, s8.view(torch.uint8)] if E8M0 is not None else [s8]):
            assert_fp32_accum_close(tfl.fp8_linear(x, w_, s_), ref, _absprod(x, wq8, s8))


def test_decode_split_k_and_tile_overrides():
    g = gen(11)
    n, k = 96, 640  # 5 K blocks
    wq, s = _weights(n, k, g)
    x = randn((2, k), g)
    ref = torch_ops.fp8_linear(x, wq, s)
    ap = _absprod(x, wq, s)
    cfg = tfl.pick_config(2, n, k, torch.device(DEV), {"split_k": 2})
    assert cfg["split_k"] == 2 and cfg["chunk"] == 384  # the batch-invariant decode launch: M=2 in a 16-wide MMA
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (tfl.decode_block_m(2), tfl.DECODE_BLOCK_N) == (16, 64)
    set_batch_invariant(False)
    try:
        assert tfl.pick_config(2, n, k, torch.device(DEV))["BLOCK_M"] == 16  # fastest per-M tile
    finally:
        set_batch_invariant(True)
    for over in ({"split_k": 2}, {"split_k": 5, "BLOCK_N": 32}, {"split_k": 1}):
        assert_fp32_accum_close(tfl.fp8_linear(x, wq, s, config=over), ref, ap)
    pre = tfl.pick_config(300, n, k, torch.device(DEV))
    assert pre["BLOCK_M"] == 128 and pre["split_k"] == 1
    big = tfl.pick_config(8192, 4096, 8192, torch.device(DEV))
    # wo_b's K is several chunks on the H200 (132 SMs): the bf16-weight tile; one chunk in the interpreter (8 "SMs")
    chunked = tfl.invariant_chunk(4096, 8192, torch.device(DEV)) < 8192
    want = (tfl.W16_TILE["BLOCK_M"], tfl.W16_TILE["BLOCK_N"], 1) if chunked else (256, 128, 1)
    assert (big["BLOCK_M"], big["BLOCK_N"], big["split_k"]) == want and bool(big.get("w16")) == chunked


def test_leading_dims_and_empty():
    g = gen(12)
    wq, s = _weights(72, 136, g)
    x = randn((2, 3, 136), g)
    y = tfl.fp8_linear(x, wq, s)
    assert y.shape == (2, 3, 72)
    assert_fp32_accum_close(y, torch_ops.fp8_linear(x, wq, s), _absprod(x.reshape(6, 136), wq, s).reshape(2, 3, 72))
    assert tfl.fp8_linear(x[:0], wq, s).shape == (0, 3, 72)


def test_rejects_bad_scale_grid():
    g = gen(13)
    wq, s = _weights(130, 200, g)
    with pytest.raises(ValueError, match="scale grid"):
        tfl.fp8_linear(randn((1, 200), g), wq, s[:1])


@pytest.mark.skipif(not INTERPRET, reason="bitcast path is selected automatically on sm_89+")
def test_native_bitcast_decode_path_matches():
    g = gen(14)
    wq, s = _weights(130, 200, g)
    x = randn((3, 200), g)
    assert_fp32_accum_close(tfl.fp8_linear(x, wq, s, config={"native": True}), torch_ops.fp8_linear(x, wq, s),
                            _absprod(x, wq, s))


def test_fnuz_weights():
    g = gen(15)
    wq, s = _weights(130, 256, g, fmt=FNUZ)
    assert wq.dtype == torch.float8_e4m3fnuz
    x = randn((4, 256), g)
    assert_fp32_accum_close(tfl.fp8_linear(x, wq, s), torch_ops.fp8_linear(x, wq, s), _absprod(x, wq, s))


def test_nan_weight_codes_decode_to_nan():
    g = gen(16)
    wq, s = _weights(64, 128, g)
    wb = wq.view(torch.uint8).clone()
    wb[3, 5] = 0x7F
    x = randn((2, 128), g)
    y = tfl.fp8_linear(x, wb, s)
    ref = torch_ops.fp8_linear(x, wb, s)
    assert torch.isnan(y[:, 3]).all() and torch.isnan(ref[:, 3]).all()
    keep = torch.arange(64, device=y.device) != 3
    assert_fp32_accum_close(y[:, keep], ref[:, keep], _absprod(x, wq, s)[:, keep])


@pytest.mark.parametrize("fmt,mma", [("ocp", False), ("fnuz", False), ("ocp", True)])
def test_act_quant_is_exact_fake_quant(fmt, mma, monkeypatch):
    """Identity weight: y is exactly the per-128 power-of-two FP8 round trip of x (one product an output: exact in the
    FP8 MMA too)."""
    monkeypatch.setattr(tfl, "ACT_QUANT_FP8_MMA", mma)
    g = gen(17)
    k = 256
    x = randn((5, k), g) * torch.logspace(-3, 3, k, device=DEV)
    x[1, :128] = 0.0  # all-zero block (amax floor 1e-4)
    x[2, 7] = 1e-30  # underflows to zero / subnormal grid
    eye_q, eye_s = quantize_block_fp8(torch.eye(k))
    y = tfl.fp8_linear(x, eye_q.to(DEV), eye_s.to(DEV), act_quant=True, act_fmt=fmt)
    want = fake_quant_fp8_pow2(x.float().cpu(), 128, fmt).to(DEV)
    assert torch.equal(y, want)


def test_act_quant_random_and_platform_default(monkeypatch):
    g = gen(18)
    wq, s = _weights(136, 384, g)
    x = randn((9, 384), g)
    ref = torch_ops.fp8_linear(x, wq, s, act_quant=True, act_fmt="ocp")
    xq = fake_quant_fp8_pow2(x.float().cpu(), 128, OCP).to(DEV)
    assert_fp32_accum_close(tfl.fp8_linear(x, wq, s, act_quant=True, act_fmt="ocp"), ref, _absprod(xq, wq, s))
    from dsv4.ops.platform import detect_platform

    monkeypatch.setenv("DSV4_PLATFORM_FP8", "fnuz")  # the platform's format (224 max) is the default
    detect_platform.cache_clear()
    try:
        y = tfl.fp8_linear(x, wq, s, act_quant=True)
        ref_fnuz = torch_ops.fp8_linear(x, wq, s, act_quant=True)
    finally:
        monkeypatch.delenv("DSV4_PLATFORM_FP8")
        detect_platform.cache_clear()
    xf = fake_quant_fp8_pow2(x.float().cpu(), 128, FNUZ).to(DEV)
    assert_fp32_accum_close(y, ref_fnuz, _absprod(xf, wq, s))
    # FNUZ (bias 8, quant max 224) is OCP's grid (bias 7, 448) shifted by one binade, and the
    # power-of-two block scale absorbs the shift: the dequantized values agree, only the bytes differ
    assert torch.equal(xf, xq)
    with pytest.raises(ValueError, match="multiple of 128"):
        tfl.fp8_linear(randn((1, 200), g), *_weights(8, 200, g), act_quant=True)


@pytest.mark.parametrize("fmt,dtype", [("ocp", torch.bfloat16), ("fnuz", torch.float32)])
def test_act_quant_rows_is_the_codec(fmt, dtype):
    """The decode sizes' once-per-row quantization (``act_quant_rows``) gives the codec's values bit for bit, rounded
    to x's dtype (exact): blocks of zeros (amax floor), underflow to the subnormal grid, 1e-3..1e3 magnitudes, and
    a block count that is not a power of two (K = 384)."""
    g = gen(19)
    k = 384
    x = (randn((6, k), g) * torch.logspace(-3, 3, k, device=DEV)).to(dtype)
    x[1, 128:256] = 0.0
    x[2, 7] = 1e-30
    got = tfl.act_quant_rows(x, *tfl.act_quant_consts(fmt))
    assert got.dtype == dtype
    assert torch.equal(got, fake_quant_fp8_pow2(x.float().cpu(), 128, fmt).to(dtype).to(DEV))


@pytest.mark.parametrize("m,groups,cfg", [(1, 1, None), (5, 2, None), (DECODE_MAX_ROWS + 3, 1, None),
                                          (DECODE_MAX_ROWS + 3, 1, {"w16": True})])
def test_act_quant_is_the_gemm_of_the_quantized_rows(m, groups, cfg):
    """act_quant quantizes x once (``act_quant_rows``) and multiplies the result: bit for bit the GEMM of the codec's
    rounded x, at the decode launch (a grouped weight, K in several chunks) and the prefill tiles (with the weight
    dequantized beforehand too)."""
    g = gen(20)
    wq, s = _weights(256, 512, g)
    x = randn((m, groups * 512), g)
    got = tfl.fp8_linear(x, wq, s, groups=groups, act_quant=True, act_fmt="ocp", config=cfg)
    xq = fake_quant_fp8_pow2(x.float().cpu(), 128, "ocp").to(x.dtype).to(DEV)
    assert torch.equal(tfl.fp8_linear(xq, wq, s, groups=groups, config=cfg), got)


def test_registry_resolves_to_this_kernel():
    from dsv4.ops.platform import detect_platform

    detect_platform.cache_clear()
    name, fn = resolve("fp8_linear")
    assert name == "triton" and fn is tfl.fp8_linear


@pytest.mark.parametrize("m,groups", [(1, 4), (5, 2), (70, 4)])
def test_grouped_block_diagonal(m, groups):
    """``groups``: the attention's grouped output projection in one launch equals the per-group
    products concatenated (the torch op's definition), and a group's rows see only its own K
    columns; a decode row's bits do not depend on the other rows (batch invariance)."""
    g = gen(300 + m)
    r, k = 128, 200
    wq, s = _weights(groups * r, k, g)
    x = randn((m, groups * k), g)
    y = tfl.fp8_linear(x, wq, s, groups=groups)
    ref = torch_ops.fp8_linear(x, wq, s, groups=groups)
    assert y.shape == (m, groups * r)
    per = torch.cat([torch_ops.fp8_linear(x[:, i * k:(i + 1) * k], wq[i * r:(i + 1) * r], s[i:i + 1])
                     for i in range(groups)], dim=-1)
    assert torch.equal(ref, per)
    ap = torch.cat([_absprod(x[:, i * k:(i + 1) * k], wq[i * r:(i + 1) * r], s[i:i + 1]) for i in range(groups)], -1)
    assert_fp32_accum_close(y, ref, ap)
    if m > 1:
        assert torch.equal(tfl.fp8_linear(x[:1], wq, s, groups=groups), y[:1])
    with pytest.raises(ValueError, match="group"):
        tfl.fp8_linear(x[:, :k], wq, s, groups=groups)  # x too narrow for the groups
    with pytest.raises(ValueError, match="groups"):
        torch_ops.fp8_linear(x, wq[:r + 64], s[:2], groups=2)  # groups of 96 rows: not whole scale blocks


@pytest.mark.parametrize("fmt,scale_fmt", [(OCP, "ue8m0"), (FNUZ, "ue8m0"), (OCP, "fp32")])
def test_dequant_weight_is_the_kernels_dequantization(fmt, scale_fmt):
    """``dequant_weight``: the weight as the GEMM dequantizes it in registers (the format module's
    block dequantization, rounded to the activation dtype), edge blocks and NaN codes included."""
    g = gen(410)
    wq, s = _weights(200, 300, g, scale_fmt=scale_fmt, fmt=fmt)
    ref = dequantize_block_fp8(wq.cpu(), s.cpu(), out_dtype=torch.bfloat16)  # the format follows the dtype
    got = tfl.dequant_weight(wq, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (200, 300)
    torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("m,groups,act_quant,k", [(70, 1, False, 520), (130, 2, False, 520), (33, 1, True, 512)])
def test_w16_path_gives_the_fp8_paths_bits(m, groups, act_quant, k):
    """``config["w16"]``: the GEMM over the pre-dequantized weight (True: dequantized here, or the
    tensor) equals the in-register decode bitwise, with K chunks, groups, act_quant and edge tiles."""
    g = gen(420 + m)
    wq, s = _weights(groups * 128 if groups > 1 else 200, k, g)
    x = randn((m, groups * k), g).to(torch.bfloat16)
    ref = tfl.fp8_linear(x, wq, s, groups=groups, act_quant=act_quant, config={"w16": False})
    for w16 in (True, tfl.dequant_weight(wq, s, torch.bfloat16)):
        y = tfl.fp8_linear(x, wq, s, groups=groups, act_quant=act_quant, config={"w16": w16})
        assert torch.equal(y, ref)
    with pytest.raises(ValueError, match="w16"):
        tfl.fp8_linear(x, wq, s, groups=groups, config={"w16": torch.zeros(3, 3, dtype=torch.bfloat16, device=DEV)})


def test_long_prefills_of_chunked_weights_take_the_w16_tile():
    """pick_config: the bf16-weight tile for invariant prefills of ≥ W16_MIN_M rows whose K is several
    chunks only; its rows have the decode tile's bits (a prompt's chunking cannot change them)."""
    dev = torch.device(DEV)
    n, k = 256, 512
    assert tfl.invariant_chunk(n, k, dev) < k  # several chunks
    cfg = tfl.pick_config(tfl.W16_MIN_M, n, k, dev)
    assert cfg.get("w16") is True and cfg["BLOCK_M"] == tfl.W16_TILE["BLOCK_M"]
    assert not tfl.pick_config(tfl.W16_MIN_M - 1, n, k, dev).get("w16")
    assert not tfl.pick_config(64, n, k, dev).get("w16")  # decode
    assert not tfl.pick_config(tfl.W16_MIN_M, n, k, dev, x_bytes=4).get("w16")  # fp32 activations
    one = 128 * 8 * 64  # n so large that K is one chunk
    assert tfl.invariant_chunk(one, 256, dev) >= 256 and not tfl.pick_config(tfl.W16_MIN_M, one, 256, dev).get("w16")
    set_batch_invariant(False)
    try:
        assert not tfl.pick_config(tfl.W16_MIN_M, n, k, dev).get("w16")
    finally:
        set_batch_invariant(True)
    g = gen(430)
    wq, s = _weights(n, k, g)
    x = randn((tfl.W16_MIN_M, k), g).to(torch.bfloat16)
    # the interpreter's k-by-k dot materializes BLOCK_M·BLOCK_N·128 products: a smaller tile there (w16 stays on)
    tile = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4) if INTERPRET else None
    assert tfl.pick_config(tfl.W16_MIN_M, n, k, dev, tile).get("w16") is True
    y = tfl.fp8_linear(x, wq, s, config=tile)
    assert torch.equal(y[:64], tfl.fp8_linear(x[:64], wq, s))
    assert torch.equal(y[-3:], tfl.fp8_linear(x[-3:], wq, s))


@pytest.mark.parametrize("m", [1, 3, 9, 64])
def test_split_fixup_gives_sum_in_orders_bits(monkeypatch, m):
    """Split-K summed by each tile's last program (``_common.SPLIT_FIXUP``) adds the same partials in
    the same order as the ``sum_in_order`` launch: the same bits (the GEMM part is one code path; in
    the interpreter its dot is k by k, so this holds on any CPU), twice in a row (the arrival counters
    go back to 0), within the fp32 tolerance of the torch op."""
    from dsv4.ops.triton import _common
    monkeypatch.setattr(_common, "SPLIT_FIXUP", False)  # the plain results: the sum_in_order launch

    g = gen(40 + m)
    n, k = 192, 640  # 2 column tiles, 5 K blocks
    wq, s = _weights(n, k, g)
    x, other = randn((m, k), g, dtype=torch.bfloat16), randn((m, k), g, dtype=torch.bfloat16)
    for over in ({"split_k": 2}, {"split_k": 5}, None):
        plain = tfl.fp8_linear(x, wq, s, config=over)
        for _ in range(2):
            tfl.fp8_linear(other, wq, s, config=over)  # its partials in the freed workspace the next call may get
            monkeypatch.setattr(_common, "SPLIT_FIXUP", True)
            fixed = tfl.fp8_linear(x, wq, s, config=over)
            monkeypatch.setattr(_common, "SPLIT_FIXUP", False)
            assert torch.equal(fixed, plain), over
        assert int(_common.split_counters(x.device, 1).abs().sum()) == 0
    monkeypatch.setattr(_common, "SPLIT_FIXUP", True)
    y32 = tfl.fp8_linear(x, wq, s, out_dtype=torch.float32, config={"split_k": 5})
    monkeypatch.setattr(_common, "SPLIT_FIXUP", False)
    assert_fp32_accum_close(y32, torch_ops.fp8_linear(x, wq, s, out_dtype=torch.float32), _absprod(x, wq, s))


# act_quant's GEMM as e4m3 x e4m3 MMAs (``ACT_QUANT_FP8_MMA``). Compiled, the tensor cores' FP8 MMA adds its products
# in a narrower accumulator (about 13 mantissa bits aligned to the largest addend: DeepSeek-V3's report measured ~14
# retained bits on Hopper), at most 36 additions per 128-column block (32 products an MMA, 4 MMAs chained) before the
# block's sum enters fp32: |Δ| ≤ 36 · 2^-13 ≤ 2^-7 of Σ|x w| at worst. The interpreter sums in fp32 (1e-5 bound).
FP8_MMA_REL = 1e-5 if INTERPRET or DEV == "cpu" else 2.0 ** -7


@pytest.fixture
def fp8_mma(monkeypatch):
    monkeypatch.setattr(tfl, "ACT_QUANT_FP8_MMA", True)
    if not tfl.act_quant_fp8_mma(torch.device(DEV), "ocp"):
        pytest.skip("this device multiplies no FP8 codes (the bf16 MMA of the rounded x instead)")


def test_act_quant_codes_are_the_codec():
    """The codes launch's e4m3 bytes and power-of-two scales: their products are the codec's values bit for bit, and
    the bytes are torch's e4m3 encoding of value / scale (zeros blocks, the subnormal grid, 1e-3..1e3 magnitudes)."""
    g = gen(21)
    k = 384
    x = (randn((6, k), g) * torch.logspace(-3, 3, k, device=DEV)).to(torch.bfloat16)
    x[1, 128:256] = 0.0
    x[2, 7] = 1e-30
    x[3, 5] = -x[3, 5].abs() * 1e-3
    codes, scales = tfl.act_quant_codes(x)
    assert codes.dtype == torch.uint8 and scales.shape == (6, 3) and scales.dtype == torch.float32
    want = fake_quant_fp8_pow2(x.float().cpu(), 128, "ocp").to(DEV)
    per_col = scales.repeat_interleave(128, dim=1)
    assert torch.equal(codes.view(torch.float8_e4m3fn).float() * per_col, want)
    assert torch.equal(codes, (want / per_col).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("m,groups,out_dtype", [(1, 1, torch.float32), (5, 2, torch.float32),
                                                (DECODE_MAX_ROWS + 6, 1, torch.float32), (3, 1, torch.bfloat16)])
def test_fp8_mma_is_the_torch_op(fp8_mma, m, groups, out_dtype):
    """FP8 codes times the FP8 weight against the torch op's act_quant GEMM (the dequantized weight times the rounded
    x in fp32): decode launch (K in several chunks), a grouped weight, the prefill tile, a bf16 output."""
    g = gen(22 + m)
    wq, s = _weights(256, 512, g)
    x = randn((m, groups * 512), g, dtype=torch.bfloat16)
    y = tfl.fp8_linear(x, wq, s, groups=groups, act_quant=True, act_fmt="ocp", out_dtype=out_dtype)
    ref = torch_ops.fp8_linear(x, wq, s, groups=groups, act_quant=True, act_fmt="ocp", out_dtype=torch.float32)
    xq = fake_quant_fp8_pow2(x.float().cpu(), 128, "ocp").to(DEV)
    if groups > 1:  # Σ|x w| of the block-diagonal product: each group's columns times its rows
        ap = torch.cat([_absprod(xq[:, i * 512:(i + 1) * 512], wq[i * 128:(i + 1) * 128], s[i:i + 1])
                        for i in range(groups)], dim=1)
    else:
        ap = _absprod(xq, wq, s)
    assert y.dtype == out_dtype and y.shape == (m, 256)
    if out_dtype == torch.float32:
        assert_fp32_accum_close(y, ref, ap, rel=FP8_MMA_REL)
    else:
        d = (y.float() - ref).abs()
        assert bool((d <= BF16_SPACING_MAX * ref.abs() + FP8_MMA_REL * ap + 1e-30).all()), d.max()


def test_fp8_mma_rows_do_not_depend_on_m(fp8_mma):
    """Batch invariance of the FP8 codes' GEMM: each row's bits are the same at every decode size and at the prefill
    tile (K in four chunks, summed in the same order by every launch)."""
    g = gen(23)
    wq, s = _weights(256, 1024, g)
    x = randn((DECODE_MAX_ROWS + 6, 1024), g, dtype=torch.bfloat16)
    full = tfl.fp8_linear(x, wq, s, act_quant=True, act_fmt="ocp")
    for m in (1, 5, 17, 33, DECODE_MAX_ROWS):
        assert torch.equal(tfl.fp8_linear(x[:m], wq, s, act_quant=True, act_fmt="ocp"), full[:m]), m


def test_fp8_mma_needs_ocp_activations_and_the_knob(monkeypatch):
    """FNUZ activations (MI300X) and the knob off keep the bf16 MMA of the rounded x (the codec's values, bitwise the
    GEMM of ``act_quant_rows``' output), and a dequantized-weight config is refused with the FP8 MMA."""
    dev = torch.device(DEV)
    monkeypatch.setattr(tfl, "ACT_QUANT_FP8_MMA", False)
    assert not tfl.act_quant_fp8_mma(dev, "ocp")
    monkeypatch.setattr(tfl, "ACT_QUANT_FP8_MMA", True)
    assert not tfl.act_quant_fp8_mma(dev, "fnuz")
    g = gen(24)
    wq, s = _weights(128, 256, g)
    x = randn((3, 256), g, dtype=torch.bfloat16)
    xq = tfl.act_quant_rows(x, *tfl.act_quant_consts("fnuz"))
    assert torch.equal(tfl.fp8_linear(x, wq, s, act_quant=True, act_fmt="fnuz"), tfl.fp8_linear(xq, wq, s))
    if tfl.act_quant_fp8_mma(dev, "ocp"):
        with pytest.raises(ValueError, match="w16"):
            tfl.fp8_linear(x, wq, s, act_quant=True, act_fmt="ocp", config={"w16": True})


@pytest.mark.parametrize("m,groups", [(1, 1), (5, 2), (DECODE_MAX_ROWS, 1)])
def test_fp8_mma_quant_in_the_decode_launch_gives_the_codes_launchs_bits(fp8_mma, monkeypatch, m, groups):
    """``A8_QUANT_IN_DECODE``: the decode launch quantizes each x block as it loads it: the same codes and scales as
    ``act_quant_codes`` (1e-3..1e3 magnitudes, a zero block, K in several chunks), so the same MMA and bits."""
    g = gen(25 + m)
    wq, s = _weights(256, 1024, g)
    x = (randn((m, groups * 1024), g) * torch.logspace(-3, 3, groups * 1024, device=DEV)).to(torch.bfloat16)
    x[0, 128:256] = 0.0
    want = tfl.fp8_linear(x, wq, s, groups=groups, act_quant=True, act_fmt="ocp")
    monkeypatch.setattr(tfl, "A8_QUANT_IN_DECODE", True)
    assert torch.equal(tfl.fp8_linear(x, wq, s, groups=groups, act_quant=True, act_fmt="ocp"), want)
