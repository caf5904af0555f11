"""Triton mHC (hc_pre in two launches, hc_post in one) vs the oracle ``dsv4.model.mhc``.

Accuracy is judged against an exact reference (float64 everywhere, ``_exact``): the oracle itself
is off from it by its fp32 mixes GEMM, and the kernel by its own fp32 GEMM (different summation
order, and r applied after the dot instead of before), both then round the float64 gates to fp32.
The kernel's error must not exceed twice the oracle's + 2 fp32 ulps of 1 (gates are O(1)). Measured
(interpreter, tiny scales, T=64, H=256, worst of fp32/bf16 streams): post/comb max |kernel − exact| 2.9e-7 /
7.7e-8 vs the oracle's 3.5e-7 / 1.8e-7
(|kernel − oracle| ≤ 4.8e-7); peaked inputs (scale·16, base·16, outlier channels ×40): 9.5e-7 /
1.1e-6 vs 2.6e-6 / 2.3e-6 (|kernel − oracle| ≤ 2.6e-6). The collapse differs from the exact one
by the output rounding (≤ u·|x|, u = 2^-8 bf16 / 2^-24 fp32) plus its pre error times Σ|R_i|:
max error/limit 0.99 for bf16 (the rounding alone reaches its bound), 0.15 for fp32.

Batch invariance is bitwise: a token's three outputs are the same whether it runs alone or at
any position of a batch of 3, 8, 64 or 80 tokens.
"""

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from ops_kernel_helpers import DEV, gen, spy_launches  # noqa: E402

from dsv4.model import mhc as ref  # noqa: E402
from dsv4.model.linear import linear  # noqa: E402
from dsv4.model.norms import unit_rms_norm  # noqa: E402
from dsv4.model.opset import reference_ops  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import mhc as tm  # noqa: E402
from dsv4.ops.triton._common import interpreting  # noqa: E402

ITERS, HC_EPS, RMS_EPS = 20, 1e-6, 1e-6
ULP1 = 2.0**-23  # fp32 spacing at 1
HALF_SPACING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _inputs(T, n, H, seed, dtype, peaked=False):
    """Streams and hc_* tensors at the synthetic checkpoint's scales (dsv4.checkpoint.synthetic:
    fn ~ N(0, 1/(n·H)), base ~ N(0, 0.5²), scale ~ U(0.5, 1)); residual streams of std 3.
    ``peaked``: gates near saturation and near one-hot softmax rows (scale and base ×16), and a few
    outlier channels ×40 (dominating the RMS)."""
    g = gen(seed)
    nmix = 2 * n + n * n
    s = torch.randn(T, n, H, generator=g) * 3.0
    fn = torch.randn(nmix, n * H, generator=g) / math.sqrt(n * H)
    base = torch.randn(nmix, generator=g) * 0.5
    scale = torch.rand(3, generator=g) * 0.5 + 0.5
    if peaked:
        s[:, :, :4] *= 40.0
        base, scale = base * 16.0, scale * 16.0
    return s.to(dtype).to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV)


def _exact(s, fn, base, scale):
    """float64 pre, post, comb and collapse (the oracle's formulas, no fp32 rounding anywhere)."""
    T, n, _ = s.shape
    x = s.reshape(T, -1).double()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)
    m = x @ fn.double().T
    b, sc = base.double(), scale.double()
    pre = torch.sigmoid(m[:, :n] * sc[0] + b[:n]) + HC_EPS
    post = 2.0 * torch.sigmoid(m[:, n : 2 * n] * sc[1] + b[n : 2 * n])
    comb0 = torch.softmax(m[:, 2 * n :].view(T, n, n) * sc[2] + b[2 * n :].view(n, n), dim=-1) + HC_EPS
    comb = ref.sinkhorn(comb0, ITERS, HC_EPS)
    col = (pre.unsqueeze(-1) * s.double()).sum(1)
    return pre, post, comb, col


def _oracle_pre(s, fn, base, scale):
    """The oracle's pre (hc_pre does not return it), by its own code path."""
    T, n, _ = s.shape
    mixes = linear(unit_rms_norm(s.reshape(T, -1).float(), RMS_EPS), fn.float()).double()
    return (torch.sigmoid(mixes[:, :n] * scale.double()[0] + base.double()[:n]) + HC_EPS).float()


