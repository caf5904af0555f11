"""128x128 block-scaled FP8 weights, including partial edge tiles (N=130, K=200)."""
import pytest
import torch

from dsv4.formats import OCP, decode_fp8, dequantize_block_fp8, quantize_block_fp8

N, K = 130, 200


def _codes():
    g = torch.Generator().manual_seed(2)
    c = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    return torch.where((c & 0x7F) == 0x7F, torch.zeros_like(c), c)  # no NaN codes


def _by_hand(codes, s):
    """Expected values tile by tile: rows 0..127 / 128..129, cols 0..127 / 128..199."""
    v = decode_fp8(codes, OCP)
    out = torch.empty(N, K)
    out[:128, :128] = v[:128, :128] * s[0][0]
    out[:128, 128:] = v[:128, 128:] * s[0][1]
    out[128:, :128] = v[128:, :128] * s[1][0]
    out[128:, 128:] = v[128:, 128:] * s[1][1]
    return out


def test_dequant_e8m0_partial_edge_blocks():
    codes = _codes()
    sb = torch.tensor([[127, 130], [120, 135]], dtype=torch.uint8)
    want = _by_hand(codes, [[1.0, 8.0], [2.0 ** -7, 256.0]])
    for w in (codes, codes.view(torch.float8_e4m3fn)):
        for s in (sb, sb.view(torch.float8_e8m0fnu)):
            assert torch.equal(dequantize_block_fp8(w, s), want)
    # a reader inferring the block from the grid (130 // 2 = 65 rows) would scale row 100 by 2^-7
    assert torch.equal(dequantize_block_fp8(codes, sb)[100], decode_fp8(codes[100], OCP)
                       * torch.tensor([1.0] * 128 + [8.0] * 72))


def test_dequant_fp32_and_bf16_scales():
    codes = _codes()
    s = torch.tensor([[0.5, 3.0], [0.25, 7.0]])
    want = _by_hand(codes, s.tolist())
    assert torch.equal(dequantize_block_fp8(codes.view(torch.float8_e4m3fn), s), want)
    assert torch.equal(dequantize_block_fp8(codes, s.to(torch.bfloat16)), want)
    out = dequantize_block_fp8(codes, s, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))


def test_dequant_rejects_wrong_scale_grid():
    codes = _codes()
    with pytest.raises(ValueError) as ei:
        dequantize_block_fp8(codes, torch.zeros(1, 2, dtype=torch.uint8))
    assert "(2, 2)" in str(ei.value) and "(1, 2)" in str(ei.value)
    with pytest.raises(ValueError):
        dequantize_block_fp8(codes, torch.ones(2, 3))


def _tile_amax(w):
    return torch.tensor([[w[:128, :128].abs().max(), w[:128, 128:].abs().max()],
                         [w[128:, :128].abs().max(), w[128:, 128:].abs().max()]])


def test_quantize_ue8m0_roundtrip_partial_tiles():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g)
    w[128:, 128:] *= 100.0  # the 2x72 corner tile gets its own, larger scale
    w[:128, 128:] *= 1e-3
    q, s = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (N, K)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    e = s.view(torch.uint8).int() - 127
    want_e = torch.ceil(torch.log2(_tile_amax(w).double() / 448.0)).int()
    assert torch.equal(e, want_e)
    y = dequantize_block_fp8(q, s)
    sf = torch.exp2(e.float()).repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    assert torch.all((y - w).abs() <= w.abs() * 2.0 ** -4 + sf * 2.0 ** -10)


def test_quantize_fp32_scale_is_amax_over_max():
    w = torch.randn(N, K)
    q, s = quantize_block_fp8(w, scale_fmt="fp32")
    assert s.dtype == torch.float32 and torch.equal(s, _tile_amax(w) / 448.0)
    y = dequantize_block_fp8(q, s)
    sf = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    assert torch.all((y - w).abs() <= w.abs() * 2.0 ** -4 + sf * 2.0 ** -10)
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_block_fp8(w, scale_fmt="e5m2")


def test_quantize_all_zero_tile_and_small_block():
    w = torch.zeros(4, 6)
    w[:2, :2] = torch.tensor([[1.0, -2.0], [0.5, 448.0]])
    q, s = quantize_block_fp8(w, block=2)
    assert s.shape == (2, 3)
    assert torch.equal(dequantize_block_fp8(q, s, block=2), w)
