"""fp8_ds_mla records: exact bytes, the block-packed page layout and reader/writer agreement."""
import math

import pytest
import torch

from dsv4.formats import (
    FNUZ,
    OCP,
    alloc_kv_pages,
    dequantize_kv,
    fake_quant_kv,
    page_bytes,
    page_stride,
    quantize_kv,
    read_kv,
    read_kv_raw,
    write_kv,
)
from dsv4.formats import kv_record as kr

FMTS = [OCP, FNUZ]
BIAS = {"ocp": 7, "fnuz": 8}


def test_constants_and_strides():
    assert (kr.KV_DIM, kr.NOPE_DIM, kr.ROPE_DIM, kr.TILE, kr.N_TILES) == (512, 448, 64, 64, 7)
    assert (kr.DATA_BYTES, kr.SCALE_BYTES, kr.RECORD_BYTES, kr.PAGE_ALIGN) == (576, 8, 584, 576)
    assert page_bytes(64) == 37376 and page_stride(64) == 37440
    assert page_bytes(2) == 1168 and page_stride(2) == 1728


def test_alloc_kv_pages():
    p = alloc_kv_pages(3, 64)
    assert p.shape == (3, 37376) and p.stride() == (37440, 1) and p.dtype == torch.uint8
    assert int(p.sum()) == 0
    q = alloc_kv_pages(3, 2, stride=5000)
    assert q.shape == (3, 1168) and q.stride(0) == 5000
    with pytest.raises(ValueError):
        alloc_kv_pages(2, 64, stride=1000)


def _hand_vector():
    x = torch.zeros(512)
    x[0], x[1], x[2] = 448.0, 1.0, -448.0               # tile 0: amax 448 -> e 0
    #                                                      tile 1: zeros -> amax 1e-4 -> e -22
    x[128], x[129], x[130] = 1.0, 0.5, -0.25             # tile 2: amax 1 -> e -8
    x[192], x[193] = 449.0, 224.5                        # tile 3: amax 449 -> e 1
    x[256], x[257], x[258] = 3.0, 1.0625 / 128, 1.1875 / 128  # tile 4: e -7, two RNE ties
    x[320], x[321], x[322], x[323], x[324] = 448.0, 2**-9, 2**-10, -2**-9, 3 * 2**-10  # subnormals
    x[384], x[385] = -7.0, 7.0 / 64                      # tile 6: 7/448 = 2^-6 exactly -> e -6
    x[448], x[449], x[450], x[451] = 1.0, -2.0, 1 + 2**-8, math.pi
    return x


def test_hand_computed_record_ocp():
    data, scale = quantize_kv(_hand_vector()[None], OCP)
    assert data.shape == (1, 576) and scale.shape == (1, 8)
    assert data.dtype == scale.dtype == torch.uint8
    assert scale[0].tolist() == [127, 105, 119, 128, 120, 127, 121, 0]
    want = torch.zeros(448, dtype=torch.uint8)
    for i, c in {0: 0x7E, 1: 0x38, 2: 0xFE, 128: 0x78, 129: 0x70, 130: 0xE8, 192: 0x76, 193: 0x6E,
                 256: 0x7C, 257: 0x38, 258: 0x3A, 320: 0x7E, 321: 0x01, 322: 0x00, 323: 0x81,
                 324: 0x02, 384: 0xFE, 385: 0x4E}.items():
        want[i] = c
    assert torch.equal(data[0, :448], want)
    rope = [0x80, 0x3F, 0x00, 0xC0, 0x80, 0x3F, 0x49, 0x40] + [0] * 120
    assert data[0, 448:].tolist() == rope
    y = dequantize_kv(data, scale, OCP)[0]
    assert y[192].item() == 448.0 and y[193].item() == 224.0 and y[257].item() == 1 / 128
    assert y[258].item() == 1.25 / 128 and y[322].item() == 0.0 and y[451].item() == 3.140625


def test_hand_computed_record_fnuz():
    x = torch.zeros(512)
    x[0], x[1], x[2], x[3] = 224.0, 1.0, -1.0, -0.0
    # tile 1: amax 225 > 224 -> e 1; 225/2 = 112.5 ties 112 (mantissa 6, even) and 120 -> 112
    x[64], x[65], x[66] = 225.0, 112.0, -225.0
    data, scale = quantize_kv(x[None], FNUZ)
    assert scale[0, :2].tolist() == [127, 128]
    assert data[0, :4].tolist() == [0x7E, 0x40, 0xC0, 0x00]  # 224, 1, -1, -0 (FNUZ has no -0)
    assert data[0, 64:67].tolist() == [0x76, 0x6E, 0xF6]