def _sequential_bounds(s, fn, scale):
    """(post, comb) error bounds from a sequential fp32 mixes sum.

    post = 2·sigmoid(scale1·m + b): |∂post/∂m| ≤ scale1/2, so a mixes error δ moves it by ≤ scale1·δ/2.
    The kernel sums its fp32 mixes GEMM sequentially (FMA over K = n·H), the oracle's cuBLAS in
    blocks; their errors are different draws, so besides "≤ 2× the oracle's error" the kernel may
    reach its own typical sequential-summation error √K·u·Σ|x̂||fn| (Higham, §2.8), measured here
    on the H200: 7.6e-7 for post vs the oracle's 2.0e-7 (the interpreter's BLAS matched the oracle's).
    comb: the softmax moves each entry by ≤ scale2·δ/2 (|∂p_i/∂z_j| summed over j ≤ 1/2), and to
    first order the Sinkhorn's row/column normalisations (each a division by an n-term sum) pass on
    at most n× that; measured on the H200 for bf16 peaked streams: 3.2e-6 vs the oracle's 6.0e-7."""
    T, n, H = s.shape
    x = s.reshape(T, -1).double()
    xh = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)
    dot_err = math.sqrt(n * H) * 2.0**-24 * (xh.abs() @ fn.double().abs().T)  # [T, 2n+n²]
    seq_post = (0.5 * scale.double()[1] * dot_err[:, n : 2 * n]).max().item() + ULP1
    seq_comb = n * (0.5 * scale.double()[2] * dot_err[:, 2 * n :]).max().item() + ULP1
    return seq_post, seq_comb


