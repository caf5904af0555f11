"""Triton ``apply_rope`` and ``unit_norm_rope`` vs the torch code they replace, bitwise.

``apply_rope``'s reference is ``dsv4.model.rope.apply_rope`` with no kernel active (the oracle);
``unit_norm_rope``'s is the unfused GPU path: the Triton ``unit_rms_norm`` then the torch rotation.
Inputs are fresh random rows of very different scales, with zeros, signed zeros and infinities,
rotated by tables of large positions (so cos/sin take every sign and many exponents).
"""

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

from dsv4.config import RopeParams  # noqa: E402
from dsv4.model import rope as mrope  # noqa: E402
from dsv4.model.opset import OpSet  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import dense as td  # noqa: E402
from dsv4.ops.triton import rope as tr  # noqa: E402

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _x(shape, g, dtype, specials=True):
    t = shape[0]
    scale = torch.exp2(torch.randint(-6, 7, (t,) + (1,) * (len(shape) - 1), generator=g).float())
    x = torch.randn(shape, generator=g) * scale
    if specials and t > 2:
        x[0] = 0.0
        x[1, ..., -2] = -0.0
        x[2, ..., -1] = float("inf")
    return x.to(dtype)


def _tables(t, g, rd=64):
    pos = torch.randint(0, 1 << 20, (t,), generator=g)
    pos[0] = 0
    return mrope.cos_sin(RopeParams(theta=10000.0, dim=rd), pos)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 3, 128), (5, 512), (4, 17, 96)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_is_the_torch_rotation_bitwise(dtype, shape, inverse):
    g = gen(hash((str(dtype), shape, inverse)) % 10_000)
    x = _x(shape, g, dtype)
    cos, sin = _tables(shape[0], g)
    ref = mrope.apply_rope(x, cos, sin, inverse=inverse)
    xd, cd, sd = x.to(DEV), cos.to(DEV), sin.to(DEV)
    y = tr.apply_rope(xd, cd, sd, inverse)
    _same(y, ref)
    assert torch.equal(xd.cpu(), x), "out of place: x must be left as it was"
    xi = xd.clone()
    yi = tr.apply_rope(xi, cd, sd, inverse, in_place=True)
    assert yi.data_ptr() == xi.data_ptr(), "in place: the rotation is written into x"
    _same(yi, ref)


def test_apply_rope_in_place_on_a_strided_view_leaves_the_base_alone():
    g = gen(3)
    base = _x((6, 4, 256), g, torch.bfloat16, specials=False).to(DEV)
    keep = base.clone()
    view = base[:, :, :128]  # not contiguous: the kernel must return a new tensor
    cos, sin = _tables(6, g)
    y = tr.apply_rope(view, cos.to(DEV), sin.to(DEV), in_place=True)
    _same(y, mrope.apply_rope(view.cpu(), cos, sin))
    assert torch.equal(base, keep)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 4, 512), (3, 2, 128), (9, 64), (5, 3, 96)])
def test_unit_norm_rope_is_the_unfused_gpu_path_bitwise(dtype, shape):
    g = gen(hash((str(dtype), shape)) % 10_000)
    x = _x(shape, g, dtype, specials=False)
    x[0] = 0.0  # a zero row: the statistic is eps alone
    cos, sin = _tables(shape[0], g)
    xd, cd, sd = x.to(DEV), cos.to(DEV), sin.to(DEV)
    ref = OpSet({"unit_rms_norm": td.unit_rms_norm}).unit_norm_rope(xd, cd, sd, EPS)
    _same(tr.unit_norm_rope(xd, cd, sd, EPS), ref)
    assert torch.equal(xd.cpu(), x)


def test_an_op_set_dispatches_to_its_kernels():
    g = gen(11)
    x = _x((4, 2, 128), g, torch.float32, specials=False)
    cos, sin = _tables(4, g)
    calls = []

    def spy(name, fn):
        def f(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return f

    ops = OpSet(
        {"apply_rope": spy("apply_rope", tr.apply_rope), "unit_norm_rope": spy("unit_norm_rope", tr.unit_norm_rope)}
    )
    ops.apply_rope(x.to(DEV), cos.to(DEV), sin.to(DEV), inverse=True, in_place=True)
    ops.unit_norm_rope(x.to(DEV), cos.to(DEV), sin.to(DEV), EPS)
    assert calls == ["apply_rope", "unit_norm_rope"]


def test_registry_offers_both_backends():
    assert resolve("apply_rope", force={"apply_rope": "torch"})[1] is mrope.apply_rope
    assert resolve("unit_norm_rope", force={"unit_norm_rope": "triton"})[1] is tr.unit_norm_rope


def test_bad_tables_name_the_argument():
    x = torch.zeros(3, 2, 128, device=DEV)
    cos, sin = _tables(3, gen(0))
    with pytest.raises(ValueError, match="cos must be"):
        tr.apply_rope(x, cos[:2].to(DEV), sin.to(DEV))
    with pytest.raises(TypeError, match="sin must be float32"):
        tr.unit_norm_rope(x, cos.to(DEV), sin.double().to(DEV), EPS)


def test_model_forward_with_the_rope_kernels_is_bitwise_the_unfused_fast_path(tiny_ckpt):
    """ReferenceModel (tiny, bf16) on the Triton unit_rms_norm: adding the rope kernels (the query's
    fused norm + rotation, the output's in-place inverse rotation, the compressor's and indexer's
    rotations) leaves the logits and the hooks' tensors bitwise the same. With hooks installed the
    output rotation is not done in place (a hook may keep the attention output)."""
    from dsv4.model.model import ReferenceModel
    from dsv4.model.step import SeqChunk

    weights = ReferenceModel(tiny_ckpt, dtype=torch.bfloat16, device=DEV).w
    ids = torch.randint(2, weights.config.vocab_size, (9,), generator=gen(2)).to(DEV)
    calls = []

    def spy(fn):
        def f(*a, **k):
            calls.append(fn.__name__)
            return fn(*a, **k)

        return f

    runs = {}
    for name, ops in (
        ("pair", {"unit_rms_norm": td.unit_rms_norm}),
        (
            "fused",
            {
                "unit_rms_norm": td.unit_rms_norm,
                "apply_rope": spy(tr.apply_rope),
                "unit_norm_rope": spy(tr.unit_norm_rope),
            },
        ),
    ):
        model = ReferenceModel(weights, ops=OpSet(ops))
        with torch.no_grad():
            plain = model.forward(ids, [SeqChunk(model.new_cache(), 0, len(ids))]).logits
            model.set_hooks(lambda n, t, seen=[]: seen.append(t))
            try:
                hooked = model.forward(ids, [SeqChunk(model.new_cache(), 0, len(ids))]).logits
            finally:
                model.set_hooks(None)
        runs[name] = (plain, hooked)
    layers = model.cfg.num_hidden_layers
    assert calls.count("unit_norm_rope") == 2 * layers
    assert calls.count("apply_rope") >= 2 * layers
    assert torch.equal(runs["pair"][0], runs["fused"][0]) and torch.equal(runs["pair"][1], runs["fused"][1])
    assert torch.equal(runs["fused"][0], runs["fused"][1])
