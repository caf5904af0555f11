"""The MXFP4 PTX decodes, run on the CPU by a small emulator of the PTX they are written in.

The decodes (``e2m1_bytes_to_bf16_ptx`` and its folded form) only run compiled on a CUDA GPU, so CI
never executes them. This test reads their inline assembly from the source and interprets it
instruction by instruction (``mov``, ``prmt``, ``and``, ``or``, ``shl``, ``mul.lo``, ``fma.rn.bf16x2``,
the subset they use) over every byte and every scale code the form accepts, and compares the bits with
E2M1 × 2^(b-127) rounded to bf16 (``dsv4.formats`` E2M1 values). The same comparison runs compiled on
the H200 in ``test_ops_moe_experts_triton.py``; here a wrong mask or shift in the text fails on CPU.
"""

import inspect
import re

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from dsv4.formats import E2M1_VALUES  # noqa: E402
from dsv4.ops.triton import _common  # noqa: E402
from dsv4.ops.triton import moe as tmoe  # noqa: E402

M32 = 0xFFFFFFFF


def _asm_of(fn) -> list[str]:
    src = inspect.getsource(fn.fn)
    body = re.search(r'asm="""(.*?)"""', src, re.S).group(1)
    return [ln.strip().rstrip(";") for ln in body.splitlines() if ln.strip() not in ("", "{", "}")]


def _bf16_bits_to_f64(h: torch.Tensor) -> torch.Tensor:
    return h.to(torch.int16).view(torch.bfloat16).to(torch.float64)


def _f64_to_bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = torch.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        assert s < 8, "sign-replicate selectors are not used"
        out |= src[s] << (8 * i)
    return out


def _fma_bf16x2(a, b, c):
    halves = []
    for sh in (0, 16):
        va, vb, vc = (_bf16_bits_to_f64((x >> sh) & 0xFFFF) for x in (a, b, c))
        halves.append(_f64_to_bf16_bits(va * vb + vc) << sh)  # the exact product and sum, rounded once
    return halves[0] | halves[1]


def run_asm(lines: list[str], args: list[torch.Tensor], n_out: int) -> list[torch.Tensor]:
    """Interpret ``lines`` with $0..$(n_out-1) outputs and $n_out.. inputs (int64 tensors of 32-bit words)."""
    reg = {f"${n_out + i}": a & M32 for i, a in enumerate(args)}

    def val(tok):
        tok = tok.strip()
        if tok in reg:
            return reg[tok]
        return torch.full_like(args[0], int(tok, 0) & M32)

    for ln in lines:
        op, _, rest = ln.partition(" ")
        if op.startswith(".reg"):
            continue
        d, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            r = val(src[0])
        elif op == "prmt.b32":
            r = _prmt(val(src[0]), val(src[1]), int(src[2], 0))
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "or.b32":
            r = val(src[0]) | val(src[1])
        elif op == "shl.b32":
            r = (val(src[0]) << int(src[1], 0)) & M32
        elif op == "mul.lo.u32":
            r = (val(src[0]) * val(src[1])) & M32
        elif op == "fma.rn.bf16x2":
            r = _fma_bf16x2(val(src[0]), val(src[1]), val(src[2]))
        else:
            raise AssertionError(f"instruction {op!r} is not emulated")
        reg[d] = r & M32
    return [reg[f"${i}"] for i in range(n_out)]


def _cases(codes):
    """Every 4-byte word pattern that matters: each byte value in each position, under each code."""
    byte = torch.arange(256, dtype=torch.int64)
    words = torch.cat([byte << (8 * p) | ((byte * 37 + 11) % 256) << (8 * ((p + 1) % 4)) for p in range(4)])
    code = torch.tensor(codes, dtype=torch.int64)
    w = words.repeat_interleave(len(codes))
    c = code.repeat(len(words))
    return w, c


def _expected(w, c):
    """[4 output words] of bf16 pairs: lo nibbles of bytes (0,1), (2,3); hi nibbles of (0,1), (2,3)."""
    vals = torch.as_tensor(E2M1_VALUES).to(torch.float64)
    scale = torch.where(c == 255, torch.tensor(float("nan"), dtype=torch.float64), torch.exp2(c.double() - 127))
    outs = []
    for shift in (0, 4):
        for pair in ((0, 1), (2, 3)):
            halves = [_f64_to_bf16_bits(vals[(w >> (8 * b + shift)) & 15] * scale) for b in pair]
            outs.append(halves[0] | halves[1] << 16)
    return outs


