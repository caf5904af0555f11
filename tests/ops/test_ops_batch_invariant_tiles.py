"""Batch invariance of the weight kernels at decode sizes (issue 8).

With ``dsv4.ops.invariance`` on (the default), a row's result must be bitwise the same whether it
is computed alone or among up to 64 rows: the FP8 linear keeps one tile shape and split-K count
for every M ≤ 64 and sums the splits in a fixed order; the MoE keeps the grouped kernels with one
tile shape. (Prefill sizes keep their fastest tiles; invariance is promised for decode batches.)

On CPU the interpreter's dot is numpy's BLAS, whose result for a row can depend on where the row
sits inside the tile; so here the rows keep their place (leading rows of a larger launch) and the
test checks what the tile pickers control — the tiles and splits do not change with M. Whether a
row's place in an MMA tile matters is a property of the GPU, checked on the H200 by
tests/gpu/test_gpu_batch_invariance.py.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen, mxfp4_experts, randn  # noqa: E402

from dsv4.formats import quantize_block_fp8  # noqa: E402
from dsv4.ops import stack_experts, torch_ops  # noqa: E402
from dsv4.ops.invariance import batch_invariant  # noqa: E402
from dsv4.ops.triton import fp8_linear as tlin  # noqa: E402
from dsv4.ops.triton import moe as tmoe  # noqa: E402


def test_invariance_is_on_by_default():
    assert batch_invariant()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_row_is_independent_of_m(dtype):
    g = gen(11)
    n, k = 256, 512  # K of 4 blocks: split-K is used at decode sizes
    w, s = quantize_block_fp8(torch.randn(n, k, generator=g) * 0.05)
    w, s = w.to(DEV), s.to(DEV)
    x = randn((64, k), g, dtype=dtype)
    cfgs = {m: tlin.pick_config(m, n, k, torch.device(DEV)) for m in (1, 3, 17, 64)}
    assert cfgs[1]["split_k"] > 1 and all(c == cfgs[1] for c in cfgs.values())
    full = tlin.fp8_linear(x, w, s)
    for m in (1, 3, 17):
        assert torch.equal(tlin.fp8_linear(x[:m], w, s), full[:m]), f"M={m}: rows differ from the M=64 launch"


def test_moe_token_is_independent_of_batch():
    E, K, H, I = 8, 6, 128, 64
    layer = stack_experts(*mxfp4_experts(E, H, I, gen(1)))
    g = gen(12)
    x = randn((24, H), g)
    ids, wts = torch_ops.moe_route(randn((24, E), g, 2.0), randn((E,), g, 0.1), K, 1.5, True, None, None)
    assert tmoe.pick_moe_config(1, K, E, "fp4") == tmoe.pick_moe_config(64, K, E, "fp4")
    full = tmoe.moe_experts(x, ids, wts, *layer)
    for m in (1, 3):
        assert torch.equal(tmoe.moe_experts(x[:m], ids[:m], wts[:m], *layer), full[:m])
