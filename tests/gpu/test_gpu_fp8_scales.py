"""The FP8 linear reads UE8M0 scales as their fp32 values (``fp8_linear.FP32_SCALES``, a load Triton pipelines):
compiled on the GPU, every launch form gives the bits of the byte-scale kernel, at the release's projection shapes
(wq_b, the grouped wo_a, wo_b, [wq_a; wkv], the shared expert's w1 and w2) and at decode, mid and long-prefill
sizes."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {  # name: (N, K per group, groups)
    "wq_b": (32768, 1024, 1),
    "wo_a": (8192, 4096, 8),
    "wo_b": (4096, 8192, 1),
    "wq_a_wkv": (1536, 4096, 1),
    "shared_w1": (2048, 4096, 1),
    "shared_w2": (4096, 2048, 1),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fp32_scales_give_the_byte_scales_bits(monkeypatch, name):
    from dsv4.formats import quantize_block_fp8
    from dsv4.ops.triton import fp8_linear as tfl

    n, k, groups = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(n + k)
    wq, s = quantize_block_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    assert s.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
    bad = []
    for m in (1, 8, 64, 300, 2048):
        x = torch.randn(m, groups * k, device="cuda", generator=g).to(torch.bfloat16)
        got = {}
        for on in (True, False):
            monkeypatch.setattr(tfl, "FP32_SCALES", on)
            got[on] = tfl.fp8_linear(x, wq, s, groups=groups)
        if not torch.equal(got[True], got[False]):
            bad.append(f"M={m}: max |Δ| {(got[True].float() - got[False].float()).abs().max().item():.3g}")
    assert not bad, f"{name}: " + "; ".join(bad)
