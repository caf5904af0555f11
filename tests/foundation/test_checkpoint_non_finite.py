"""Non-finite weights fail the load, naming the tensor, its file and the count: FP8 E4M3 NaN codes
(0x7F/0xFF; FNUZ 0x80) and E8M0 scale NaNs by byte, BF16/FP32 NaN and ±inf by value. Written into a
copy of the small synthetic checkpoint; ``dsv4 inspect`` lists every such tensor."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.reader import Checkpoint, CheckpointError, non_finite_count
from dsv4.cli import main

NORM = "layers.0.attn_norm.weight"  # BF16 [256]
ROUTER = "layers.0.ffn.gate.weight"  # BF16 [4, 256] (4 experts)
FP8 = "layers.0.attn.wkv.weight"  # F8_E4M3 [512, 256]
SCALE = "layers.0.attn.wkv.scale"  # F8_E8M0 [4, 2]


def _bytes(codes, dtype) -> torch.Tensor:
    return torch.tensor(codes, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("codes, dtype, name, bad", [
    ([0x00, 0x7E, 0xFE, 0x80, 0x01], torch.float8_e4m3fn, "F8_E4M3", 0),  # ±448 and -0 are finite
    ([0x7F, 0x00, 0xFF, 0x7F], torch.float8_e4m3fn, "F8_E4M3", 3),
    ([0x7B, 0xFB, 0x00], torch.float8_e5m2, "F8_E5M2", 0),
    ([0x7C, 0xFC, 0x7E, 0x00], torch.float8_e5m2, "F8_E5M2", 3),  # ±inf, NaN
    ([0x7F, 0xFF, 0x00], torch.float8_e4m3fnuz, "F8_E4M3FNUZ", 0),  # FNUZ: those are ±240
    ([0x80, 0x01, 0x80], torch.float8_e4m3fnuz, "F8_E4M3FNUZ", 2),
    ([0x80, 0x7F], torch.float8_e5m2fnuz, "F8_E5M2FNUZ", 1),
    ([0x7F, 0xFE], torch.float8_e8m0fnu, "F8_E8M0", 0),
    ([0xFF, 0x7F], torch.float8_e8m0fnu, "F8_E8M0", 1),
])
def test_fp8_codes(codes, dtype, name, bad):
    assert non_finite_count(_bytes(codes, dtype), name)[0] == bad


def test_float_values():
    t = torch.ones(1000, dtype=torch.bfloat16)
    assert non_finite_count(t, "BF16") == (0, "NaN or ±inf")
    t[[3, 500]] = float("nan")
    t[9] = float("-inf")
    assert non_finite_count(t, "BF16")[0] == 3
    big = torch.full((4,), 3e38, dtype=torch.float32)  # the sum overflows; every value is finite
    assert non_finite_count(big, "F32")[0] == 0
    assert non_finite_count(torch.full((100,), 60000.0, dtype=torch.float16), "F16")[0] == 0
    assert non_finite_count(torch.zeros(3, dtype=torch.int8), "I8")[0] == 0


def _poison(ck, name: str, edit) -> None:
    ck.rewrite_shard(ck.shard_of(name), lambda tensors: edit(tensors[name]))


def _nan_norm(t):
    t[:8] = float("nan")


def test_nan_in_a_norm_weight_fails_the_load_by_name(small_ckpt, corrupt_copy, capsys):
    from dsv4.model.model import ReferenceModel

    ck = corrupt_copy(small_ckpt)
    _poison(ck, NORM, _nan_norm)
    shard = ck.shard_of(NORM)
    with pytest.raises(CheckpointError) as ei:
        ReferenceModel(ck.path, dtype=torch.float32)
    msg = str(ei.value)
    assert f"tensor '{NORM}' in {shard}: 8 of 256 values are NaN or ±inf (BF16[256])" in msg, msg
    # the commands fail the same way, before serving anything
    assert main(["generate", "--model", str(ck.path), "--prompt", "x", "--kv-cache-memory", "64"]) == 2
    assert f"tensor '{NORM}' in {shard}: 8 of 256" in capsys.readouterr().err


def test_inf_in_a_router_weight_and_fp8_nan_codes(small_ckpt, corrupt_copy):
    ck = corrupt_copy(small_ckpt)

    def inf(t):
        t[3, 7] = float("inf")

    def fp8_nan(t):
        t.view(torch.uint8)[100, 5] = 0xFF  # -NaN in OCP E4M3
        t.view(torch.uint8)[511, 255] = 0x7F

    def scale_nan(t):
        t.view(torch.uint8)[0, 0] = 0xFF

    _poison(ck, ROUTER, inf)
    _poison(ck, FP8, fp8_nan)
    _poison(ck, SCALE, scale_nan)
    c = Checkpoint(ck.path)  # the headers are fine: only reading the values finds it
    with pytest.raises(CheckpointError, match=rf"tensor '{ROUTER}' in .*: 1 of 1024 values are NaN or ±inf"):
        c.get(ROUTER)
    with pytest.raises(CheckpointError, match=rf"tensor '{FP8}' in .*: 2 of 131072 values are NaN \(FP8 E4M3"):
        c.get(FP8)
    with pytest.raises(CheckpointError, match=rf"tensor '{SCALE}' in .*: 1 of 8 values are NaN \(E8M0"):
        c.get(SCALE)
    # a tensor-parallel rank reads its slice: checked too, and only what it reads
    with pytest.raises(CheckpointError, match=rf"'{FP8}' in .* \(rows 0..256\): 1 of 65536 values"):
        c.get_slice(FP8, 0, 0, 256)
    assert c.get_slice(FP8, 1, 8, 128).shape == (512, 120)  # columns without the two
    assert Checkpoint(ck.path, check_finite=False).get(ROUTER)[3, 7] == float("inf")


def test_inspect_lists_every_non_finite_tensor(small_ckpt, corrupt_copy, capsys):
    ck = corrupt_copy(small_ckpt)
    _poison(ck, NORM, _nan_norm)
    _poison(ck, ROUTER, lambda t: t.__setitem__((0, 0), float("-inf")))
    assert main(["inspect", str(ck.path)]) == 1
    out = capsys.readouterr().out
    assert "values: 2 tensor(s) with NaN/±inf values" in out and "INVALID: 2 problem(s)" in out
    assert f"tensor '{NORM}'" in out and f"tensor '{ROUTER}'" in out
    assert main(["inspect", str(ck.path), "--no-check-values"]) == 0  # the headers alone are fine
    assert main(["inspect", str(small_ckpt)]) == 0
    assert "every value finite" in capsys.readouterr().out
