"""FP8 E4M3 (OCP and FNUZ) LUT and encoder versus torch's own float8 casts."""
import pytest
import torch

import dsv4.formats.fp8 as _fp8mod
from dsv4.formats import FNUZ, OCP, FP8Format, decode_fp8, encode_fp8, fp8_lut, get_fp8_format


@pytest.fixture(autouse=True, params=["native-cast", "bit-codec"])
def codec_path(request, monkeypatch):
    """Every test here runs against both encoder paths: torch's cast and the portable bit codec."""
    if request.param == "bit-codec":
        monkeypatch.setattr(_fp8mod, "_native_cast_ok", lambda device, fmt: False)
    return request.param


FMTS = [OCP, FNUZ]
NAN_CODES = {"ocp": {0x7F, 0xFF}, "fnuz": {0x80}}


def _bits(t):
    return t.float().view(torch.int32)


def _torch_encode(x, fmt):
    return x.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).view(torch.uint8)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_lut_equals_torch_casts_for_all_codes(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(fmt.torch_dtype).float()
    lut = fp8_lut(fmt)
    assert lut.dtype == torch.float32 and lut.shape == (256,)
    assert torch.equal(torch.isnan(lut), torch.isnan(ref))
    assert set(torch.nonzero(torch.isnan(lut)).flatten().tolist()) == NAN_CODES[fmt.name]
    ok = ~torch.isnan(ref)
    assert torch.equal(_bits(lut[ok]), _bits(ref[ok]))  # bitwise: -0.0 included
    assert lut[ok].max().item() == fmt.max


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_decode_accepts_uint8_and_fp8_dtype(fmt):
    codes = torch.randint(0, 256, (7, 9), dtype=torch.uint8)
    a = decode_fp8(codes, fmt)
    b = decode_fp8(codes.view(fmt.torch_dtype), fmt)
    ref = codes.view(fmt.torch_dtype).float()
    assert a.shape == (7, 9)
    assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert torch.equal(a.nan_to_num(7.0), ref.nan_to_num(7.0))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_encode_decode_roundtrip_every_code(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    vals = decode_fp8(codes, fmt)
    ok = ~torch.isnan(vals)
    assert torch.equal(encode_fp8(vals[ok], fmt), codes[ok])
    if fmt is FNUZ:  # only 0x00 decodes to zero
        assert torch.nonzero(vals == 0).flatten().tolist() == [0]


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_encode_matches_torch_on_random_values(fmt):
    g = torch.Generator().manual_seed(0)
    n = 200_000
    # log-uniform magnitudes from deep float32 subnormals past the fp8 max, both signs
    mag = torch.rand(n, generator=g) + 1.0
    e = torch.randint(-140, 12, (n,), generator=g)
    x = torch.ldexp(mag, e) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    # plus arbitrary finite float32 bit patterns
    raw = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    r = raw.view(torch.float32)
    x = torch.cat([x, r[torch.isfinite(r)]])
    assert torch.equal(encode_fp8(x, fmt), _torch_encode(x, fmt))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_encode_exact_midpoints_round_to_even(fmt):
    vals = decode_fp8(torch.arange(256, dtype=torch.uint8), fmt)
    pos = torch.unique(vals[(vals >= 0) & ~torch.isnan(vals)])  # sorted
    mids = ((pos[:-1].double() + pos[1:].double()) / 2).float()
    assert torch.equal(mids.double(), (pos[:-1].double() + pos[1:].double()) / 2)  # exact
    codes = encode_fp8(mids, fmt)
    assert torch.all(codes % 2 == 0), "ties must go to the even mantissa"
    assert torch.all((codes == encode_fp8(pos[:-1], fmt)) | (codes == encode_fp8(pos[1:], fmt)))
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    x = torch.cat([mids, up, down])
    x = torch.cat([x, -x])
    assert torch.equal(encode_fp8(x, fmt), _torch_encode(x, fmt))
    assert torch.equal(encode_fp8(up, fmt), encode_fp8(pos[1:], fmt))
    assert torch.equal(encode_fp8(down, fmt), encode_fp8(pos[:-1], fmt))


def test_encode_special_values_ocp():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([448.0, -448.0, 460.0, 1e6, inf, -inf, nan, -nan, 0.0, -0.0, -1e-30, 2.0**-9])
    x[7] = -torch.tensor(nan)  # make sure the NaN sign bit is set
    want = [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0xFF, 0x00, 0x80, 0x80, 0x01]
    assert encode_fp8(x, OCP).tolist() == want
    assert encode_fp8(x, OCP).tolist() == _torch_encode(x, OCP).tolist()


def test_encode_special_values_fnuz():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([240.0, -240.0, 300.0, 1e6, inf, -inf, nan, nan, 0.0, -0.0, -1e-30, 2.0**-10])
    x[7] = -torch.tensor(nan)
    want = [0x7F, 0xFF, 0x7F, 0x7F, 0x7F, 0xFF, 0x80, 0x80, 0x00, 0x00, 0x00, 0x01]
    assert encode_fp8(x, FNUZ).tolist() == want
    assert encode_fp8(x, FNUZ).tolist() == _torch_encode(x, FNUZ).tolist()


def test_encode_without_saturation_overflows_to_nan():
    # 464 ties 448 (mantissa 6, even) with the NaN slot 480: RNE keeps 448
    x = torch.tensor([450.0, 464.0, 464.1, 500.0, float("inf"), -500.0])
    assert encode_fp8(x, OCP, saturate=False).tolist() == [0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0xFF]
    # 248 ties 240 (mantissa 7, odd) with 256 (out of range): RNE goes up -> NaN
    y = torch.tensor([240.0, 247.9, 248.0, 300.0, -float("inf")])
    assert encode_fp8(y, FNUZ, saturate=False).tolist() == [0x7F, 0x7F, 0x80, 0x80, 0x80]
    # torch's unclamped FNUZ cast also yields NaN out of range
    assert torch.equal(encode_fp8(y[3:], FNUZ, saturate=False),
                       y[3:].to(FNUZ.torch_dtype).view(torch.uint8))


def test_encode_accepts_bf16_and_keeps_shape():
    x = torch.randn(3, 4, 5).to(torch.bfloat16)
    c = encode_fp8(x, OCP)
    assert c.dtype == torch.uint8 and c.shape == (3, 4, 5)
    assert torch.equal(c, _torch_encode(x.float(), OCP))


def test_get_fp8_format():
    assert get_fp8_format("ocp") is OCP and get_fp8_format("e4m3fn") is OCP
    assert get_fp8_format("fnuz") is FNUZ and get_fp8_format("e4m3fnuz") is FNUZ
    assert get_fp8_format(FNUZ) is FNUZ
    assert (OCP.max, OCP.quant_max, FNUZ.max, FNUZ.quant_max) == (448.0, 448.0, 240.0, 224.0)
    assert isinstance(OCP, FP8Format)
    with pytest.raises(ValueError, match="e5m2"):
        get_fp8_format("e5m2")
