"""Reference (torch) backends: the CPU path and the oracle the Triton kernels are tested against.

Numerics follow ``dsv4.model`` (``linear.py``, ``moe.py``):

* ``fp8_linear``: ``F.linear(x, dequantize_block_fp8(w, s, out_dtype=x.dtype))``, in the oracle's
  CPU row blocks (``model.linear.rows_linear``, as the expert GEMMs below). With an ``out_dtype``
  other than ``x.dtype`` the same operands are multiplied with float32 accumulation and no
  intermediate rounding (what a GPU kernel with an fp32 accumulator returns).
* ``moe_route``: s = sqrt(softplus(logit)) computed in float64 and rounded to float32; selection
  by s + bias (NaN → -1e30, ties to the lowest expert id), or ids from the hash table; weights =
  s at the ids / (their float64 sum + 1e-20) × scale. Padding rows (``valid`` False) get id -1
  and weight 0.
* ``moe_experts``: per expert, gate = x·W1ᵀ and up = x·W3ᵀ in x.dtype, h =
  silu(min(gate, limit)) · clamp(up, ±limit) (float64, rounded to x.dtype), y = h·W2ᵀ in x.dtype,
  out += w · y in float32; slots with id -1 are skipped; the result is cast to x.dtype.

Expert weights are stacked per layer in their checkpoint encoding (``dsv4.formats.experts``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..formats import dequantize_block_fp8, dequantize_mxfp4, fake_quant_fp8_pow2, get_fp8_format
from ..formats.experts import as_bytes, expert_dtype_of
from ..model.branches import resolve
from ..model.linear import rows_linear

__all__ = ["fp8_linear", "moe_route", "moe_experts", "greedy_pick", "act_format"]


def act_format(act_fmt=None):
    """FP8 format of quantized activations: the argument, else the platform's (DSV4_PLATFORM_FP8)."""
    if act_fmt is None:
        from .platform import detect_platform

        act_fmt = detect_platform().fp8_format or "ocp"
    return get_fp8_format(act_fmt)


def check_act_quant_width(k: int, name: str) -> None:
    """act_quant's blocks are 128 columns: a width that is not a multiple is refused by name."""
    if k % 128:
        raise ValueError(f"act_quant needs {name}'s width to be a multiple of 128, got {k}")


# ---------------------------------------------------------------------------------------------
# FP8 block-scaled linear
# ---------------------------------------------------------------------------------------------

