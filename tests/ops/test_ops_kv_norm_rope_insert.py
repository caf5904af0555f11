"""The fused window-KV op ``kv_norm_rope_insert`` (RMSNorm + RoPE + KV insert in one launch) vs its torch
backend — the unfused computation ``kv_insert(apply_rope(rms_norm(kv_raw)))`` — bitwise.

The torch backend runs with the Triton ``rms_norm`` standing in for the oracle's (as inside the engine's
fast forward, ``dsv4.model.kernels``): that is the unfused GPU path, whose bytes the fused kernel must
reproduce. Pages start as random bytes, so comparing the whole backing buffer also checks that skipped
slots (page −1, offsets outside the page) and every other byte are left untouched.
"""

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

from dsv4.config import RopeParams  # noqa: E402
from dsv4.formats import FNUZ, OCP, alloc_kv_pages, page_stride  # noqa: E402
from dsv4.model.rope import cos_sin  # noqa: E402
from dsv4.ops import torch_attention  # noqa: E402
from dsv4.ops.registry import resolve  # noqa: E402
from dsv4.ops.triton import dense as td  # noqa: E402
from dsv4.ops.triton import kv_insert as tki  # noqa: E402

EPS = 1e-6
ROPE = RopeParams(theta=10000.0, dim=64)


def _reference(pages, page_ids, offsets, kv_raw, norm_weight, eps, cos, sin, fmt=None, block_size=None):
    """The torch backend's steps with the Triton rms_norm in place of the oracle's (the unfused GPU
    path): the Triton norm, the oracle's rope, the torch insert."""
    from dsv4.model.rope import apply_rope

    kv = apply_rope(td.rms_norm(kv_raw, norm_weight, eps), cos, sin)
    torch_attention.kv_insert(pages, page_ids, offsets, kv, fmt, block_size)


def _raw(t, g, dtype):
    """wkv outputs with rows of very different scales, a zero rope pair, zeros and signed zeros."""
    x = torch.randn(t, 512, generator=g) * torch.exp2(torch.randint(-8, 9, (t, 1), generator=g).float())
    x[:, :448] *= torch.exp2(torch.randint(-4, 5, (t, 7, 1), generator=g).float()).repeat_interleave(64, 1).view(
        t, 7, 64).reshape(t, 448)  # NoPE tiles of different amax
    x[0, 448:450] = 0.0
    x[0, 450:452] = -0.0
    x[1 % t, 64:128] = 0.0  # an all-zero tile
    return x.to(dtype).to(DEV)


def _weight(g, dtype):
    return (1.0 + 0.3 * torch.randn(512, generator=g)).to(dtype).to(DEV)


def _positions(t, g):
    """Different positions per token, including 0 and large ones (the angle grows to ~1e6 rad)."""
    p = torch.randint(0, 5000, (t,), generator=g)
    p[0] = 0
    if t > 2:
        p[1], p[2] = 1_000_000, 2 ** 20 + 12345
    return p.to(DEV)


def _slots(t, n_pages, block_size, g):
    """Distinct (page, offset) slots; about a quarter of them (and token 1 when t > 1) padding (page −1)."""
    flat = torch.randperm(n_pages * block_size, generator=g)[:t]
    page, off = flat // block_size, flat % block_size
    if t > 1:
        page[torch.rand(t, generator=g) < 0.25] = -1
        page[1] = -1
    return page.to(DEV), off.to(DEV)


def _fp8_pages(n, block_size, g):
    pages = alloc_kv_pages(n, block_size, DEV, stride=page_stride(block_size) + 576)
    flat = pages.as_strided((pages.stride(0) * n,), (1,))
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    twin = torch.empty_like(flat).as_strided(pages.shape, pages.stride())
    twin.as_strided(flat.shape, (1,)).copy_(flat)
    return pages, twin, flat, twin.as_strided(flat.shape, (1,))


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _inputs(t, g, dtype, wdtype=None):
    raw = _raw(t, g, dtype)
    w = _weight(g, wdtype or dtype)
    cos, sin = cos_sin(ROPE, _positions(t, g))
    return raw, w, cos, sin


def _assert_same_bytes(got, want, what):
    diff = (got != want).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes differ, first at {diff[:8].flatten().tolist()}"


