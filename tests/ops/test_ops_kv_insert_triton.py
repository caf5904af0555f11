"""Triton KV insert vs the byte codec (``dsv4.formats.write_kv``) and dense index assignment: bitwise.

Pages start as random bytes (padding between pages included), so comparing the whole backing buffer
checks both the written records and that skipped slots (page −1, offset past the page) and every
other byte are left untouched.
"""

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

from dsv4.formats import FNUZ, OCP, alloc_kv_pages, page_stride, write_kv  # noqa: E402
from dsv4.ops import torch_attention  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import kv_insert as tki  # noqa: E402


def _rows(t, g, dtype=torch.float32):
    """KV rows whose 64-tiles span every quantizer regime: ordinary, huge, tiny (amax < 1e-4),
    all-zero, subnormal-code values, exact ties, signed zeros."""
    x = torch.randn(t, 512, generator=g) * torch.exp2(torch.randint(-6, 7, (t, 8, 1), generator=g).float()
                                                       ).repeat_interleave(64, 1).view(t, 8, 64).reshape(t, 512)
    x[0, :64] = 0.0
    x[0, 64:128] = -0.0
    x[1 % t, 128:192] *= 1e-7  # amax below the 1e-4 floor
    x[2 % t, 192:256] *= 3e4  # large exponents
    x[3 % t, 256:320] = torch.tensor([448.0, -448.0, 1.0625, -1.0625 * 2 ** -8, 2.0 ** -9 * 3, 2.0 ** -10,
                                      1.0 + 2 ** -4, 1.0 + 3 * 2 ** -4] * 8)  # exact ties
    x[4 % t, 320:384] = 2.0 ** -8 * torch.randn(64, generator=g)  # a few codes near the subnormal range
    x[5 % t, 448:] = torch.randn(64, generator=g) * 1e3 + 0.123456789  # rope with low bits to round
    return x.to(dtype).to(DEV)


def _pages(n, block_size, g, extra=576):
    pages = alloc_kv_pages(n, block_size, DEV, stride=page_stride(block_size) + extra)
    flat = pages.as_strided((pages.stride(0) * n,), (1,))
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    return pages, flat


def _slots(t, n_pages, block_size, g):
    """Distinct (page, offset) slots, about a quarter of them (and token 1) padding (page −1)."""
    flat = torch.randperm(n_pages * block_size, generator=g)[:t]
    page, off = flat // block_size, flat % block_size
    page[torch.rand(t, generator=g) < 0.25] = -1
    page[min(1, t - 1)] = -1
    return page.to(DEV), off.to(DEV)


@pytest.mark.parametrize("fmt", [OCP, FNUZ], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("round_bf16", [False, True])
@pytest.mark.parametrize("block_size,dtype", [(64, torch.float32), (2, torch.float32), (64, torch.bfloat16)])
def test_kv_insert_bitwise(fmt, round_bf16, block_size, dtype):
    g = gen(zlib.crc32(f"{fmt.name} {round_bf16} {block_size} {dtype}".encode()))
    t = 12
    n = max(4, -(-2 * t // block_size))
    x = _rows(t, g, dtype)
    page, off = _slots(t, n, block_size, g)
    pages_k, flat_k = _pages(n, block_size, g)
    pages_r = torch.empty_like(flat_k).as_strided(pages_k.shape, pages_k.stride())
    flat_r = pages_r.as_strided(flat_k.shape, (1,))
    flat_r.copy_(flat_k)
    before = flat_k.clone()
    tki.kv_insert(pages_k, page, off, x, fmt, block_size, round_bf16)
    keep = page >= 0
    write_kv(pages_r, page[keep], off[keep], x[keep].float(), fmt, block_size, round_bf16)
    assert not torch.equal(flat_k, before)
    diff = (flat_k != flat_r).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at flat offsets {diff[:8].flatten().tolist()}"


def test_kv_insert_skips_out_of_range_offsets_and_negative_offsets():
    g = gen(5)
    x = _rows(3, g)
    pages, flat = _pages(2, 2, g)
    before = flat.clone()
    tki.kv_insert(pages, torch.tensor([0, 1, 0], device=DEV), torch.tensor([2, -1, 5], device=DEV), x, OCP, 2)
    assert torch.equal(flat, before)


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("D,pdtype,xdtype", [(512, torch.bfloat16, torch.float32), (128, torch.float32, torch.float32),
                                             (512, torch.bfloat16, torch.bfloat16),
                                             (128, torch.float16, torch.float32)])
def test_kv_insert_dense_bitwise(D, pdtype, xdtype):
    g = gen(D + 3)
    t, n, b = 10, 3, 64
    x = (torch.randn(t, D, generator=g) * 7.3).to(xdtype).to(DEV)
    page, off = _slots(t, n, b, g)
    base_k = (torch.randn(n, b, D + 8, generator=g) * 100).to(pdtype).to(DEV)
    base_r = base_k.clone()
    tki.kv_insert_dense(base_k[:, :, 4: 4 + D], page, off, x)  # a non-contiguous view: strides from the tensor
    keep = page >= 0
    base_r[:, :, 4: 4 + D][page[keep], off[keep]] = x[keep].to(pdtype)
    assert torch.equal(_bits(base_k), _bits(base_r))


def test_registry_and_torch_backend_agree():
    """The registered op: triton and torch backends give the same bytes (uint8 and dense pages)."""
    g = gen(11)
    _, fn_t = resolve("kv_insert", force={"kv_insert": "triton"})
    _, fn_r = resolve("kv_insert", force={"kv_insert": "torch"})
    assert fn_r is torch_attention.kv_insert
    x = _rows(8, g)
    page, off = _slots(8, 2, 64, g)
    pk, fk = _pages(2, 64, g)
    pr = torch.empty_like(fk).as_strided(pk.shape, pk.stride())
    fr = pr.as_strided(fk.shape, (1,))
    fr.copy_(fk)
    fn_t(pk, page, off, x, OCP, 64, True)
    fn_r(pr, page, off, x, OCP, 64, True)
    assert torch.equal(fk, fr)
    dk = torch.zeros(2, 64, 512, dtype=torch.bfloat16, device=DEV)
    dr = dk.clone()
    fn_t(dk, page, off, x, None, 64)
    fn_r(dr, page, off, x, None, 64)
    assert torch.equal(_bits(dk), _bits(dr))
