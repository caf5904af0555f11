"""UE8M0 bytes, exact power-of-two scale exponents and per-block pow2 FP8 quantization."""
import pytest
import torch

from dsv4.formats import (
    FNUZ,
    OCP,
    as_ue8m0_bytes,
    decode_fp8,
    dequantize_fp8_pow2,
    pow2_scale_exponent,
    quantize_fp8_pow2,
    ue8m0_decode,
    ue8m0_encode,
)


def test_ue8m0_decode_every_byte_exact():
    b = torch.arange(256, dtype=torch.uint8)
    v = ue8m0_decode(b)
    assert v.dtype == torch.float32
    want = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(v[:255].double(), want)  # includes 2^-127 (float32 subnormal)
    assert torch.isnan(v[255])
    # torch's own e8m0 decode agrees, and the e8m0 dtype is accepted
    ref = b.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ue8m0_decode(b.view(torch.float8_e8m0fnu)).nan_to_num(1.0), ref.nan_to_num(1.0))


def test_ue8m0_encode_and_bytes_view():
    e = torch.tensor([-300, -127, -1, 0, 5, 127, 128, 300])
    assert ue8m0_encode(e).tolist() == [0, 0, 126, 127, 132, 254, 254, 254]
    assert ue8m0_encode(e).dtype == torch.uint8
    raw = torch.tensor([1, 127, 254], dtype=torch.uint8)
    v = as_ue8m0_bytes(raw.view(torch.float8_e8m0fnu))
    assert v.dtype == torch.uint8 and torch.equal(v, raw)
    assert as_ue8m0_bytes(raw) is raw
    with pytest.raises(TypeError):
        as_ue8m0_bytes(torch.ones(2))


@pytest.mark.parametrize("m", [448.0, 224.0, 240.0, 6.0])
def test_pow2_scale_exponent_exact_at_powers_of_two(m):
    k = torch.arange(-13, 40)
    amax = torch.ldexp(torch.full(k.shape, m), k)
    keep = amax >= 1e-4
    amax, k = amax[keep], k[keep]
    assert torch.equal(pow2_scale_exponent(amax, m), k.to(torch.int32))
    up = torch.nextafter(amax, torch.tensor(float("inf")))
    down = torch.nextafter(amax, torch.tensor(0.0))
    assert torch.equal(pow2_scale_exponent(up, m), (k + 1).to(torch.int32))
    assert torch.equal(pow2_scale_exponent(down, m), k.to(torch.int32))


def test_pow2_scale_exponent_floor_and_random():
    e = pow2_scale_exponent(torch.tensor([0.0, 1e-6, 1e-4]), 448.0)
    assert e.dtype == torch.int32 and e.tolist() == [-22, -22, -22]  # ceil(log2(1e-4/448))
    x = torch.rand(10_000) * torch.exp2(torch.randint(-10, 20, (10_000,)).float()) + 1e-4
    want = torch.ceil(torch.log2(x.double() / 448.0)).to(torch.int32)
    assert torch.equal(pow2_scale_exponent(x, 448.0), want)
    assert torch.equal(pow2_scale_exponent(x, torch.tensor(448.0)), want)


@pytest.mark.parametrize("fmt", [OCP, FNUZ], ids=lambda f: f.name)
def test_quantize_fp8_pow2_roundtrip(fmt):
    x = torch.randn(5, 256) * torch.exp2(torch.randint(-8, 8, (5, 1)).float())
    codes, eb = quantize_fp8_pow2(x, 64, fmt)
    assert codes.shape == (5, 256) and eb.shape == (5, 4) and eb.dtype == torch.uint8
    amax = x.reshape(5, 4, 64).abs().amax(-1)
    assert torch.equal(eb, ue8m0_encode(pow2_scale_exponent(amax, fmt.quant_max)))
    scaled = decode_fp8(codes, fmt).reshape(5, 4, 64)
    assert scaled.abs().max() <= fmt.quant_max
    y = dequantize_fp8_pow2(codes, eb, 64, fmt)
    scale = ue8m0_decode(eb).repeat_interleave(64, -1)
    assert torch.all((y - x).abs() <= x.abs() * 2.0 ** -4 + scale * 2.0 ** -10)


def test_quantize_fp8_pow2_round_bf16():
    x = torch.randn(4, 128) * 3
    a = quantize_fp8_pow2(x, 32, OCP, round_bf16=True)
    b = quantize_fp8_pow2(x.to(torch.bfloat16).float(), 32, OCP)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError):
        quantize_fp8_pow2(torch.zeros(3, 100), 64, OCP)
