"""Batch-invariant building blocks shared by every op of the reference model.

Determinism rule of the oracle: a token's result must not depend on the other tokens in the
batch or chunk. Two CPU effects break that and are handled here and at each op: BLAS picks its
kernel from the number of rows (so GEMM rows run in separate calls of ``CPU_ROW_BLOCK`` rows),
and vectorised vs scalar tails of transcendental ops (exp, sigmoid, sin/cos) differ by an ulp (so
those run in float64 and are rounded to float32, which absorbs the ulp).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..formats import OCP, fake_quant_fp8_pow2

# CPU GEMMs run as separate calls of exactly this many rows: the BLAS picks its kernel from M, so a
# row's bits depend on the batch it is in — on an AVX-512/AMX Xeon (Sapphire Rapids) even for M a
# multiple of 8 (fp32, K = 1024: every M = 8..56 differed from the M = 64 call), while every call
# of M = 8 gives a row the same bits at any position (measured over fp32/bf16 and the model's shapes).
CPU_ROW_BLOCK = 8


def linear_f32(x: torch.Tensor, w: torch.Tensor, w32: Callable[[], torch.Tensor] | None = None,
               fast: Callable | None = None) -> torch.Tensor:
    """x·wᵀ in fp32 (the MoE router's logits: fp32 products, fp32 sums). With bf16 x and w and a
    batch-invariant GEMM kernel (``fast``, the op set's dense_linear kernel) this is that GEMM with
    bf16 operands and an fp32 result: a product of two bf16 values is exact in fp32 and the MMA
    accumulates in fp32, so only the order of the fp32 sums differs from the fp32 GEMM, which runs on
    CUDA cores (the 8K prefill's four router GEMMs: 10.8 ms against ~0.2 ms). Anything else: the fp32
    GEMM (``w32``: returns w in fp32, e.g. a copy made once and kept; called only here, so the fast
    path never makes the copy)."""
    if fast is not None and x.dtype == w.dtype == torch.bfloat16:
        return fast(x, w, out_dtype=torch.float32)
    return rows_linear(x.float(), w32() if w32 is not None else w.float())


def linear(x: torch.Tensor, w, act_quant: bool = False, dense: Callable | None = None) -> torch.Tensor:
    """y = x·wᵀ in the weight dtype, with rows computed independently of the batch.

    ``act_quant`` simulates the release's per-128 FP8 activations. ``w`` is a tensor (multiplied by
    ``dense``, the op set's dense GEMM; default ``rows_linear``) or an ``FP8Weight`` (its fp8_linear
    op, or its dequantized values).
    """
    if not isinstance(w, torch.Tensor) and w.op is not None:  # an FP8Weight: the registered fp8_linear op
        if act_quant:  # the op rounds x itself, the same values (Triton: one launch, not ~20 torch kernels)
            return w.op(x, w.weight, w.scale, act_quant=True, act_fmt=OCP)
        return w.op(x, w.weight, w.scale)
    if act_quant:
        x = fake_quant_fp8_pow2(x.float(), 128, OCP).to(x.dtype)
    if not isinstance(w, torch.Tensor):
        return rows_linear(x, w.dequantize(x.dtype))
    return (dense or rows_linear)(x.to(w.dtype), w)


def dense_reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                    chunk_rows: int | None = None) -> torch.Tensor:
    """The torch side of the ``dense_linear`` op: ``rows_linear`` in the weight dtype (``out_dtype``:
    the fp32 GEMM of the same values, cast); ``chunk_rows``: the weight's first rows and the rest are
    two weights stacked, each multiplied as its own call would be."""
    if chunk_rows is not None:
        return torch.cat([dense_reference(x, w[:chunk_rows], out_dtype), dense_reference(x, w[chunk_rows:], out_dtype)],
                         dim=-1)
    if out_dtype is not None and out_dtype != w.dtype:
        return rows_linear(x.float(), w.float()).to(out_dtype)
    return rows_linear(x.to(w.dtype), w)


def rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` whose rows do not depend on how many rows come with them: on CPU the rows
    run in separate calls of ``CPU_ROW_BLOCK`` rows (the last one zero-padded), elsewhere in one
    call. Shared by the oracle's ``linear`` and the torch backends of the registered ops, so both
    give a row the same bits."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if x2.device.type != "cpu":
        return torch.nn.functional.linear(x2, w).reshape(*lead, w.shape[0])
    pad = (-m) % CPU_ROW_BLOCK
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    y = torch.cat([torch.nn.functional.linear(x2[i:i + CPU_ROW_BLOCK], w) for i in range(0, m + pad, CPU_ROW_BLOCK)])
    return y[:m].reshape(*lead, w.shape[0])


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row; ties go to the lowest index (deterministic)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]
