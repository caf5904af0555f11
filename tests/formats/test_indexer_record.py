"""Indexer K records: 128 FP8 codes + fp32 power-of-two scale, values-then-scales pages."""
import pytest
import torch

from dsv4.formats import (
    FNUZ,
    OCP,
    alloc_indexer_pages,
    decode_fp8,
    fake_quant_indexer_k,
    indexer_page_stride,
    pow2_scale_exponent,
    quantize_indexer_k,
    read_indexer_k,
    write_indexer_k,
)
from dsv4.formats import kv_record as kr

FMTS = [OCP, FNUZ]


def test_constants_and_alloc():
    assert (kr.INDEXER_DIM, kr.INDEXER_VALUE_BYTES, kr.INDEXER_SCALE_BYTES,
            kr.INDEXER_RECORD_BYTES) == (128, 128, 4, 132)
    assert indexer_page_stride(64) == 8640
    p = alloc_indexer_pages(3, 64, "cpu")
    assert p.shape == (3, 8448) and p.stride(0) == 8640 and int(p.sum()) == 0


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_quantize_indexer_k(fmt):
    x = torch.randn(10, 128) * torch.exp2(torch.randint(-6, 6, (10, 1)).float())
    codes, scale = quantize_indexer_k(x, fmt)
    assert codes.shape == (10, 128) and codes.dtype == torch.uint8
    assert scale.shape == (10,) and scale.dtype == torch.float32
    e = pow2_scale_exponent(x.abs().amax(-1), fmt.quant_max)
    assert torch.equal(scale, torch.exp2(e.float()))
    y = fake_quant_indexer_k(x, fmt)
    assert torch.equal(y, decode_fp8(codes, fmt) * scale[:, None])
    assert torch.all((y - x).abs() <= x.abs() * 2.0 ** -4 + scale[:, None] * 2.0 ** -10)


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_write_read_roundtrip_and_page_layout(fmt):
    bs, nb = 64, 3
    stride = indexer_page_stride(bs) + 576
    pages = alloc_indexer_pages(nb, bs, stride=stride)
    slots = torch.randperm(nb * bs)[:50]
    b = torch.cat([slots // bs, torch.tensor([-1])])
    o = torch.cat([slots % bs, torch.tensor([0])])
    x = torch.randn(51, 128)
    write_indexer_k(pages, b, o, x, fmt, bs)
    codes, scale = quantize_indexer_k(x[:50], fmt)
    vals, rc, rs = read_indexer_k(pages, b, o, fmt, bs)
    assert torch.equal(rc[:50], codes) and torch.equal(rs[:50], scale)
    assert torch.equal(vals[:50], fake_quant_indexer_k(x[:50], fmt))
    assert torch.all(vals[50] == 0) and rs[50].item() == 0.0
    for t in range(0, 50, 9):
        bi, oi = int(b[t]), int(o[t])
        assert torch.equal(pages[bi, oi * 128:(oi + 1) * 128], codes[t])
        s = pages[bi, bs * 128 + oi * 4:bs * 128 + oi * 4 + 4].clone().view(torch.float32)
        assert s.item() == scale[t].item()
    flat = pages.as_strided((pages.untyped_storage().nbytes(),), (1,), 0)
    gaps = torch.stack([flat[i * stride + bs * 132:(i + 1) * stride] for i in range(nb)])
    assert int(gaps.sum()) == 0


def test_fnuz_is_ocp_with_doubled_scale():
    # FNUZ values are OCP values halved (bias 8 vs 7) and quant_max halves (224 vs 448), so the
    # codes coincide and only the scale doubles; the scale is what tells the formats apart.
    x = torch.randn(4, 128)
    x[x.abs() < 1e-3] = 0.5  # avoid tiny negatives (OCP keeps -0 as 0x80, FNUZ has no -0)
    (co, so), (cf, sf) = quantize_indexer_k(x, OCP), quantize_indexer_k(x, FNUZ)
    assert torch.equal(co, cf) and torch.equal(sf, 2 * so)