def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype=None,
               act_quant: bool = False, act_fmt=None, groups: int = 1) -> torch.Tensor:
    """y = x · dequant(weight, scale)ᵀ; weight FP8 [N, K] (OCP, FNUZ or uint8 = OCP bytes),
    scale [ceil(N/128), ceil(K/128)] UE8M0 (uint8 / float8_e8m0fnu) or float32.

    ``act_quant`` first rounds x to FP8 per 128 K-elements with power-of-two scales (the
    release's FP8 activations; K must be a multiple of 128); ``act_fmt`` picks OCP (max 448) or
    FNUZ (224), default the platform's format. ``groups`` > 1: a block-diagonal weight (the
    attention's grouped output projection): x [..., groups·K], group g's N/groups rows (whole
    128-row scale blocks) times x's g-th K columns, concatenated.
    """
    if groups != 1:
        n, k = weight.shape
        if groups < 1 or n % groups or (n // groups) % 128:
            raise ValueError(f"groups={groups} must split the weight's {n} rows into whole 128-row blocks")
        if x.shape[-1] != groups * k:
            raise ValueError(f"x has K={x.shape[-1]} but the weight is {(n, k)} in {groups} groups: "
                             f"expected {groups * k}")
        r = n // groups
        return torch.cat([fp8_linear(x[..., i * k:(i + 1) * k], weight[i * r:(i + 1) * r],
                                     scale[i * r // 128:(i + 1) * r // 128], out_dtype, act_quant, act_fmt)
                          for i in range(groups)], dim=-1)
    out_dtype = out_dtype or x.dtype
    if act_quant:
        x = fake_quant_fp8_pow2(x.float(), 128, act_format(act_fmt)).to(x.dtype)
    w = dequantize_block_fp8(weight, scale, out_dtype=x.dtype)
    if out_dtype == x.dtype:
        return rows_linear(x, w)
    return rows_linear(x.float(), w.float()).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# MoE routing
# ---------------------------------------------------------------------------------------------

def moe_route(gate_logits: torch.Tensor, bias: torch.Tensor | None, topk: int, scale: float = 1.0,
              norm: bool = True, hash_ids: torch.Tensor | None = None,
              valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_logits float32 [T, E] -> (ids int32 [T, topk], weights float32 [T, topk]).

    ``hash_ids`` [T, topk] (``tid2eid[token_ids]``, already clamped by the caller) replaces the
    top-k selection; ``bias`` only affects selection. Rows with ``valid`` False get id -1, weight 0.
    """
    logits = gate_logits.float()
    t = logits.shape[0]
    scores = torch.sqrt(F.softplus(logits.double())).float()
    if hash_ids is not None:
        ids = hash_ids.long()
        if ids.shape != (t, topk):
            raise ValueError(f"hash_ids shape {tuple(ids.shape)} != {(t, topk)}")
    else:
        sel = scores if bias is None else scores + bias.float()
        sel = torch.nan_to_num(sel, nan=-1e30)
        ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = scores.gather(1, ids)
    if norm:
        w = (w.double() / (w.double().sum(dim=-1, keepdim=True) + 1e-20)).float()
    w = w * scale
    ids = ids.to(torch.int32)
    if valid is not None:
        v = valid.to(torch.bool).reshape(t, 1)
        ids = torch.where(v, ids, torch.full_like(ids, -1))
        w = torch.where(v, w, torch.zeros_like(w))
    return ids, w


# ---------------------------------------------------------------------------------------------
# MoE experts
# ---------------------------------------------------------------------------------------------

def greedy_pick(x: torch.Tensor) -> torch.Tensor:
    """int64 [2, n] on ``x``'s device: each row of the logits [n, V] its first-argmax id (torch.argmax
    returns the first maximal index: the lowest id among equal maxima) and whether it is all finite."""
    return torch.stack([x.argmax(dim=-1), torch.isfinite(x).all(dim=-1).long()])


def _dequant_expert(w13, s13, w2, s2, e: int, expert_dtype: str, dtype):
    if expert_dtype == "fp4":
        i2 = w13.shape[1]
        i = i2 // 2
        w1 = dequantize_mxfp4(as_bytes(w13[e, :i]), as_bytes(s13[e, :i]), dtype=dtype)
        w3 = dequantize_mxfp4(as_bytes(w13[e, i:]), as_bytes(s13[e, i:]), dtype=dtype)
        wd = dequantize_mxfp4(as_bytes(w2[e]), as_bytes(s2[e]), dtype=dtype)
    else:
        i = w13.shape[1] // 2
        nb1 = math.ceil(i / 128)
        w1 = dequantize_block_fp8(w13[e, :i], s13[e, :nb1], out_dtype=dtype)
        w3 = dequantize_block_fp8(w13[e, i:], s13[e, nb1:], out_dtype=dtype)
        wd = dequantize_block_fp8(w2[e], s2[e], out_dtype=dtype)
    return w1, w3, wd


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float = 10.0,
                expert_dtype: str | None = None, add: torch.Tensor | None = None, act_quant: bool = False,
                act_fmt=None) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) -> [T, H] in x.dtype (slots with id -1 skipped); ``add``
    ([T, H] in x.dtype, e.g. the shared expert's output, or a ``Pending`` / ``Deferred`` branch giving it,
    joined where it is added) added to that, in x.dtype. ``act_quant``: each expert GEMM's input (x, and the
    SwiGLU output h) rounded to FP8 per 128 columns first, as ``fp8_linear``'s (the release's FP8 activations)."""
    expert_dtype = expert_dtype or expert_dtype_of(w13)
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype must be 'fp4' or 'fp8', got {expert_dtype!r}")
    t, h = x.shape
    if act_quant:
        check_act_quant_width(h, "x")
        check_act_quant_width(w2.shape[-1] * (2 if expert_dtype == "fp4" else 1), "the experts' intermediate h")
        x = fake_quant_fp8_pow2(x.float(), 128, act_format(act_fmt)).to(x.dtype)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    ids = ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, slot = torch.where(ids == e)
        w1, w3, wd = _dequant_expert(w13, s13, w2, s2, e, expert_dtype, x.dtype)
        xe = x[rows]
        gate = rows_linear(xe, w1).float().clamp(max=limit)
        up = rows_linear(xe, w3).float().clamp(min=-limit, max=limit)
        hh = (F.silu(gate.double()) * up.double()).to(x.dtype)
        if act_quant:
            hh = fake_quant_fp8_pow2(hh.float(), 128, act_format(act_fmt)).to(x.dtype)
        y = rows_linear(hh, wd)
        out.index_add_(0, rows, y.float() * weights[rows, slot, None].float())
    out = out.to(x.dtype)
    return out if add is None else out + resolve(add)
