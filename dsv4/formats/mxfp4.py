"""MXFP4: E2M1 codes, two per byte (low nibble = even element), UE8M0 scale per 32 K-elements."""
import torch

from ._minifloat import ceil_log2_ratio, round_magnitude, signbit
from .ue8m0 import as_ue8m0_bytes, inv_pow2_from_byte, ue8m0_decode

__all__ = ["E2M1_VALUES", "encode_e2m1", "pack_fp4", "unpack_fp4", "quantize_mxfp4",
           "dequantize_mxfp4", "MXFP4_BLOCK"]

MXFP4_BLOCK = 32
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes 0..15, RNE (ties to even mantissa), saturating at ±6.

    Bit 3 carries the sign (so -0.0 and tiny negatives give code 8, i.e. -0); NaN -> 0.
    """
    x = x.float()
    nan = torch.isnan(x)
    a = x.abs().clamp(max=6.0)
    a = torch.where(nan, torch.zeros_like(a), a)
    code = round_magnitude(a, 1, 1) | ((signbit(x) & ~nan).to(torch.int32) << 3)
    return code.to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> uint8 [..., K//2]: element 2j in the low nibble, 2j+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim {codes.shape[-1]} must be even to pack FP4")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8/int8 [..., K'] packed bytes -> uint8 codes [..., 2K'] (low nibble first)."""
    if packed.dtype == torch.int8:
        packed = packed.view(torch.uint8)
    elif packed.dtype != torch.uint8:
        raise TypeError(f"expected packed FP4 as uint8 or int8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_mxfp4(w: torch.Tensor):
    """[..., K] float -> (packed int8 [..., K//2], scale bytes uint8 [..., K//32]).

    e = ceil(log2(amax/6)) with amax floored at 6*2^-126 and e clamped to [-127, 127];
    byte = e + 127.
    """
    w = w.float()
    k = w.shape[-1]
    if k % MXFP4_BLOCK:
        raise ValueError(f"last dim {k} is not a multiple of {MXFP4_BLOCK}")
    wb = w.reshape(*w.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = wb.abs().amax(-1).clamp(min=6.0 * 2.0 ** -126)
    e = ceil_log2_ratio(amax, 6.0).clamp(-127, 127)
    sb = (e + 127).to(torch.uint8)
    codes = encode_e2m1(wb * inv_pow2_from_byte(sb).unsqueeze(-1)).reshape(w.shape)
    return pack_fp4(codes).view(torch.int8), sb


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """LUT[nibble] * 2^(scale_byte - 127); scale may be uint8 or float8_e8m0fnu."""
    codes = unpack_fp4(packed)
    s = ue8m0_decode(as_ue8m0_bytes(scale))
    k = codes.shape[-1]
    if s.shape != (*codes.shape[:-1], k // MXFP4_BLOCK):
        raise ValueError(f"MXFP4 scale shape {tuple(s.shape)} does not match expected "
                         f"{(*codes.shape[:-1], k // MXFP4_BLOCK)} for K={k}")
    lut = E2M1_VALUES.to(codes.device)
    v = torch.index_select(lut, 0, codes.reshape(-1).to(torch.int32))
    v = v.reshape(*codes.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK) * s.unsqueeze(-1)
    return v.reshape(codes.shape).to(dtype)
