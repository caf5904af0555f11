"""UE8M0 (float8_e8m0fnu) scale bytes: value = 2^(byte - 127), 0xFF = NaN.

Handled purely as uint8 bytes because ROCm lacks arithmetic on the e8m0 dtype.
"""
import torch

E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)


def as_ue8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw uint8 view of UE8M0 scales given as float8_e8m0fnu or uint8 (no arithmetic)."""
    if E8M0_DTYPE is not None and t.dtype == E8M0_DTYPE:
        return t.view(torch.uint8)
    if t.dtype == torch.uint8:
        return t
    raise TypeError(f"expected UE8M0 scales as float8_e8m0fnu or uint8, got {t.dtype}")


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """Exact float32 2^(b-127) by writing the exponent field; 0 -> 2^-127 (subnormal), 255 -> NaN."""
    b = as_ue8m0_bytes(b).to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def ue8m0_encode(e) -> torch.Tensor:
    """Byte for scale 2^e: clamp(e + 127, 0, 254); 254 max keeps clear of the NaN code."""
    e = torch.as_tensor(e)
    return torch.clamp(e.to(torch.int32) + 127, 0, 254).to(torch.uint8)


def inv_pow2_from_byte(b: torch.Tensor) -> torch.Tensor:
    """Exact 2^-(b-127) = 2^((254-b)-127) for bytes 0..254, so x*inv equals x/scale."""
    return ue8m0_decode((254 - b.to(torch.int32)).clamp(0, 254).to(torch.uint8))
