"""Batch-invariant dense GEMM and RMSNorm kernels vs the oracle (``dsv4.model.linear`` / ``norms``).

dense_linear: both sides multiply the same operands (x rounded to the weight dtype) with fp32
accumulation, so fp32 results differ by summation order only: |Δ| ≤ 1e-5·Σ_k|x_k w_k|
(``assert_fp32_accum_close``). bf16 results round once more on each side, which can flip one
rounding: + one bf16 spacing of the result (≤ 2^-7 relative). Batch invariance is bitwise: row r
of an M-row launch equals the row launched alone, for M in {1, 3, 8, 64, 80}, at several
positions, and in both launch modes (fused chunks in one program / one program per chunk + an
ordered fp32 sum).

rms_norm / unit_rms_norm: the same fp32 statistics up to summation order, then the oracle's
roundings. Worst case per side: Σx² off by ≤ 12·u (a tree of depth ≤ 11 over ≤ 2 terms per lane
here; torch's cascade sum is as deep), r by half of that plus 2 roundings (sqrt, division), and
y by 2 more (x·r, w·y): ≤ 10·u per side, so fp32 results agree within 20·2^-24 ≈ 1.2e-6
relative (measured ≤ 2.4e-7); bf16 results within one bf16 spacing (≤ 2^-7 relative; measured:
bitwise equal).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import BF16_ULP, DEV, assert_fp32_accum_close, gen, randn  # noqa: E402

from dsv4.model import norms  # noqa: E402
from dsv4.model.linear import linear  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import dense as td  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32


def _absprod(x, w):
    return x.to(w.dtype).float().abs() @ w.float().abs().T


@pytest.mark.parametrize("wdt,xdt", [(BF16, BF16), (BF16, FP32), (FP32, FP32), (FP32, BF16)])
def test_dense_linear_matches_oracle(wdt, xdt):
    g = gen(1)
    m, n, k = 70, 200, 328  # N, K not multiples of the tiles; M spans two row blocks
    x = randn((m, k), g, dtype=xdt)
    w = randn((n, k), g, scale=k ** -0.5, dtype=wdt)
    w[:20, :40] *= 30.0  # rows of very different scale
    y = td.dense_linear(x, w)
    ref = linear(x, w)
    assert y.dtype == wdt and y.shape == (m, n)
    ap = _absprod(x, w)
    if wdt == FP32:
        assert_fp32_accum_close(y, ref, ap)
    else:
        d = (y.float() - ref.float()).abs()
        print(f"\nbf16 weight, {xdt} x: {int((y != ref).sum())} of {y.numel()} differ from the oracle, "
              f"max |Δ| {d.max().item():.3g}")
        assert bool((d <= 2 * BF16_ULP * ref.float().abs() + 1e-5 * ap + 1e-30).all()), d.max()
    # leading dimensions are kept
    y3 = td.dense_linear(x[:6].reshape(2, 3, k), w)
    assert y3.shape == (2, 3, n) and torch.equal(y3.reshape(6, n), y[:6])


def test_fp32_output_of_bf16_operands_is_the_unrounded_accumulator():
    """The router's logits (``linear_f32``): bf16 x and w with an fp32 result are the fp32 GEMM of
    the same values up to the order of the sums (the products are exact), and rounding that result
    to bf16 gives the bf16 call's bits (same chunks, same steps: only the final store differs)."""
    from dsv4.model.linear import linear_f32

    g = gen(9)
    m, n, k = 70, 200, 328
    x = randn((m, k), g, dtype=BF16)
    w = randn((n, k), g, scale=k ** -0.5, dtype=BF16)
    y = td.dense_linear(x, w, out_dtype=FP32)
    assert y.dtype == FP32 and y.shape == (m, n)
    assert_fp32_accum_close(y, linear(x.float(), w.float()), _absprod(x, w))
    assert torch.equal(y.to(BF16), td.dense_linear(x, w))
    assert torch.equal(linear_f32(x, w), linear(x.float(), w.float()))  # no fast kernel: the fp32 GEMM
    from dsv4.model.opset import OpSet

    fast_ops = OpSet({"dense_linear": td.dense_linear})  # the fast path: the bf16 GEMM, fp32 result
    fast = fast_ops.linear_f32(x, w)
    assert torch.equal(fast, y) and torch.equal(fast_ops.linear_f32(x[5:6], w), y[5:6])  # and batch-invariant
    assert torch.equal(fast_ops.linear_f32(x.float(), w), linear(x.float(), w.float()))  # fp32 x: the fp32 GEMM
    with pytest.raises(TypeError, match="out_dtype"):
        td.dense_linear(x, w, out_dtype=torch.float16)