def _max(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("peaked", [False, True])
def test_hc_pre_matches_oracle(dtype, peaked):
    T, n, H = 64, 4, 256
    s, fn, base, scale = _inputs(T, n, H, 10 + peaked, dtype, peaked)
    col, post, comb = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    o_col, o_post, o_comb = reference_ops().mhc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    assert col.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert col.shape == (T, H) and post.shape == (T, n) and comb.shape == (T, n, n)
    e_pre, e_post, e_comb, e_col = _exact(s, fn, base, scale)
    seq_post, seq_comb = _sequential_bounds(s, fn, scale)
    for name, k, o, e in (("post", post, o_post, e_post), ("comb", comb, o_comb, e_comb)):
        err_k, err_o = _max(k, e), _max(o, e)
        print(
            f"\n{dtype} peaked={peaked} {name}: |kernel-exact| {err_k:.3g}, |oracle-exact| {err_o:.3g}, "
            f"|kernel-oracle| {_max(k, o):.3g}, sequential-sum bound {seq_post if name == 'post' else seq_comb:.3g}"
        )
        lim = max(2 * err_o + 2 * ULP1, seq_post if name == "post" else seq_comb)
        assert err_k <= lim, (name, err_k, err_o)
    # collapse: the fp32 value x̃ is off from the exact x by ≤ δ·Σ|R_i| (δ: a pre error as large as
    # allowed above, plus 4 fp32 roundings of the 4-term sum); rounding x̃ to the stream dtype adds
    # ≤ u·|x̃| ≤ u·|x| + u·|x̃ − x|.
    u = HALF_SPACING[dtype]
    d_pre = 2 * _max(_oracle_pre(s, fn, base, scale), e_pre) + 2 * ULP1 + 4 * HALF_SPACING[torch.float32]
    lim = u * e_col.abs() + (1 + u) * d_pre * s.double().abs().sum(1) + 1e-30
    ratio = ((col.double() - e_col).abs() / lim).max().item()
    print(f"{dtype} peaked={peaked} collapse: |kernel-oracle| {_max(col, o_col):.3g}, max err/limit {ratio:.3g}")
    assert ratio <= 1.0


def test_hc_pre_odd_n_and_slices():
    """n = 3 (padded lanes in the 4×4 Sinkhorn); H slices and collapse blocks do not change bits."""
    s, fn, base, scale = _inputs(9, 3, 128, 3, torch.float32)
    col, post, comb = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    e_pre, e_post, e_comb, e_col = _exact(s, fn, base, scale)
    o = reference_ops().mhc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    assert _max(post, e_post) <= 2 * _max(o[1], e_post) + 2 * ULP1
    assert _max(comb, e_comb) <= 2 * _max(o[2], e_comb) + 2 * ULP1
    # fp32 collapse: pre errors (≤ ~1e-6 each, as bounded above) times Σ_i|R_i| ≤ 3·max|R|
    assert _max(col, o[0]) <= 1e-5 * s.abs().max().item()
    s, fn, base, scale = _inputs(20, 4, 256, 4, torch.bfloat16)
    a = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    b = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, config=dict(H_SLICE=128, GATE_BLOCK_H=64))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_hc_pre_batch_invariant():
    """Rows launched alone == the same rows at random positions of batches of M tokens (M = 80
    spans two mixes blocks of 64 and ten gate blocks of 8). bf16 streams (the GPU path), peaked."""
    n, H, pool = 4, 256, 80
    s, fn, base, scale = _inputs(pool, n, H, 21, torch.bfloat16, peaked=True)
    probe = torch.tensor([0, 5, 17, 63, 79])
    alone = [tm.hc_pre(s[r : r + 1], fn, base, scale, ITERS, HC_EPS, RMS_EPS) for r in probe.tolist()]
    g = gen(5)
    for m in (1, 3, 8, 64, 80):
        k = min(m, len(probe))
        rest = torch.tensor([r for r in torch.randperm(pool, generator=g).tolist() if r not in probe.tolist()])
        rows = torch.cat([probe[:k], rest[: m - k]])
        perm = torch.randperm(m, generator=g)
        rows = rows[perm]
        out = tm.hc_pre(s[rows.to(s.device)], fn, base, scale, ITERS, HC_EPS, RMS_EPS)
        for p_idx in range(k):
            pos = int((perm == p_idx).nonzero())
            for got, want in zip(out, alone[p_idx]):
                assert torch.equal(got[pos], want[0]), (m, int(probe[p_idx]), pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_h", [None, 64])  # one step over H = 256 (the default 1024), or four
def test_hc_pre_with_the_sublayer_norm(dtype, block_h):
    """``norm``: the collapsed rows come back RMS-normalised by the gate launch. post and comb are the plain
    launch's bit for bit; the rows are the RMSNorm of the plain launch's rows within the norm's own
    rounding (one spacing of the stream dtype: Σx² is summed in another order); a row's bits are the same
    alone and in a batch, and at any tokens and warps per program; the oracle op set normalises too."""
    from dsv4.model import norms

    T, n, H = 20, 4, 256
    s, fn, base, scale = _inputs(T, n, H, 31, dtype)
    w = (torch.rand(H, generator=gen(32)) + 0.5).to(DEV)
    cfg = {} if block_h is None else {"NORM_BLOCK_H": block_h}
    col, post, comb = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    ncol, npost, ncomb = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, w, config=cfg)
    assert torch.equal(npost, post) and torch.equal(ncomb, comb) and ncol.dtype == dtype
    want = norms.rms_norm(col, w, RMS_EPS).float()
    spacing = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-21
    assert ((ncol.float() - want).abs() <= spacing * want.abs() + 1e-30).all()
    for r in (0, 7, 19):
        alone = tm.hc_pre(s[r : r + 1], fn, base, scale, ITERS, HC_EPS, RMS_EPS, w, config=cfg)[0]
        assert torch.equal(alone[0], ncol[r]), r
    other = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, w,
                      config=dict(cfg, NORM_GATE_BLOCK_T=4, NORM_GATE_WARPS=1))[0]
    assert torch.equal(other, ncol)
    o_col = reference_ops().mhc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)[0]
    o_ncol = reference_ops().mhc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, w)[0]
    assert torch.equal(o_ncol, norms.rms_norm(o_col, w, RMS_EPS))
    with pytest.raises(ValueError, match="norm"):
        tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, w[:-1])


