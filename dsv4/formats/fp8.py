"""FP8 E4M3 codecs (OCP e4m3fn and AMD e4m3fnuz) computed from the bit layout.

Encoding and decoding never use torch's float8 casts, so they behave the same on
every backend; tests check them against torch's casts where those exist.
"""
from dataclasses import dataclass
from functools import lru_cache

import torch

from ._minifloat import ceil_log2_ratio, round_magnitude, signbit
from .ue8m0 import as_ue8m0_bytes, inv_pow2_from_byte, ue8m0_decode, ue8m0_encode

__all__ = [
    "FP8Format", "OCP", "FNUZ", "get_fp8_format", "fp8_lut", "decode_fp8", "encode_fp8",
    "pow2_scale_exponent", "quantize_fp8_pow2", "dequantize_fp8_pow2",
    "ue8m0_decode", "ue8m0_encode", "as_ue8m0_bytes",
]


@dataclass(frozen=True)
class FP8Format:
    """An E4M3 flavour; quant_max is the dynamic-quantization max (224 on MI300 FNUZ)."""
    name: str
    torch_dtype: torch.dtype
    max: float
    quant_max: float


OCP = FP8Format("ocp", torch.float8_e4m3fn, 448.0, 448.0)
FNUZ = FP8Format("fnuz", torch.float8_e4m3fnuz, 240.0, 224.0)

_ALIASES = {
    "ocp": OCP, "e4m3fn": OCP, "float8_e4m3fn": OCP,
    "fnuz": FNUZ, "e4m3fnuz": FNUZ, "float8_e4m3fnuz": FNUZ,
}
# name -> (exponent bias, largest finite magnitude code)
_LAYOUT = {"ocp": (7, 0x7E), "fnuz": (8, 0x7F)}


def get_fp8_format(name_or_fmt) -> FP8Format:
    """Resolve "ocp"/"fnuz"/"e4m3fn"/"e4m3fnuz", a float8 dtype, or an FP8Format."""
    if isinstance(name_or_fmt, FP8Format):
        _layout(name_or_fmt)
        return name_or_fmt
    if isinstance(name_or_fmt, torch.dtype):
        for f in (OCP, FNUZ):
            if f.torch_dtype == name_or_fmt:
                return f
    elif isinstance(name_or_fmt, str) and name_or_fmt.strip().lower() in _ALIASES:
        return _ALIASES[name_or_fmt.strip().lower()]
    raise ValueError(
        f"unknown FP8 format {name_or_fmt!r}; expected one of {sorted(_ALIASES)} or an FP8Format")


def _layout(fmt: FP8Format):
    try:
        return _LAYOUT[fmt.name]
    except KeyError:
        raise ValueError(f"unknown FP8 format name {fmt.name!r}; expected 'ocp' or 'fnuz'") from None


@lru_cache(maxsize=None)
def _lut(name: str, device: str) -> torch.Tensor:
    bias, _ = _LAYOUT[name]
    c = torch.arange(256, dtype=torch.int64)
    sign, exp, man = c >> 7, (c >> 3) & 15, c & 7
    # subnormal: man * 2^(1-bias-3); normal: (8+man) * 2^(exp-bias-3); exact in float64
    mag = torch.where(exp == 0, torch.ldexp(man.double(), torch.tensor(-2 - bias)),
                      torch.ldexp((8 + man).double(), exp - bias - 3))
    val = torch.where(sign == 1, -mag, mag)
    nan = (exp == 15) & (man == 7) if name == "ocp" else c == 0x80
    val = torch.where(nan, torch.tensor(float("nan"), dtype=torch.float64), val)
    return val.float().to(device)


def fp8_lut(fmt) -> torch.Tensor:
    """float32 [256]: value of every byte code (NaN for NaN codes), from the bit layout."""
    return _lut(get_fp8_format(fmt).name, "cpu").clone()


def _as_code_bytes(codes: torch.Tensor) -> torch.Tensor:
    if codes.dtype == torch.uint8:
        return codes
    if codes.dtype.itemsize == 1:
        return codes.view(torch.uint8)
    raise TypeError(f"expected uint8 or 1-byte float8 codes, got {codes.dtype}")


def decode_fp8(codes_u8: torch.Tensor, fmt) -> torch.Tensor:
    """float32 values of FP8 codes (uint8 or any float8 tensor viewed as bytes) via LUT gather."""
    fmt = get_fp8_format(fmt)
    c = _as_code_bytes(codes_u8)
    lut = _lut(fmt.name, str(c.device))
    return torch.index_select(lut, 0, c.reshape(-1).to(torch.int32)).reshape(c.shape)


_NATIVE_CAST: dict[tuple[str, str], bool] = {}