@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", [OCP, FNUZ], ids=["ocp", "fnuz"])
def test_fp8_pages_bitwise(fmt, dtype, t):
    g = gen(zlib.crc32(f"fp8 {fmt.name} {dtype} {t}".encode()))
    block_size = 64
    raw, w, cos, sin = _inputs(t, g, dtype)
    page, off = _slots(t, 3, block_size, g)
    pk, pr, fk, fr = _fp8_pages(3, block_size, g)
    before = fk.clone()
    tki.kv_norm_rope_insert(pk, page, off, raw, w, EPS, cos, sin, fmt, block_size)
    _reference(pr, page, off, raw, w, EPS, cos, sin, fmt, block_size)
    assert not torch.equal(fk, before)
    _assert_same_bytes(fk, fr, f"{fmt.name} {dtype} T={t}")


@pytest.mark.parametrize("pdtype,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                          (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_dense_pages_bitwise(pdtype, dtype):
    g = gen(zlib.crc32(f"dense {pdtype} {dtype}".encode()))
    t, n, b = 16, 3, 64
    raw, w, cos, sin = _inputs(t, g, dtype)
    page, off = _slots(t, n, b, g)
    base_k = (torch.randn(n, b, 512, generator=g) * 100).to(pdtype).to(DEV)
    base_r = base_k.clone()
    tki.kv_norm_rope_insert(base_k, page, off, raw, w, EPS, cos, sin)
    _reference(base_r, page, off, raw, w, EPS, cos, sin)
    _assert_same_bytes(_bits(base_k), _bits(base_r), f"dense {pdtype} from {dtype}")


def test_kv_raw_as_a_column_slice():
    """kv_raw as the last 512 columns of a wider GEMM output (the attention's [wq_a; wkv] launch): read with
    its row stride, the bytes of the contiguous kv_raw."""
    g = gen(78)
    raw, w, cos, sin = _inputs(6, g, torch.bfloat16)
    wide = torch.cat([torch.randn(6, 128, generator=g).to(raw), raw], dim=1)[:, 128:]
    assert wide.stride(0) == 640 and torch.equal(wide, raw)
    page, off = _slots(6, 2, 64, g)
    pk, pr, fk, fr = _fp8_pages(2, 64, g)
    tki.kv_norm_rope_insert(pk, page, off, wide, w, EPS, cos, sin, OCP, 64)
    tki.kv_norm_rope_insert(pr, page, off, raw, w, EPS, cos, sin, OCP, 64)
    _assert_same_bytes(fk, fr, "strided kv_raw")


def test_fp32_weight_with_bf16_kv():
    """A norm weight in another dtype than the activations (rms_norm multiplies in fp32)."""
    g = gen(77)
    raw, w, cos, sin = _inputs(5, g, torch.bfloat16, torch.float32)
    page, off = _slots(5, 2, 64, g)
    pk, pr, fk, fr = _fp8_pages(2, 64, g)
    tki.kv_norm_rope_insert(pk, page, off, raw, w, EPS, cos, sin, OCP, 64)
    _reference(pr, page, off, raw, w, EPS, cos, sin, OCP, 64)
    _assert_same_bytes(fk, fr, "bf16 kv, fp32 weight")


def test_unfused_triton_path_equals_fused():
    """The engine's unfused GPU path spelled out: Triton rms_norm → apply_rope → Triton kv_insert."""
    from dsv4.model.rope import apply_rope

    g = gen(31)
    raw, w, cos, sin = _inputs(7, g, torch.bfloat16)
    page, off = _slots(7, 2, 64, g)
    pk, pr, fk, fr = _fp8_pages(2, 64, g)
    tki.kv_norm_rope_insert(pk, page, off, raw, w, EPS, cos, sin, OCP, 64)
    kv = apply_rope(td.rms_norm(raw, w, EPS), cos, sin)
    tki.kv_insert(pr, page, off, kv.float(), OCP, 64, False)
    _assert_same_bytes(fk, fr, "unfused Triton path")


@pytest.mark.parametrize("dense", [False, True], ids=["fp8", "dense"])
def test_row_does_not_depend_on_the_other_rows(dense):
    """Token t's bytes are the same written alone or among other tokens (any order)."""
    g = gen(123 + dense)
    t = 6
    raw, w, cos, sin = _inputs(t, g, torch.bfloat16)
    page = torch.zeros(t, dtype=torch.long, device=DEV)
    off = torch.arange(t, device=DEV)
    if dense:
        together = torch.zeros(1, 64, 512, dtype=torch.bfloat16, device=DEV)
    else:
        together, _, ft, _ = _fp8_pages(1, 64, g)
        ft.zero_()
    tki.kv_norm_rope_insert(together, page, off, raw, w, EPS, cos, sin, OCP, 64)
    perm = torch.randperm(t, generator=g).to(DEV)
    shuffled = torch.zeros_like(together)
    tki.kv_norm_rope_insert(shuffled, page, off[perm], raw[perm], w, EPS, cos[perm], sin[perm], OCP, 64)
    assert torch.equal(_bits(shuffled), _bits(together))
    for k in range(t):
        alone = torch.zeros_like(together)
        tki.kv_norm_rope_insert(alone, page[k:k + 1], off[k:k + 1], raw[k:k + 1], w, EPS, cos[k:k + 1],
                                sin[k:k + 1], OCP, 64)
        row = (lambda p: p[0, k]) if dense else (lambda p: torch.cat([p[0, k * 576:(k + 1) * 576],
                                                                      p[0, 64 * 576 + k * 8: 64 * 576 + k * 8 + 8]]))
        assert torch.equal(_bits(row(alone)), _bits(row(together))), f"token {k}"


def test_skips_negative_and_out_of_range_slots():
    g = gen(5)
    raw, w, cos, sin = _inputs(4, g, torch.float32)
    pages, _, flat, _ = _fp8_pages(2, 2, g)
    before = flat.clone()
    tki.kv_norm_rope_insert(pages, torch.tensor([0, 1, 0, -1], device=DEV), torch.tensor([2, -1, 5, 0], device=DEV),
                            raw, w, EPS, cos, sin, OCP, 2)
    assert torch.equal(flat, before)
    dense = torch.randn(2, 2, 512, device=DEV)
    dbefore = dense.clone()
    tki.kv_norm_rope_insert(dense, torch.tensor([0, 1, 0, -1], device=DEV), torch.tensor([2, -1, 5, 0], device=DEV),
                            raw, w, EPS, cos, sin)
    assert torch.equal(dense, dbefore)


def test_registry_backends():
    _, fn_t = resolve("kv_norm_rope_insert", force={"kv_norm_rope_insert": "triton"})
    _, fn_r = resolve("kv_norm_rope_insert", force={"kv_norm_rope_insert": "torch"})
    assert fn_t is tki.kv_norm_rope_insert and fn_r is torch_attention.kv_norm_rope_insert


def test_bad_inputs_name_the_argument():
    g = gen(9)
    raw, w, cos, sin = _inputs(3, g, torch.float32)
    pages, _, _, _ = _fp8_pages(1, 64, g)
    page, off = torch.zeros(3, dtype=torch.long, device=DEV), torch.arange(3, device=DEV)
    f = tki.kv_norm_rope_insert
    cases = [
        (ValueError, "kv_raw must be \\[T, 512\\]", (pages, page, off, raw[:, :256], w, EPS, cos, sin, OCP, 64)),
        (TypeError, "kv_raw must be bf16, fp16 or fp32", (pages, page, off, raw.double(), w, EPS, cos, sin, OCP, 64)),
        (ValueError, "page_ids must be \\[T=3\\]", (pages, page[:2], off, raw, w, EPS, cos, sin, OCP, 64)),
        (TypeError, "offsets must be an integer tensor", (pages, page, off.float(), raw, w, EPS, cos, sin, OCP, 64)),
        (ValueError, "norm_weight must be \\[512\\]", (pages, page, off, raw, w[:64], EPS, cos, sin, OCP, 64)),
        (ValueError, "cos must be \\[T=3, 32\\]", (pages, page, off, raw, w, EPS, cos[:, :16], sin, OCP, 64)),
        (TypeError, "sin must be float32", (pages, page, off, raw, w, EPS, cos, sin.double(), OCP, 64)),
        (ValueError, "need an FP8 format", (pages, page, off, raw, w, EPS, cos, sin, None, 64)),
        (ValueError, "block_size 128 needs", (pages, page, off, raw, w, EPS, cos, sin, OCP, 128)),
        (ValueError, "float pages must be \\[P, B, 512\\]",
         (torch.zeros(2, 64, 256, device=DEV), page, off, raw, w, EPS, cos, sin, None, 64)),
    ]
    for exc, msg, args in cases:
        with pytest.raises(exc, match=msg):
            f(*args)
