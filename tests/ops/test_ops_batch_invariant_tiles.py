"""Batch invariance of the weight kernels at decode sizes.

With ``dsv4.ops.invariance`` on (the default), a row's result must be bitwise the same whether it
is computed alone or among any number of rows: the FP8 linear reduces K in the same chunks, in the
same order, for every M (one program per chunk at decode sizes, all chunks folded in one program at
prefill sizes); the MoE keeps the grouped kernels with one tile shape at decode sizes.

The FP8 linear sums products k by k in the interpreter, so its rows can be compared at any place
and any M here. The MoE's interpreter dot is numpy's BLAS, whose result for a row can depend on
where the row sits inside the tile; so its rows keep their place (leading rows of a larger launch).
Whether a row's place in an MMA tile matters is a property of the GPU, checked on the H200 by
tests/gpu/test_gpu_batch_invariance.py and tests/gpu/test_gpu_prefill_invariance.py.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen, mxfp4_experts, randn  # noqa: E402

from dsv4.formats import quantize_block_fp8  # noqa: E402
from dsv4.formats.experts import stack_experts
from dsv4.ops import torch_ops  # noqa: E402
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
    # the same K chunks at every decode size; only the MMA's width follows M (16, 16, 32, 64)
    assert cfgs[1]["split_k"] > 1 and all((c["chunk"], c["split_k"]) == (cfgs[1]["chunk"], cfgs[1]["split_k"])
                                          for c in cfgs.values())
    assert [cfgs[m]["BLOCK_M"] for m in (1, 3, 17, 64)] == [16, 16, 32, 64]
    full = tlin.fp8_linear(x, w, s)
    for m in (1, 3, 17):
        assert torch.equal(tlin.fp8_linear(x[:m], w, s), full[:m]), f"M={m}: rows differ from the M=64 launch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_rows_equal_at_decode_and_prefill_sizes(dtype):
    """A prompt prefilled alone (M ≤ 64: split mode) or among others (M > 64: fused mode, other
    tiles) gets the same bits: the K chunks and their order depend on the weight only."""
    g = gen(13)
    n, k = 192, 640  # 5 K blocks, 3 column tiles: several chunks
    w, s = quantize_block_fp8(torch.randn(n, k, generator=g) * 0.05)
    w, s = w.to(DEV), s.to(DEV)
    x = randn((150, k), g, dtype=dtype)
    dec, pre = (tlin.pick_config(m, n, k, torch.device(DEV)) for m in (3, 150))
    assert dec["chunk"] == pre["chunk"] == tlin.invariant_chunk(n, k, torch.device(DEV))
    assert dec["split_k"] > 1 and pre["split_k"] == 1 and pre["chunks_per_program"] == dec["split_k"]
    assert pre["BLOCK_M"] != dec["BLOCK_M"]
    full = tlin.fp8_linear(x, w, s)
    for rows in ([0], [7, 149, 64], list(range(64)), list(range(40, 150))):
        assert torch.equal(tlin.fp8_linear(x[rows], w, s), full[rows]), f"rows {rows[:3]}…: differ by M"


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


def test_moe_decode_tile_rounds_like_the_prefill_tiles():
    """A prompt's chunk of ≤ DECODE_MAX_ROWS tokens takes the decode tile, a longer one the prefill
    tiles: both must reduce K the same way. Same K step, and warps in multiples of 4 (Hopper's
    wgmma; a 2-warp decode tile fell back to mma.sync and moved a 10-token prompt's logits by
    0.03 on the H200)."""
    E, K = 256, 6
    dec = tmoe.pick_moe_config(1, K, E, "fp4")
    for t in (65, 300, 1024, 8192):
        pre = tmoe.pick_moe_config(t, K, E, "fp4")
        assert not pre["direct"] and pre["BLOCK_K"] == dec["BLOCK_K"], (t, pre, dec)
        assert pre["num_warps"] % 4 == 0 and dec["num_warps"] % 4 == 0, (t, pre, dec)
        assert pre["down_num_warps"] % 4 == 0 and dec["down_num_warps"] % 4 == 0, (t, pre, dec)


@pytest.mark.parametrize("x_bytes", [2, 4])
def test_fp8_linear_tiles_fit_shared_memory(x_bytes):
    """Every automatic tile fits the H200's shared memory at bf16 and at fp32 activations (fp32
    prefill once asked for 253,952 bytes of 232,448 and could not launch)."""
    from dsv4.ops.triton import fp8_linear as tlin

    assert tlin.shared_bytes(dict(BLOCK_M=128, BLOCK_N=64, num_stages=4), 4) == 253952  # what the H200 reported
    for m in (1, 17, 64, 65, 300, 1500, 8192):
        for n, k in ((1024, 4096), (4096, 1024), (32768, 1024), (129280, 4096)):
            cfg = tlin.pick_config(m, n, k, torch.device(DEV), x_bytes=x_bytes)
            assert tlin.shared_bytes(cfg, x_bytes) <= tlin.SHARED_LIMIT, (m, n, k, cfg)
