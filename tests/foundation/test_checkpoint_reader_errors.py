"""dsv4.checkpoint.reader: one test per way a checkpoint can be broken (each message names the tensor,
the file, and expected vs found), lazy access with stored dtypes, byte accounting, single-file form."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

import pytest
import torch

from dsv4.checkpoint.reader import INDEX_FILE, Checkpoint, CheckpointError, read_safetensors_header
from dsv4.config import ConfigError

# Tensors of the small last shard of tiny (the MTP block's tail): rewriting it is cheap.
SINK = "mtp.0.attn.attn_sink"  # F32 [4]
BIAS = "mtp.0.ffn.gate.bias"  # F32 [16]


def _raw_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _problem_lines(msg: str) -> list[str]:
    return [ln.strip() for ln in msg.splitlines()[1:]]


# ---- the intact fixture --------------------------------------------------------------------------

def test_tiny_fixture_is_valid(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    assert ck.problems() == []
    assert set(ck.keys()) == set(ck.specs)
    assert len(ck.files) == 4 and ck.weight_map is not None  # several shards: the index is exercised


# ---- one test per failure kind -------------------------------------------------------------------

def test_truncated_shard(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    last = ck.shards()[-1]
    size = last.stat().st_size
    hlen, header = _raw_header(last)
    os.truncate(last, size - 1000)
    data_bytes = size - 1000 - 8 - hlen
    cut = {n for n, i in header.items() if n != "__metadata__" and i["data_offsets"][1] > data_bytes}
    assert cut
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    msg = str(ei.value)
    named = msg.split("'")[1]
    assert named in cut, msg  # names a tensor whose bytes were cut off
    end = header[named]["data_offsets"][1]
    assert last.name in msg and "truncated shard" in msg
    assert f"..{end}" in msg and f"only {data_bytes} data bytes" in msg  # expected range vs bytes present


def test_truncated_header(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    last = ck.shards()[-1]
    hlen, _ = _raw_header(last)
    os.truncate(last, 8 + hlen // 2)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    msg = str(ei.value)
    assert last.name in msg and "truncated shard" in msg
    assert f"header says {hlen} bytes" in msg and f"file has {hlen // 2}" in msg


def test_missing_tensor(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(BIAS)
    ck.rewrite_shard(fname, lambda t: t.pop(BIAS))
    idx = ck.index()
    del idx["weight_map"][BIAS]
    ck.write_index(idx)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    msg = str(ei.value)
    assert "(1 problems)" in msg
    assert f"missing tensor '{BIAS}' (expected F32[16]) in {ck.path}" in msg
    # validate=False defers the check: problems() lists it
    lazy = Checkpoint(ck.path, validate=False)
    assert lazy.problems() == [f"missing tensor '{BIAS}' (expected F32[16]) in {ck.path}"]


def test_index_names_tensor_no_shard_holds(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(BIAS)
    ck.rewrite_shard(fname, lambda t: t.pop(BIAS))  # the index still lists it
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path, validate=False)
    assert str(ei.value) == f"tensor '{BIAS}': {INDEX_FILE} maps it to {fname}, but no shard holds it"


def test_shard_tensor_missing_from_index(tiny_ckpt, corrupt_copy):
    """A tensor the index does not list is invisible to index-driven loaders: reject it."""
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(BIAS)
    idx = ck.index()
    del idx["weight_map"][BIAS]
    ck.write_index(idx)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path, validate=False)
    assert str(ei.value) == f"tensor '{BIAS}' in {fname} is not listed in {INDEX_FILE}"


def test_wrong_dtype(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(SINK)
    ck.rewrite_shard(fname, lambda t: t.__setitem__(SINK, t[SINK].to(torch.bfloat16)))
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    assert _problem_lines(str(ei.value)) == [f"tensor '{SINK}' in {fname}: dtype expected F32, found BF16"]


def test_wrong_dtype_fp8_weight(tiny_ckpt, corrupt_copy):
    """An FP8 weight stored dequantized: expected F8_E4M3, found BF16."""
    name = "mtp.0.attn.wo_b.weight"
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(name)
    ck.rewrite_shard(fname, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    assert _problem_lines(str(ei.value)) == [f"tensor '{name}' in {fname}: dtype expected F8_E4M3, found BF16"]


def test_alternative_dtypes_accepted(tiny_ckpt, corrupt_copy):
    """Norms may be F32 instead of BF16, tid2eid I32 instead of I64 (other producers write these)."""
    ck = corrupt_copy(tiny_ckpt)
    norm = "mtp.0.norm.weight"
    ck.rewrite_shard(ck.shard_of(norm), lambda t: t.__setitem__(norm, t[norm].float()))
    Checkpoint(ck.path)  # validates


def test_wrong_shape(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(SINK)
    ck.rewrite_shard(fname, lambda t: t.__setitem__(SINK, torch.ones(5)))
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    assert _problem_lines(str(ei.value)) == [f"tensor '{SINK}' in {fname}: shape expected [4], found [5]"]


def test_wrong_dtype_and_shape_both_reported(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(SINK)

    def edit(t):
        t[SINK] = torch.ones(2, 2, dtype=torch.float16)
        t[BIAS] = torch.zeros(17)

    ck.rewrite_shard(fname, edit)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    lines = _problem_lines(str(ei.value))
    assert "(3 problems)" in str(ei.value)
    assert f"tensor '{SINK}' in {fname}: dtype expected F32, found F16" in lines
    assert f"tensor '{SINK}' in {fname}: shape expected [4], found [2, 2]" in lines
    assert f"tensor '{BIAS}' in {fname}: shape expected [16], found [17]" in lines


def test_index_names_missing_shard(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    idx = ck.index()
    idx["weight_map"][SINK] = "model-00009-of-00004.safetensors"
    ck.write_index(idx)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    msg = str(ei.value)
    assert f"{INDEX_FILE} names shard model-00009-of-00004.safetensors, which does not exist in {ck.path}" in msg
    assert f"'{SINK}'" in msg and "1 tensor(s)" in msg


def test_index_maps_tensor_to_wrong_shard(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    idx = ck.index()
    right = idx["weight_map"][SINK]
    wrong = next(p.name for p in ck.shards() if p.name != right)
    idx["weight_map"][SINK] = wrong
    ck.write_index(idx)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    assert str(ei.value) == f"tensor '{SINK}': {INDEX_FILE} maps it to {wrong}, found in {right}"


def test_unreadable_index(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    ck.index_path.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="unreadable index"):
        Checkpoint(ck.path)


def test_unexpected_extra_tensor(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(SINK)
    extra = "mtp.0.attn.bogus"
    ck.rewrite_shard(fname, lambda t: t.__setitem__(extra, torch.zeros(3, dtype=torch.bfloat16)))
    idx = ck.index()
    idx["weight_map"][extra] = fname
    ck.write_index(idx)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    assert _problem_lines(str(ei.value)) == [
        f"unexpected tensor '{extra}' in {fname} (BF16[3]): not in the config's inventory"]


def test_tensor_in_two_shards(tiny_ckpt, corrupt_copy):
    ck = corrupt_copy(tiny_ckpt)
    fname = ck.shard_of(SINK)
    other = min((p for p in ck.shards() if p.name != fname), key=lambda p: p.stat().st_size).name
    src = ck.path / fname
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        sink = f.get_tensor(SINK)
    ck.rewrite_shard(other, lambda t: t.__setitem__(SINK, sink))
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    msg = str(ei.value)
    assert f"tensor '{SINK}' appears in both" in msg and fname in msg and other in msg


def test_header_byte_size_mismatch(tiny_ckpt, corrupt_copy):
    """A header whose shape disagrees with its byte range (a hand-edited or corrupt header)."""
    ck = corrupt_copy(tiny_ckpt)
    last = ck.shards()[-1]
    raw = last.read_bytes()
    hlen, header = _raw_header(last)
    header[SINK]["shape"] = [5]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (hlen - len(new))  # keep the header length so the data offsets stay valid
    assert len(new) == hlen
    last.write_bytes(raw[:8] + new + raw[8 + hlen:])
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(ck.path)
    assert str(ei.value) == f"tensor '{SINK}' in {last.name}: byte size 16 does not match F32[5]"


def test_corrupt_header_json(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        read_safetensors_header(p)


def test_empty_file(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated shard \(file is 3 bytes, no header\)"):
        read_safetensors_header(p)


def test_missing_model_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(missing)
    assert str(ei.value) == f"model directory {missing} does not exist"


def test_no_safetensors_at_all(tiny_ckpt, tmp_path):
    shutil.copy(tiny_ckpt / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(tmp_path)
    assert str(ei.value) == f"no {INDEX_FILE} and no *.safetensors files in {tmp_path}"


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        Checkpoint(tmp_path)


def test_wrong_config_for_the_files(tiny_ckpt, tmp_path):
    """Files of one config validated against another: every difference is listed."""
    from dsv4.checkpoint.synthetic import build_config
    from dsv4.config import config_from_dict

    other = config_from_dict(build_config("tiny", overrides={"n_routed_experts": 8}))
    ck = Checkpoint(tiny_ckpt, config=other, validate=False)
    probs = ck.problems()
    assert any("'layers.2.ffn.gate.weight'" in p and "shape expected [8, 256], found [16, 256]" in p for p in probs)
    assert any(p.startswith("unexpected tensor 'layers.0.ffn.experts.15.w1.weight'") for p in probs)
    with pytest.raises(CheckpointError, match=r"… and \d+ more"):
        ck.validate()  # more than 20 problems: the message is capped


# ---- access --------------------------------------------------------------------------------------

def test_lazy_get_keeps_stored_dtypes(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    assert ck._handles == {}  # nothing opened before the first get
    cases = {
        "layers.0.attn.wq_a.weight": (torch.float8_e4m3fn, (128, 256)),
        "layers.0.attn.wq_a.scale": (torch.float8_e8m0fnu, (1, 2)),
        "layers.2.ffn.experts.0.w1.weight": (torch.int8, (128, 128)),
        "layers.2.ffn.experts.0.w1.scale": (torch.float8_e8m0fnu, (128, 8)),
        "layers.0.ffn.gate.tid2eid": (torch.int64, (129280, 6)),
        "layers.0.attn_norm.weight": (torch.bfloat16, (256,)),
        "layers.0.attn.attn_sink": (torch.float32, (4,)),
    }
    for name, (dtype, shape) in cases.items():
        t = ck.get(name)
        assert t.dtype == dtype and tuple(t.shape) == shape, name
        assert name in ck
    assert 1 <= len(ck._handles) <= len(ck.files)
    with pytest.raises(CheckpointError, match="tensor 'layers.9.attn.wq_a.weight' is not in checkpoint"):
        ck.get("layers.9.attn.wq_a.weight")


def test_spec_and_iter_tensors(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    assert ck.spec("layers.0.attn.wq_a.scale").dtype == "F8_E8M0"
    names = ["hc_head_base", "layers.1.attn.compressor.ape"]
    got = dict(ck.iter_tensors(names, progress=False))
    assert list(got) == names and got["layers.1.attn.compressor.ape"].shape == (4, 1024)


def test_bytes_by_dtype(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    width = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}
    want: dict[str, tuple[int, int]] = {}
    for s in ck.specs.values():  # the generator writes each spec's first dtype
        c, b = want.get(s.dtype, (0, 0))
        want[s.dtype] = (c + 1, b + math.prod(s.shape) * width[s.dtype])
    got = ck.bytes_by_dtype()
    assert got == want
    assert list(got) == sorted(got)
    assert ck.total_bytes() == sum(b for _, b in got.values())
    # every byte of the shards is a header or tensor data
    files = sum(p.stat().st_size for p in ck.files)
    headers = sum(8 + _raw_header(p)[0] for p in ck.files)
    assert files == headers + ck.total_bytes()


def test_single_file_checkpoint(tiny_ckpt, tmp_path):
    """No index, one model.safetensors: loads and validates."""
    from safetensors.torch import save_file

    ck = Checkpoint(tiny_ckpt)
    tensors = {n: ck.get(n) for n in ck.keys()}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tiny_ckpt / "config.json", tmp_path / "config.json")
    single = Checkpoint(tmp_path)
    assert single.weight_map is None
    assert single.files == [tmp_path / "model.safetensors"]
    assert set(single.keys()) == set(ck.keys())
    assert single.bytes_by_dtype() == ck.bytes_by_dtype()
    name = "layers.1.attn.wq_b.weight"
    assert torch.equal(single.get(name).view(torch.uint8), ck.get(name).view(torch.uint8))