def _same_bits(got, want):
    for g, e in zip(got, want):
        for sh in (0, 16):
            gh, eh = (g >> sh) & 0xFFFF, (e >> sh) & 0xFFFF
            nan = (eh & 0x7FFF) > 0x7F80
            assert torch.equal(nan, (gh & 0x7FFF) > 0x7F80)
            assert torch.equal(gh[~nan], eh[~nan])


def _scale_words(bits16):
    """The asm's two scale registers: each holds the scale of two bytes' worth of values (pack=4)."""
    return bits16 | bits16 << 16


def test_two_multiply_decode_is_exact_for_every_code():
    w, c = _cases(list(range(256)))
    sc = torch.where(c == 255, 0x7FC0, torch.where(c == 0, 0x0040, (c << 7) & 0xFFFF))  # ue8m0 -> bf16
    got = run_asm(_asm_of(_common.e2m1_bytes_to_bf16_ptx), [w, _scale_words(sc), _scale_words(sc)], 4)
    _same_bits(got, _expected(w, c))


def test_folded_decode_is_exact_for_codes_up_to_128():
    assert tmoe.FOLD_MAX_CODE == 128
    w, c = _cases(list(range(129)))
    sc = ((c + 126) << 7) & 0xFFFF  # the kernel's 2^(b-1)
    assert bool(((sc >> 7) & 0xFF).lt(255).all()) and bool(((sc >> 7) & 0xFF).gt(0).all())  # normal bf16
    got = run_asm(_asm_of(_common.e2m1_bytes_to_bf16_ptx_folded), [w, _scale_words(sc), _scale_words(sc)], 4)
    _same_bits(got, _expected(w, c))


def test_folded_decode_would_be_wrong_past_code_128():
    """Why the host checks the codes: at b = 129 the folded scale 2^128 is not a bf16 (the exponent
    field overflows into the sign), so the folded form must not run there."""
    w, c = _cases([129, 200])
    sc = ((c + 126) << 7) & 0xFFFF
    got = run_asm(_asm_of(_common.e2m1_bytes_to_bf16_ptx_folded), [w, _scale_words(sc), _scale_words(sc)], 4)
    with pytest.raises(AssertionError):
        _same_bits(got, _expected(w, c))


def test_fold_is_taken_only_where_every_code_allows_it():
    s = torch.full((4, 8, 16), 120, dtype=torch.uint8).transpose(1, 2)  # groups-major, as stack_experts
    assert tmoe._fold_ok(s, s)
    s[1, 3, 2] = 128
    assert tmoe._fold_ok(s, s)  # in-place change: checked again (version), still ≤ 128
    s[2, 0, 0] = 129
    assert not tmoe._fold_ok(s, s)
    s[2, 0, 0] = 255
    assert not tmoe._fold_ok(s, s)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None:
        t = torch.full((2, 3), 127, dtype=torch.uint8).view(e8m0)
        assert tmoe._fold_ok(t, t.view(torch.uint8))
    assert tmoe._fold_ok(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8))


def test_fold_answer_is_cached_until_the_tensor_changes(monkeypatch):
    s = torch.full((2, 4), 100, dtype=torch.uint8)
    calls = []
    real_max = torch.Tensor.max

    def counting_max(self, *a, **k):
        calls.append(1)
        return real_max(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "max", counting_max)
    assert tmoe._fold_ok(s, s) and tmoe._fold_ok(s, s)
    assert len(calls) == 1
    s.fill_(200)
    assert not tmoe._fold_ok(s, s)
    assert len(calls) == 2


def test_inference_mode_scales_are_checked_every_call():
    """Inference tensors keep no version counter: nothing is cached, an in-place change is still seen."""
    with torch.inference_mode():
        s = torch.full((2, 4), 100, dtype=torch.uint8)
        assert tmoe._fold_ok(s, s)
        s[0, 0] = 200
        assert not tmoe._fold_ok(s, s)
    assert getattr(s, "_dsv4_fold_ok", None) is None