def test_prefill_tile_gives_the_decode_tiles_bits():
    """At M ≥ PREFILL_MIN_ROWS the fused launch takes ``PREFILL_16BIT``'s MMA tile with the base
    tile's K chunks: a row's bits are those of a decode-sized launch (on the H200 too: tests/gpu)."""
    g = gen(10)
    m, n, k = td.PREFILL_MIN_ROWS + 6, td.PREFILL_MIN_N, 128
    x = randn((m, k), g, dtype=BF16)
    w = randn((n, k), g, scale=k ** -0.5, dtype=BF16)
    y = td.dense_linear(x, w)
    assert torch.equal(y[:64], td.dense_linear(x[:64], w))
    assert torch.equal(y[-1:], td.dense_linear(x[-1:], w))


def test_chunking_depends_on_the_weight_only():
    c16, c32 = td.config_for(BF16), td.config_for(FP32)
    assert td.chunking(129280, 4096, c16) == 4096  # head: 1010 tiles, one chunk
    assert td.chunking(1024, 4096, c16) == 512  # compressor-like: 8 tiles x 8 chunks
    assert td.chunking(64, 4096, c16) == 512  # weights_proj-like
    assert td.chunking(256, 4096, c32) == 512  # fp32 gate-like: 4 tiles x 8 chunks
    assert td.chunking(4, 16384, c32) == 512  # hc_head fn-like
    assert td.chunking(200, 328, c16) == 384  # small: one chunk


@pytest.mark.parametrize("wdt,xdt", [(BF16, FP32), (FP32, FP32)])
def test_dense_linear_batch_invariant_both_modes(wdt, xdt):
    """Chunks of 128 columns (2 for K = 200, the last partial) so that the split mode runs."""
    g = gen(2)
    n, k, pool = 100, 200, 80
    x = randn((pool, k), g, dtype=xdt)
    w = randn((n, k), g, scale=k ** -0.5, dtype=wdt)
    cfg = {"chunk": 128}
    probe = [0, 1, 64, 77, 79]
    alone = {r: td.dense_linear(x[r:r + 1], w, config=cfg) for r in probe}
    for r in probe[:2]:
        assert torch.equal(td.dense_linear(x[r:r + 1], w, config=cfg, mode="fused"), alone[r])
    gp = gen(3)
    for m in (3, 8, 64, 80):
        rows = torch.randperm(pool, generator=gp)[:m]
        for r, pos in zip(probe, torch.randperm(m, generator=gp).tolist()):
            rows[pos] = r
        xb = x[rows.to(x.device)]
        modes = ("fused", "split") if m in (8, 80) else (None,)
        for mode in modes:
            y = td.dense_linear(xb, w, config=cfg, mode=mode)
            for pos in range(m):
                r = int(rows[pos])
                if r in alone:
                    assert torch.equal(y[pos], alone[r][0]), (m, mode, r, pos)
    # the default chunking (one chunk here) is invariant too
    y = td.dense_linear(x[:64], w)
    assert torch.equal(y[37], td.dense_linear(x[37:38], w)[0])


@pytest.mark.parametrize("dt", [FP32, BF16])
def test_rms_norms_match_oracle_and_are_batch_invariant(dt):
    g = gen(4)
    for d in (256, 2500):  # 2500: two column blocks of 2048, the last partial
        x = randn((8, d), g, scale=3.0, dtype=dt)
        x[0, :5] *= 50.0
        w = (1.0 + 0.1 * torch.randn(d, generator=g)).to(DEV)
        for name, got, want in (
                ("rms_norm", td.rms_norm(x, w, 1e-6), norms.rms_norm(x, w, 1e-6)),
                ("rms_norm(no weight)", td.rms_norm(x, None, 1e-6), norms.rms_norm(x, None, 1e-6)),
                ("unit_rms_norm", td.unit_rms_norm(x, 1e-6), norms.unit_rms_norm(x, 1e-6))):
            assert got.dtype == dt and got.shape == x.shape
            dlt = (got.float() - want.float()).abs()
            tol = (20 * 2.0 ** -24 if dt == FP32 else 2 * BF16_ULP) * want.float().abs() + 1e-30
            print(f"\n{dt} D={d} {name}: {int((got != want).sum())} of {got.numel()} differ, "
                  f"max |Δ|/|ref| {(dlt / (want.float().abs() + 1e-30)).max().item():.3g}")
            assert bool((dlt <= tol).all()), name
    x = randn((64, 256), g, dtype=dt)
    w = (1.0 + 0.1 * torch.randn(256, generator=g)).to(DEV)
    wide = torch.cat([x, randn((64, 100), g, dtype=dt)], dim=1)[:, :256]  # rows read with their stride: the same bits
    assert torch.equal(td.rms_norm(wide, w, 1e-6), td.rms_norm(x, w, 1e-6))
    full, ufull = td.rms_norm(x, w, 1e-6), td.unit_rms_norm(x.view(64, 2, 128), 1e-6)
    for m, start in ((1, 5), (3, 40), (8, 56)):  # subsets of the M = 64 launch
        assert torch.equal(td.rms_norm(x[start:start + m], w, 1e-6), full[start:start + m])
        assert torch.equal(td.unit_rms_norm(x[start:start + m].view(m, 2, 128), 1e-6), ufull[start:start + m])


