"""128x128 block-scaled FP8 weights (checkpoint linears): w = fp8[n, k] * scale[n//128, k//128].

The block size is always passed, never inferred from the scale grid: a grid of
ceil(N/128) rows says nothing about N when N is not a multiple of 128.
"""
import math

import torch
import torch.nn.functional as F

from ._minifloat import ceil_log2_ratio
from .fp8 import FNUZ, OCP, decode_fp8, encode_fp8, get_fp8_format
from .ue8m0 import E8M0_DTYPE, inv_pow2_from_byte, ue8m0_decode

__all__ = ["quantize_block_fp8", "dequantize_block_fp8"]


def _tiles(w: torch.Tensor, block: int) -> torch.Tensor:
    """Zero-pad [..., N, K] to whole blocks and view as [..., nN, block, nK, block]."""
    n, k = w.shape[-2:]
    nn_, nk = math.ceil(n / block), math.ceil(k / block)
    w = F.pad(w, (0, nk * block - k, 0, nn_ * block - n))
    return w.reshape(*w.shape[:-2], nn_, block, nk, block)


def _untile(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    s = t.shape
    return t.reshape(*s[:-4], s[-4] * s[-3], s[-2] * s[-1])[..., :n, :k]


def quantize_block_fp8(w: torch.Tensor, block: int = 128, scale_fmt: str = "ue8m0", fmt=OCP):
    """[..., N, K] float -> (fp8 weight [..., N, K], scale [..., ceil(N/b), ceil(K/b)]).

    ue8m0: scale 2^ceil(log2(amax/fmt.max)) as float8_e8m0fnu (all-zero tiles get 2^-126);
    fp32: scale amax/fmt.max as float32 (all-zero tiles get 1.0). Padding of partial
    edge tiles is zero, so only real elements set the amax.
    """
    fmt = get_fp8_format(fmt)
    n, k = w.shape[-2:]
    t = _tiles(w.float(), block)
    amax = t.abs().amax(dim=(-3, -1))
    if scale_fmt == "ue8m0":
        e = ceil_log2_ratio(amax.clamp(min=fmt.max * 2.0 ** -126), fmt.max).clamp(-127, 127)
        sb = (e + 127).to(torch.uint8)
        codes = encode_fp8(t * inv_pow2_from_byte(sb)[..., :, None, :, None], fmt)
        scale = sb.view(E8M0_DTYPE) if E8M0_DTYPE is not None else sb
    elif scale_fmt == "fp32":
        scale = amax / fmt.max
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = encode_fp8(t / scale[..., :, None, :, None], fmt)
    else:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}; expected 'ue8m0' or 'fp32'")
    return _untile(codes, n, k).contiguous().view(fmt.torch_dtype), scale


def _weight_format(weight: torch.Tensor):
    if weight.dtype in (torch.uint8, OCP.torch_dtype):
        return OCP
    if weight.dtype == FNUZ.torch_dtype:
        return FNUZ
    raise TypeError(f"expected an FP8 weight (float8_e4m3fn/fnuz or uint8), got {weight.dtype}")


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8 or (E8M0_DTYPE is not None and scale.dtype == E8M0_DTYPE):
        return ue8m0_decode(scale)
    if scale.is_floating_point() and scale.dtype.itemsize > 1:
        return scale.float()
    raise TypeError(f"expected scale as float8_e8m0fnu/uint8 or float32/bf16/fp16, got {scale.dtype}")


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = 128,
                         out_dtype=torch.float32) -> torch.Tensor:
    """fp8 [..., N, K] * per-tile scale -> out_dtype [..., N, K]; uint8 weights are read as OCP."""
    fmt = _weight_format(weight)
    n, k = weight.shape[-2:]
    expected = (*weight.shape[:-2], math.ceil(n / block), math.ceil(k / block))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale grid shape mismatch for weight {tuple(weight.shape)} with block "
                         f"{block}: expected {expected}, found {tuple(scale.shape)}")
    s = _scale_values(scale)
    t = _tiles(decode_fp8(weight, fmt), block) * s[..., :, None, :, None]
    return _untile(t, n, k).to(out_dtype).contiguous()