def _native_cast_ok(device: torch.device, fmt: FP8Format) -> bool:
    """Whether torch can cast to this FP8 dtype on this device (and agrees with the bit codec)."""
    key = (device.type, fmt.name)
    ok = _NATIVE_CAST.get(key)
    if ok is None:
        try:
            probe = torch.tensor([0.0, -0.0, 1.0625, -3.3, 1e-9, 460.0, float("nan")], device=device)
            probe = probe.clamp(-fmt.max, fmt.max)
            ok = torch.equal(probe.to(fmt.torch_dtype).view(torch.uint8).cpu(), encode_fp8_bits(probe.cpu(), fmt))
        except (RuntimeError, TypeError):
            ok = False
        _NATIVE_CAST[key] = ok
    return ok


def encode_fp8(x: torch.Tensor, fmt, saturate: bool = True) -> torch.Tensor:
    """uint8 FP8 codes of `x` (round-to-nearest-even, saturating): torch's cast where the device has
    it (checked once against :func:`encode_fp8_bits`), else the portable bit-level codec."""
    fmt = get_fp8_format(fmt)
    if saturate and _native_cast_ok(x.device, fmt):
        return x.float().clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).view(torch.uint8)
    return encode_fp8_bits(x, fmt, saturate)


def encode_fp8_bits(x: torch.Tensor, fmt, saturate: bool = True) -> torch.Tensor:
    """uint8 FP8 codes of `x`, round-to-nearest-even, bit-exact to torch's clamp-then-cast,
    computed from float32 bits (no float8 dtype needed: works on any backend).

    saturate=True clamps to ±fmt.max first (inf -> ±max). saturate=False turns any
    value whose rounding leaves the finite range into the NaN code (no inf in E4M3).
    NaN -> 0x7F|sign (OCP) or 0x80 (FNUZ); FNUZ has no -0, so negative zeros -> 0x00.
    Inputs are converted to float32 first (exact for bf16/fp16; float64 rounds twice).
    """
    fmt = get_fp8_format(fmt)
    bias, max_code = _layout(fmt)
    x = x.float()
    neg = signbit(x)
    nan = torch.isnan(x)
    a = x.abs()
    if saturate:
        a = a.clamp(max=fmt.max)
    a = torch.where(nan, torch.zeros_like(a), a)
    mag = round_magnitude(a, 3, bias)
    if not saturate:
        nan = nan | (mag > max_code)
        mag = mag.clamp(max=max_code)
    s = neg.to(torch.int32) << 7
    if fmt.name == "fnuz":
        s = torch.where(mag == 0, torch.zeros_like(s), s)
        nan_code = torch.full_like(mag, 0x80)
    else:
        nan_code = 0x7F | s
    return torch.where(nan, nan_code, mag | s).to(torch.uint8)


def pow2_scale_exponent(amax: torch.Tensor, fp8_max) -> torch.Tensor:
    """int32 e = ceil(log2(max(amax, 1e-4) / fp8_max)), exact (frexp, no log2 rounding)."""
    amax = torch.as_tensor(amax).float().clamp(min=1e-4)
    return ceil_log2_ratio(amax, fp8_max)


def quantize_fp8_pow2(x: torch.Tensor, block: int, fmt, round_bf16: bool = False):
    """Per-`block` (last dim) power-of-two scaled FP8: returns (codes_u8, ue8m0 exponent bytes).

    Scale 2^e with e from fmt.quant_max; x / 2^e is computed as an exact multiply.
    round_bf16 mimics the compressor path, which rounds fp32 -> bf16 before quantizing.
    """
    fmt = get_fp8_format(fmt)
    x = x.float()
    if round_bf16:
        x = x.to(torch.bfloat16).float()
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last dim {k} is not a multiple of block {block}")
    xb = x.reshape(*x.shape[:-1], k // block, block)
    eb = ue8m0_encode(pow2_scale_exponent(xb.abs().amax(-1), fmt.quant_max))
    codes = encode_fp8(xb * inv_pow2_from_byte(eb).unsqueeze(-1), fmt)
    return codes.reshape(x.shape), eb


def dequantize_fp8_pow2(codes: torch.Tensor, exp_bytes: torch.Tensor, block: int, fmt) -> torch.Tensor:
    """float32 codes * 2^(byte-127) per `block` elements of the last dim."""
    v = decode_fp8(codes, fmt)
    s = ue8m0_decode(as_ue8m0_bytes(exp_bytes))
    k = v.shape[-1]
    if k % block or s.shape != (*v.shape[:-1], k // block):
        raise ValueError(f"scale shape {tuple(s.shape)} does not match codes {tuple(v.shape)} "
                         f"with block {block}")
    return (v.reshape(*v.shape[:-1], k // block, block) * s.unsqueeze(-1)).reshape(v.shape)


def fake_quant_fp8_pow2(x: torch.Tensor, block: int, fmt, round_bf16: bool = False) -> torch.Tensor:
    """dequantize(quantize(x)): the float32 values an FP8 consumer of ``x`` actually sees."""
    codes, exps = quantize_fp8_pow2(x, block, fmt, round_bf16=round_bf16)
    return dequantize_fp8_pow2(codes, exps, block, fmt)
