"""The fused SwiGLU activation ``swiglu_act`` (Triton) vs its torch backend, bitwise.

The torch backend is the oracle's expression (``dsv4.model.moe.swiglu_act``): clamps in fp32, silu and
product in float64, rounded to the output dtype. Inputs are fresh random values with rows of very
different scales, values past ±limit, NaN, ±inf, large negatives (silu → -0 or NaN) and signed zeros.
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, assert_bits_equal, gen  # noqa: E402

from dsv4.model import moe  # noqa: E402
from dsv4.model.opset import OpSet, reference_ops  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import activation as tact  # noqa: E402

LIMIT = 10.0
SPECIAL = [float("nan"), float("inf"), -float("inf"), -1e30, -3e38, 3e38, -800.0, -745.2, -709.9, -40.0, -17.5,
           LIMIT, -LIMIT, LIMIT * (1 + 2 ** -20), -LIMIT * (1 + 2 ** -20), 1e-40, -1e-40, 0.0, -0.0, 1e6, -1e6]


def _values(shape, g, dtype):
    """Random pre-activations: per-row scales from 2^-6 to 2^6 (so many exceed ±limit), with the
    special values scattered in."""
    t, n = shape
    x = torch.randn(t, n, generator=g) * torch.exp2(torch.randint(-6, 7, (t, 1), generator=g).float())
    flat = x.view(-1)
    where = torch.randperm(flat.numel(), generator=g)[: 3 * len(SPECIAL)]
    flat[where] = torch.tensor(SPECIAL * 3)
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [1, 2])
def test_swiglu_act_bitwise(dtype, seed):
    g = gen(seed)
    shape = (37, 300)  # not a multiple of the kernel's block
    gate, up = _values(shape, g, dtype), _values(shape, g, dtype)
    limit = float(torch.empty(1).uniform_(2.0, 12.0, generator=g)) if seed == 2 else LIMIT
    want = moe.swiglu_act(gate, up, limit, dtype)
    got = tact.swiglu_act(gate, up, limit, dtype)
    assert_bits_equal(got, want)
    assert bool(torch.isnan(want).any()) and bool((want.view(-1) == 0).any())  # the special values got through


def test_swiglu_act_mixed_dtypes_and_empty():
    """fp32 projections rounded to a bf16 output (a weight dtype other than x's), and an empty batch."""
    g = gen(3)
    gate, up = _values((5, 64), g, torch.float32), _values((5, 64), g, torch.bfloat16)
    assert_bits_equal(tact.swiglu_act(gate, up, LIMIT, torch.bfloat16), moe.swiglu_act(gate, up, LIMIT, torch.bfloat16))
    e = torch.empty(0, 64, device=DEV)
    assert tact.swiglu_act(e, e, LIMIT, torch.float32).shape == (0, 64)
    with pytest.raises(ValueError, match="shape"):
        tact.swiglu_act(gate, up[:, :32], LIMIT, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_uses_the_kernel_when_active(dtype):
    """The SwiGLU of an op set with the ``swiglu_act`` kernel (the fast forward's) gives the oracle's
    output bitwise; the registry resolves the op to these two functions."""
    assert resolve("swiglu_act", force={"swiglu_act": "torch"})[1] is moe.swiglu_act
    name, fn = resolve("swiglu_act", force={"swiglu_act": "triton"})
    assert name == "triton" and fn is tact.swiglu_act
    g = gen(4)
    x = (torch.randn(9, 64, generator=g) * 4).to(dtype).to(DEV)
    w1, w3, w2 = ((torch.randn(n, k, generator=g) * 0.3).to(dtype).to(DEV) for n, k in ((96, 64), (96, 64), (64, 96)))
    calls = []

    def spy(*a):
        calls.append(1)
        return fn(*a)

    want = reference_ops().swiglu(x, w1, w3, w2, 3.0)
    got = OpSet({"swiglu_act": spy}).swiglu(x, w1, w3, w2, 3.0)
    assert calls == [1]
    assert_bits_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_act_reads_column_halves_in_place(dtype):
    """gate and up as the two column halves of one [T, 2C] tensor (the shared expert's stacked GEMM): read
    with their row stride, no copy, the bits of the contiguous inputs; 3-D inputs too."""
    g = gen(5)
    both = torch.cat([_values((11, 300), g, dtype), _values((11, 300), g, dtype)], dim=1)
    gate, up = both.split([300, 300], dim=1)
    assert not gate.is_contiguous() and tact._rows(gate).data_ptr() == gate.data_ptr()
    assert tact._rows(up).data_ptr() == up.data_ptr()
    got = tact.swiglu_act(gate, up, LIMIT, dtype)
    assert got.is_contiguous()
    assert_bits_equal(got, moe.swiglu_act(gate.contiguous(), up.contiguous(), LIMIT, dtype))
    g3, u3 = gate.view(11, 1, 300), up.view(11, 1, 300)
    assert_bits_equal(tact.swiglu_act(g3, u3, LIMIT, dtype), got.view(11, 1, 300))
