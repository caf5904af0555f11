"""Batch-invariant building blocks shared by every op of the reference model.

Determinism rule of the oracle: a token's result must not depend on the other tokens in the
batch or chunk. Two CPU effects break that and are handled here and at each op: BLAS uses a
different kernel for a trailing partial tile of rows (so GEMM rows are padded to a multiple of 8),
and vectorised vs scalar tails of transcendental ops (exp, sigmoid, sin/cos) differ by an ulp (so
those run in float64 and are rounded to float32, which absorbs the ulp).
"""

from __future__ import annotations

import torch

from ..formats import OCP, fake_quant_fp8_pow2
from .kernels import kernel


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x·wᵀ in fp32 (the MoE router's logits: fp32 products, fp32 sums). With bf16 x and w on the
    fast path this is the batch-invariant GEMM with bf16 operands and an fp32 result: a product of
    two bf16 values is exact in fp32 and the MMA accumulates in fp32, so only the order of the fp32
    sums differs from the fp32 GEMM — which ran on CUDA cores (the 8K prefill's four router GEMMs
    took ~9 ms of its 142, the bf16 MMA ~0.2 ms). Anything else: the fp32 GEMM, as before."""
    fast = kernel("dense_linear")
    if fast is not None and fast is not linear and x.dtype == w.dtype == torch.bfloat16:
        return fast(x, w, out_dtype=torch.float32)
    return linear(x.float(), w.float())


def linear(x: torch.Tensor, w: torch.Tensor, act_quant: bool = False) -> torch.Tensor:
    """y = x·wᵀ in the weight dtype, with rows computed independently of the batch.

    ``act_quant`` simulates the release's per-128 FP8 activations. On CPU, BLAS handles a
    trailing partial tile of rows with a different kernel (measured: rows agree bitwise only
    when M is a multiple of 4), so rows are padded to a multiple of 8: a token's result then
    never depends on which other tokens share the batch or the chunk.
    """
    if act_quant:
        x = fake_quant_fp8_pow2(x.float(), 128, OCP).to(x.dtype)
    if not isinstance(w, torch.Tensor):  # an FP8Weight: the registered fp8_linear op (GPU path)
        if w.op is None:
            return torch.nn.functional.linear(x, w.dequantize(x.dtype))
        return w.op(x, w.weight, w.scale)
    x = x.to(w.dtype)
    fast = kernel("dense_linear")
    if fast is not None:  # the batch-invariant GEMM of the fast path (dsv4.model.kernels)
        return fast(x, w)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    pad = (-m) % 8 if x2.device.type == "cpu" else 0
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    y = torch.nn.functional.linear(x2, w)
    return y[:m].reshape(*lead, w.shape[0])


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row; ties go to the lowest index (deterministic)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]
