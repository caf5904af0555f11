"""The indexer query op ``indexer_q_rope_quant`` (RoPE + FP8 fake-quant in one launch) vs its torch
backend (``apply_rope`` then ``fake_quant_fp8_pow2`` of the bf16-rounded q), bitwise.

Fresh random q with rows of very different scales, positions up to ~1e6 (any angle), bf16 and fp32 q,
OCP and FNUZ and no quantization; special rows: all zero, signed zeros, values that overflow the rope
(inf after rounding: the FP8 codes saturate), ±inf and NaN, tiny (subnormal) values.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, assert_bits_equal, gen  # noqa: E402

from dsv4.config import RopeParams  # noqa: E402
from dsv4.formats import FNUZ, OCP  # noqa: E402
from dsv4.model.rope import cos_sin  # noqa: E402
from dsv4.ops import torch_indexer  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import indexer_q as tiq  # noqa: E402

H, D, R = 4, 128, 64
ROPE = RopeParams(theta=10000.0, dim=R)


def _q(t, g, dtype, special=True):
    x = torch.randn(t, H, D, generator=g) * torch.exp2(torch.randint(-20, 21, (t, H, 1), generator=g).float())
    if special:
        x[0, 0] = 0.0  # a zero row: amax floored at 1e-4
        x[0, 1, ::3] = -0.0
        x[1, 0, -R:] *= 3e38 / x[1, 0, -R:].abs().max()  # the rope overflows: inf → saturated codes
        x[1, 1, 5] = float("inf")  # inf in the NoPE part
        x[1, 2, 7] = -float("inf")
        x[1, 2, -3] = float("inf")  # inf in a rope pair: NaN after the rotation
        x[1, 3, 9] = float("nan")  # a NaN row
        x[2, 0] = torch.randn(D, generator=g) * 1e-39  # subnormal
        x[2, 1, :64] = 1e4  # a constant block at a power-of-two boundary
        x[2, 1, 64:] = 448.0 * 2.0 ** -3
        x[2, 2, 0] = 448.0 * 2.0 ** -3  # amax exactly quant_max · 2^k (OCP, then FNUZ): no rounding up of e
        x[2, 3, 0] = -224.0 * 2.0 ** 5
        x[3, 0] = torch.exp2(torch.linspace(-24, 0, D)) * torch.sign(torch.randn(D, generator=g))  # FP8 subnormals
    return x.to(dtype).to(DEV)


def _positions(t, g):
    p = torch.randint(0, 5000, (t,), generator=g)
    p[0] = 0
    p[1] = 1_000_000
    return p.to(DEV)


@pytest.mark.parametrize("fmt", [None, OCP, FNUZ], ids=["none", "ocp", "fnuz"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_q_rope_quant_bitwise(dtype, fmt):
    g = gen(11 if fmt is None else 12)
    t = 9
    q = _q(t, g, dtype)
    cos, sin = cos_sin(ROPE, _positions(t, g))
    want = torch_indexer.indexer_q_rope_quant(q, cos, sin, fmt)
    got = tiq.indexer_q_rope_quant(q, cos, sin, fmt)
    assert_bits_equal(got, want)
    assert want.dtype == torch.float32 and bool(torch.isnan(want[1, 3]).any())
    if fmt is not None:
        # inf saturates to the ±max code, scaled by 2^120 (OCP) / 2^121 (FNUZ): that overflows to inf again
        assert want[1, 1, 5] == float("inf") and want[1, 2, 7] == -float("inf")
        assert torch.equal(want[0, 0], torch.zeros(D, device=DEV))


def test_indexer_q_strided_rope_width_and_fmt_names():
    """A non-contiguous q (a view of a wider projection), a narrower rope, format names, an empty batch."""
    g = gen(13)
    t = 5
    wide = _q(t, g, torch.bfloat16, special=False).reshape(t, H * D)
    wide = torch.cat([wide, wide[:, :D]], dim=1)
    q = wide[:, D:].view(t, H, D)
    assert not q.is_contiguous()
    cos, sin = cos_sin(RopeParams(theta=10000.0, dim=32), _positions(t, g))
    for fmt in (None, "ocp", "fnuz"):
        assert_bits_equal(tiq.indexer_q_rope_quant(q, cos, sin, fmt),
                          torch_indexer.indexer_q_rope_quant(q, cos, sin, fmt))
    e = torch.empty(0, H, D, device=DEV)
    assert tiq.indexer_q_rope_quant(e, cos[:0], sin[:0], OCP).shape == (0, H, D)


def test_indexer_q_registry():
    assert resolve("indexer_q_rope_quant", force={"indexer_q_rope_quant": "torch"})[1] is \
        torch_indexer.indexer_q_rope_quant
    assert resolve("indexer_q_rope_quant", force={"indexer_q_rope_quant": "triton"})[1] is tiq.indexer_q_rope_quant