def test_registry_and_errors():
    assert resolve("dense_linear", force="dense_linear=triton")[1] is td.dense_linear
    assert resolve("rms_norm", force="all=torch")[1] is norms.rms_norm
    assert resolve("unit_rms_norm", force="unit_rms_norm=triton")[1] is td.unit_rms_norm
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match="K=8"):
        td.dense_linear(x, torch.zeros(4, 9, device=DEV))
    with pytest.raises(TypeError, match="float8"):
        td.dense_linear(x, torch.zeros(4, 8, device=DEV).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="norm weight"):
        td.rms_norm(x, torch.ones(7, device=DEV), 1e-6)
    assert td.dense_linear(x[:0], torch.zeros(4, 8, device=DEV)).shape == (0, 4)


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_stacked_weights_with_chunk_rows_give_each_calls_bits(wdt):
    """A compressor's [wkv; wgate] in one launch: with chunk_rows = the height of one weight, each
    half of the result is bitwise that weight's own call, in both launch modes and at any M (the
    small TARGET_PROGRAMS / MIN_CHUNK make the stacked weight's own chunking differ)."""
    g = gen(21)
    cfg = dict(TARGET_PROGRAMS=4, MIN_CHUNK=32)
    n, k = 128, 256
    assert td.chunking(n, k, td.config_for(wdt, cfg)) != td.chunking(2 * n, k, td.config_for(wdt, cfg))
    wa, wb = randn((n, k), g, 0.05, wdt), randn((n, k), g, 0.05, wdt)
    both = torch.cat([wa, wb])
    for m in (1, 5):
        x = randn((m, k), g, 1.0, wdt)
        want = torch.cat([td.dense_linear(x, wa, config=cfg), td.dense_linear(x, wb, config=cfg)], dim=-1)
        for mode in ("fused", "split"):
            got = td.dense_linear(x, both, config=cfg, mode=mode, chunk_rows=n)
            assert torch.equal(got, want), (m, mode)


def test_compressor_state_rows_in_one_launch_are_the_two_calls_bitwise(tiny_ckpt):
    """Compressor.state_rows on the fast path (one GEMM of the stacked [wkv; wgate], the ape added in
    place) equals the two separate dense_linear calls + ape + cat; the weights are views of the
    stacked tensor, also in the model's weight store."""
    from dsv4.model.model import ReferenceModel
    from dsv4.model.opset import OpSet

    model = ReferenceModel(tiny_ckpt, dtype=torch.bfloat16, device=DEV, ops=OpSet({"dense_linear": td.dense_linear}))
    comps = [b.attn.compressor for b in model.blocks if b.attn.compressor is not None]
    assert comps
    for comp in comps:
        assert comp.w_state is not None and comp.wkv.data_ptr() == comp.w_state.data_ptr()
        x = randn((7, model.cfg.hidden_size), gen(4), 1.0, torch.bfloat16)
        pos = torch.arange(40, 47, device=x.device)
        got = comp.state_rows(x, pos % comp.ratio)
        want = torch.cat([td.dense_linear(x, comp.wkv).float(),
                          td.dense_linear(x, comp.wgate).float() + comp.ape[pos % comp.ratio]], dim=-1)
        assert torch.equal(got, want)
    key = next(k for k in model.w.t if k.endswith("compressor.wkv.weight"))
    comps += [b.attn.idx_compressor for b in model.blocks if getattr(b.attn, "idx_compressor", None) is not None]
    assert model.w[key].data_ptr() in {c.wkv.data_ptr() for c in comps}


@pytest.mark.parametrize("m", [1, 9, 20])
def test_split_fixup_gives_sum_in_orders_bits(monkeypatch, m):
    """Split mode summed by each tile's last program (``_common.SPLIT_FIXUP``) gives the bits of the
    ``sum_in_order`` launch (the same additions in the same order), twice in a row (the arrival
    counters go back to 0); rows past the last program's first 8 included (m = 9, 20)."""
    from dsv4.ops.triton import _common
    monkeypatch.setattr(_common, "SPLIT_FIXUP", False)  # the plain results: the sum_in_order launch

    g = gen(50 + m)
    x, other = randn((m, 200), g, dtype=FP32), randn((m, 200), g, dtype=FP32)
    for wdt, out in ((BF16, None), (FP32, None), (BF16, FP32)):
        w = randn((100, 200), g, scale=200 ** -0.5, dtype=wdt)
        plain = td.dense_linear(x, w, config={"chunk": 128}, mode="split", out_dtype=out)
        for _ in range(2):
            td.dense_linear(other, w, config={"chunk": 128}, mode="split", out_dtype=out)  # (a stale workspace)
            monkeypatch.setattr(_common, "SPLIT_FIXUP", True)
            fixed = td.dense_linear(x, w, config={"chunk": 128}, mode="split", out_dtype=out)
            monkeypatch.setattr(_common, "SPLIT_FIXUP", False)
            assert torch.equal(fixed, plain), (wdt, out)
        assert int(_common.split_counters(x.device, 1).abs().sum()) == 0
    assert_fp32_accum_close(fixed, x.to(BF16).float() @ w.float().T, _absprod(x, w))
