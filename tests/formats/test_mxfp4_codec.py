"""MXFP4: E2M1 table, RNE encoding, nibble order and per-32 UE8M0 scales."""
import pytest
import torch

from dsv4.formats import E2M1_VALUES, dequantize_mxfp4, encode_e2m1, pack_fp4, quantize_mxfp4, unpack_fp4

ONE = torch.tensor([[127]], dtype=torch.uint8)  # scale 2^0 for one 32-block


def test_all_16_codes_decode_to_table():
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.equal(E2M1_VALUES.view(torch.int32), torch.tensor(table).float().view(torch.int32))
    codes = torch.arange(32, dtype=torch.uint8) % 16
    out = dequantize_mxfp4(pack_fp4(codes)[None].view(torch.int8), ONE)
    assert torch.equal(out[0].view(torch.int32), E2M1_VALUES.repeat(2).view(torch.int32))
    assert torch.equal(encode_e2m1(E2M1_VALUES), torch.arange(16, dtype=torch.uint8))


def test_low_nibble_is_the_even_element():
    # 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) is element 1.
    # A high-nibble-first implementation would give [1.0, 0.5].
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8).view(torch.int8)
    out = dequantize_mxfp4(packed, ONE)
    assert out[0, :2].tolist() == [0.5, 1.0]
    assert unpack_fp4(torch.tensor([0x21, 0xF8], dtype=torch.uint8)).tolist() == [1, 2, 8, 15]
    assert pack_fp4(torch.tensor([1, 2, 8, 15])).tolist() == [0x21, 0xF8]


def test_pack_unpack_roundtrip_uint8_and_int8():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), codes)


def test_encode_e2m1_round_to_nearest_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, float("inf")])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0]
    assert E2M1_VALUES[encode_e2m1(x).long()].tolist() == want
    assert E2M1_VALUES[encode_e2m1(-x).long()].tolist() == [-v for v in want]
    assert encode_e2m1(torch.tensor([0.2, 0.3, 2.4, 2.6, 4.9, 5.1])).tolist() == [0, 1, 4, 5, 6, 7]


def test_quantize_mxfp4_scales_and_error_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 128, generator=g) * torch.exp2(torch.randint(-12, 12, (8, 4), generator=g)
                                                     .float()).repeat_interleave(32, -1)
    w[0, :32] = 0.0  # all-zero block
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (8, 64)
    assert scale.dtype == torch.uint8 and scale.shape == (8, 4)
    assert scale[0, 0].item() == 1  # amax floored at 6*2^-126 -> e = -126
    s = torch.exp2(scale.double() - 127)
    amax = w.reshape(8, 4, 32).abs().amax(-1).double()
    nz = amax > 0
    assert torch.all((amax[nz] / 6 <= s[nz]) & (amax[nz] / 6 > s[nz] / 2))
    y = dequantize_mxfp4(packed, scale)
    sf = s.repeat_interleave(32, -1).float()
    v = (w / sf).abs()
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    assert torch.all((y - w).abs() <= half_step * sf)


def test_quantize_mxfp4_exact_on_grid_and_e8m0_scale():
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    codes[:, 0] = 7  # amax 6 in every block -> scale byte 127 (exactly 2^0)
    codes[:, 32] = 15
    w = E2M1_VALUES[codes.long()] * 2.0 ** -3
    packed, scale = quantize_mxfp4(w)
    assert torch.all(scale == 124)
    y = dequantize_mxfp4(packed, scale.view(torch.float8_e8m0fnu), dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y.float(), w)


def test_dequantize_mxfp4_rejects_wrong_scale_shape():
    with pytest.raises(ValueError, match="scale"):
        dequantize_mxfp4(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8))
