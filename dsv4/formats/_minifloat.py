"""Bit-level helpers shared by the FP8 and FP4 codecs.

Everything here is exact integer/bit arithmetic on float32, so results do not
depend on a backend's float8 casts or on log2/exp2 rounding.
"""
import math

import torch

FLT_MAX = float(torch.finfo(torch.float32).max)


def round_magnitude(a: torch.Tensor, man_bits: int, bias: int) -> torch.Tensor:
    """Round non-negative finite float32 `a` to a minifloat magnitude code (RNE).

    The code is `exp_field << man_bits | mantissa`; exponents are unbounded above,
    so callers clamp `a` first (saturation) or compare the code to their max.
    Normal range: round the float32 mantissa to `man_bits` bits in the integer
    domain (a carry bumps the exponent, as IEEE rounding does) and re-bias.
    Subnormal range: the grid is uniform, so scale by an exact power of two and
    use torch.round (half to even).
    """
    shift = 23 - man_bits
    bits = a.view(torch.int32)
    lsb = (bits >> shift) & 1
    normal = ((bits + ((1 << (shift - 1)) - 1) + lsb) >> shift) - ((127 - bias) << man_bits)
    min_normal = 2.0 ** (1 - bias)
    sub = torch.round(a.clamp(max=min_normal) * 2.0 ** (bias - 1 + man_bits)).to(torch.int32)
    return torch.where(a < min_normal, sub, normal)


def ceil_log2_ratio(a: torch.Tensor, m) -> torch.Tensor:
    """Exact int32 ceil(log2(a / m)) for positive a (tensor) and m (float or tensor).

    With a = ma*2^ea and m = mm*2^em (mantissas in [0.5, 1)), log2(a/m) =
    ea - em + log2(ma/mm), and log2(ma/mm) lies in (-1, 1), so the ceiling only
    needs the mantissa comparison. No division or log2 rounding is involved.
    """
    ma, ea = torch.frexp(a.float().clamp(max=FLT_MAX))
    if isinstance(m, torch.Tensor):
        mm, em = torch.frexp(m.float())
    else:
        mm, em = math.frexp(float(m))
    return (ea - em + (ma > mm).to(torch.int32)).to(torch.int32)


def signbit(x: torch.Tensor) -> torch.Tensor:
    """Sign bit of float32 `x` (True for -0.0 and negative NaNs too)."""
    return x.view(torch.int32) < 0