@pytest.mark.parametrize("n,H,block_h", [(4, 256, None), (3, 256, 64), pytest.param(
    4, 4096, None, marks=pytest.mark.skipif(DEV == "cpu", reason="Flash's rows: compiled only (~12 s interpreted)"))])
def test_collapse_rows_form_bitwise_equals_the_loop_form(monkeypatch, n, H, block_h):
    """With the norm and bf16 streams, the collapse in whole rows (``_collapse_rows_kernel``: every load issued
    first, the rows kept in registers) gives the loop form's bits: the same products and sums in the same order (no
    MMA in either, so under the interpreter too). Flash's shape (n = 4, H = 4096) takes it; fp32 streams and a config
    whose rows exceed NORM_ROWS_MAX_VALUES keep the loop form."""
    calls = spy_launches(monkeypatch, tm, "_collapse_rows_kernel")
    cfg = {"NORM_ROWS": True} if block_h is None else {"NORM_ROWS": True, "NORM_BLOCK_H": block_h}
    w = (torch.rand(H, generator=gen(41)) + 0.5).to(DEV)
    for T in ((1, 2) if H > 256 else (1, 5)):
        s, fn, base, scale = _inputs(T, n, H, 40 + T, torch.bfloat16)
        rows = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, w, config=cfg)
        assert calls, "the rows form did not run"
        loop = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, w, config=dict(cfg, NORM_ROWS=False))
        for name, a, b in zip(("collapsed", "post", "comb"), rows, loop):
            assert torch.equal(a, b), (T, name, (a.double() - b.double()).abs().max().item())
    calls.clear()
    tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, w, config=dict(cfg, NORM_ROWS_MAX_VALUES=n * 64 - 1))
    tm.hc_pre(*_inputs(2, n, H, 43, torch.float32), ITERS, HC_EPS, RMS_EPS, w, config=cfg)
    assert not calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_post_matches_oracle_and_is_batch_invariant(dtype):
    """The kernel rounds as the oracle does (post, comb, post·out and the i-sum each to the stream
    dtype, the final add in it). Per side, against exact arithmetic on the rounded post/comb: the
    i-sum is off by ≤ 4·u32·Σ|c_i R_i| (4 products and 3 adds in fp32, any order), each rounding
    to the stream dtype by ≤ u_dt of its value; so |kernel − oracle| ≤ 2·(4·u32 + u_dt)·terms +
    2·u_dt·|y| with terms = |post·out| + Σ_i|comb_ij R_i| (u = unit roundoff: 2^-24 fp32, 2^-8 bf16).
    Measured: bf16 bitwise equal, fp32 max 9.5e-7 (the CPU bmm sums in another order)."""
    T, n, H = 64, 4, 256
    s, fn, base, scale = _inputs(T, n, H, 30, dtype)
    _, post, comb = reference_ops().mhc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    out = (torch.randn(T, H, generator=gen(31)) * 2).to(dtype).to(DEV)
    y = tm.hc_post(s, out, post, comb)
    o = ref.hc_post(s, out, post, comb)
    assert y.dtype == dtype and y.shape == (T, n, H)
    terms = post.abs().unsqueeze(-1) * out.float().abs().unsqueeze(-2) + torch.matmul(
        comb.abs().transpose(-1, -2), s.float().abs()
    )
    u32, u = HALF_SPACING[torch.float32], HALF_SPACING[dtype]
    lim = 2 * (4 * u32 + u) * terms + 2 * u * o.float().abs() + 1e-30
    d = (y.float() - o.float()).abs()
    print(
        f"\n{dtype} hc_post: max |kernel-oracle| {d.max().item():.3g}, "
        f"{int((y != o).sum())} of {y.numel()} differ, max diff/limit {(d / lim).max().item():.3g}"
    )
    assert bool((d <= lim).all())
    for m, rows in ((1, [7]), (3, [40, 7, 2]), (8, list(range(30, 38))), (64, list(range(63, -1, -1)))):
        idx = torch.tensor(rows, device=s.device)
        part = tm.hc_post(s[idx], out[idx], post[idx], comb[idx])
        assert torch.equal(part, y[idx]), m