def _ulp_bound(x, scale, fmt):
    """Half the fp8 grid spacing at |x|/scale, in x units."""
    _, e = torch.frexp((x / scale).abs())
    step_exp = torch.clamp(e - 1, min=1 - BIAS[fmt.name]) - 3
    return torch.ldexp(torch.full_like(x, 0.5), step_exp) * scale


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_fake_quant_error_within_half_ulp(fmt):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 512, generator=g)
    x[:, :448] *= torch.exp2(torch.randint(-15, 15, (32, 7), generator=g).float()).repeat_interleave(64, -1)
    data, scale = quantize_kv(x, fmt)
    y = fake_quant_kv(x, fmt)
    s = torch.exp2(scale[:, :7].float() - 127).repeat_interleave(64, -1)
    assert torch.all((x[:, :448] / s).abs() <= fmt.quant_max)
    assert torch.all((y[:, :448] - x[:, :448]).abs() <= _ulp_bound(x[:, :448], s, fmt))
    assert torch.equal(y[:, 448:], x[:, 448:].to(torch.bfloat16).float())
    assert torch.all(scale[:, 7] == 0)
    rb = fake_quant_kv(x, fmt, round_bf16=True)
    assert torch.equal(rb, fake_quant_kv(x.to(torch.bfloat16).float(), fmt))


def _fill(fmt, block_size=16, num_blocks=5, extra=1000, seed=5):
    g = torch.Generator().manual_seed(seed)
    stride = page_stride(block_size) + extra
    pages = alloc_kv_pages(num_blocks, block_size, stride=stride)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:40]
    b, o = slots // block_size, slots % block_size
    b = torch.cat([b, torch.tensor([-1, -1])])
    o = torch.cat([o, torch.tensor([3, -1])])
    x = torch.randn(42, 512, generator=g) * 4
    write_kv(pages, b, o, x, fmt, block_size)
    return pages, b, o, x, stride


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_write_read_roundtrip_through_larger_stride(fmt):
    bs = 16
    pages, b, o, x, stride = _fill(fmt, bs)
    assert pages.stride(0) == stride
    y = read_kv(pages, b, o, fmt, bs)
    assert torch.equal(y[:40], fake_quant_kv(x[:40], fmt))
    assert torch.all(y[40:] == 0)  # padding slots read as zeros
    # the bytes sit at the page-layout addresses of the flat buffer
    flat = pages.as_strided((pages.untyped_storage().nbytes(),), (1,), 0)
    data, scale = quantize_kv(x[:40], fmt)
    for t in range(0, 40, 7):
        base = int(b[t]) * stride
        d0, s0 = base + int(o[t]) * 576, base + bs * 576 + int(o[t]) * 8
        assert torch.equal(flat[d0:d0 + 576], data[t])
        assert torch.equal(flat[s0:s0 + 8], scale[t])
    # nothing spilled into the gap between a page's end and the next block
    gaps = torch.stack([flat[i * stride + page_bytes(bs):(i + 1) * stride] for i in range(5)])
    assert int(gaps.sum()) == 0
    raw = read_kv_raw(pages, b, o, fmt, bs)
    assert torch.equal(raw[0][:40], data) and torch.equal(raw[1][:40], scale)
    assert torch.equal(read_kv_raw(pages, b, o, block_size=bs)[0], raw[0])


def test_write_rejects_offset_past_the_page():
    pages = alloc_kv_pages(2, 4)
    with pytest.raises(IndexError):
        write_kv(pages, torch.tensor([0]), torch.tensor([4]), torch.randn(1, 512), OCP, 4)


def _naive_read(pages, b, o, fmt):
    """The seed bug: 584 contiguous bytes per token, data row then scale row."""
    rec = torch.stack([pages[int(bi), int(oi) * 584:int(oi) * 584 + 584] for bi, oi in zip(b, o)])
    return dequantize_kv(rec[:, :576], rec[:, 576:], fmt)


def test_naive_interleaved_reader_is_wrong():
    bs = 64
    pages = alloc_kv_pages(2, bs)
    b = torch.tensor([1] * bs)
    o = torch.arange(bs)
    x = torch.randn(bs, 512)
    write_kv(pages, b, o, x, OCP, bs)
    good = read_kv(pages, b, o, OCP, bs)
    bad = _naive_read(pages, b, o, OCP)
    assert torch.equal(good, fake_quant_kv(x, OCP))
    nope_err = (bad[:, :448] - x[:, :448]).abs().amax(-1) / x[:, :448].abs().amax(-1)
    assert torch.all(~torch.isfinite(nope_err) | (nope_err > 0.5)), "every token must be wrong"


def test_fnuz_pages_read_as_ocp_are_detected():
    pages, b, o, x, _ = _fill(FNUZ, 16)
    x = x[:40, :448]
    good = read_kv(pages, b, o, FNUZ, 16)[:40, :448]
    wrong = read_kv(pages, b, o, OCP, 16)[:40, :448]
    rel = lambda y: float((y - x).norm() / x.norm())  # noqa: E731
    assert rel(good) < 0.05
    assert rel(wrong) > 0.5  # FNUZ codes read as OCP are ~2x too large