def test_registry_and_errors():
    assert resolve("mhc_pre", force="mhc=torch")[1] is reference_ops().mhc_pre
    assert resolve("mhc_post", force={"mhc_post": "triton"})[1] is tm.hc_post
    s, fn, base, scale = _inputs(2, 4, 64, 1, torch.float32)
    with pytest.raises(ValueError, match="fn must be"):
        tm.hc_pre(s, fn[:, :-1], base, scale, ITERS, HC_EPS, RMS_EPS)
    with pytest.raises(TypeError, match="out dtype"):
        tm.hc_post(
            s, s[:, 0].to(torch.bfloat16), torch.ones(2, 4, device=s.device), torch.ones(2, 4, 4, device=s.device)
        )
    empty = tm.hc_pre(s[:0], fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    assert [tuple(t.shape) for t in empty] == [(0, 64), (0, 4), (0, 4, 4)]


@triton.jit
def _split_probe(parts_ptr, out_ptr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """out = f · I through ``_mix_dot``'s bf16x3 path on f's parts: each output is (0 + lo) + mid + hi."""
    r = tl.arange(0, BLOCK)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    ok = r < BLOCK
    acc = tm._mix_dot(parts_ptr, r, r, ok, ok, BLOCK, BLOCK * BLOCK, eye, tl.zeros((BLOCK, BLOCK), dtype=tl.float32),
                      True, INTERP)
    tl.store(out_ptr + r[:, None] * BLOCK + r[None, :], acc)


def test_mix_dot_bf16x3_split_is_exact():
    """The three bf16 parts of every fp32 value (``fn_parts``) sum back to it exactly (so a bf16 x times them
    loses nothing), and the kernel's three dots give it back: values of every sign and of magnitudes
    2^-40..2^40, full 24-bit mantissas; the parts' padding rows are zero."""
    g = gen(77)
    b = 32
    mant = 1.0 + torch.randint(0, 1 << 23, (b, b), generator=g).double() / (1 << 23)
    f = (
        mant
        * torch.exp2(torch.randint(-40, 41, (b, b), generator=g).double())
        * torch.where(torch.rand(b, b, generator=g) < 0.5, -1.0, 1.0)
    ).float()
    f[0, :4] = torch.tensor([0.0, -0.0, 1.0, -(2.0**-30)])
    parts = tm.fn_parts(f[: b - 1])  # 31 rows: padded to 32 (+ the Σx² column's row)
    assert parts.shape == (3, b, b) and parts.dtype == torch.bfloat16 and not parts[:, b - 1].any()
    assert torch.equal(parts.double().sum(0)[: b - 1], f[: b - 1].double())
    parts = tm.fn_parts(f)[:, :b]  # 32 rows: 64 with the padding; the probe reads the first 32
    out = torch.empty_like(f, device=DEV)
    _split_probe[(1,)](parts.to(DEV).contiguous(), out, BLOCK=b, INTERP=interpreting(), num_warps=4)
    assert torch.equal(out.cpu(), f), (out.cpu() - f).abs().max()


@pytest.mark.parametrize("bf16x3", [True, False])
def test_hc_pre_bf16_streams_both_mix_dots(bf16x3):
    """bf16 streams through the tensor-core mixes (default) and the fp32 FMA dot (``MIX_BF16X3`` off):
    both within the oracle bound of ``test_hc_pre_matches_oracle`` for post and comb."""
    T, n, H = 16, 4, 256
    s, fn, base, scale = _inputs(T, n, H, 31, torch.bfloat16, peaked=True)
    col, post, comb = tm.hc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS, config={"MIX_BF16X3": bf16x3})
    o_col, o_post, o_comb = reference_ops().mhc_pre(s, fn, base, scale, ITERS, HC_EPS, RMS_EPS)
    e_pre, e_post, e_comb, e_col = _exact(s, fn, base, scale)
    seq = dict(zip(("post", "comb"), _sequential_bounds(s, fn, scale)))
    for name, k, o, e in (("post", post, o_post, e_post), ("comb", comb, o_comb, e_comb)):
        assert _max(k, e) <= max(2 * _max(o, e) + 2 * ULP1, seq[name]), (name, _max(k, e), _max(o, e))
