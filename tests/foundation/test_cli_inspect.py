"""The ``dsv4`` command line: make-checkpoint then inspect (as subprocesses through the installed entry
point), inspect of a broken checkpoint, and error exits."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from foundation_helpers import SMALL_LAYERS, SMALL_OVERRIDES, SMALL_SEED

from dsv4.cli import build_parser, main

_ENTRY = Path(sys.executable).parent / "dsv4"


def _dsv4(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [str(_ENTRY)] if _ENTRY.exists() else [sys.executable, "-m", "dsv4.cli"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cli_small(tmp_path_factory):
    """``dsv4 make-checkpoint --preset tiny`` through the entry point, shrunk with --layers/--override
    (the full tiny preset costs another ~10 s on 2 cores; the CLI passes everything to the same
    write_checkpoint, and its defaults are checked in test_make_checkpoint_defaults)."""
    out = tmp_path_factory.mktemp("cli") / "small"
    overrides = [a for k, v in SMALL_OVERRIDES.items() for a in ("--override", f"{k}={v}")]
    r = _dsv4("make-checkpoint", "--preset", "tiny", "--out", str(out), "--layers", str(SMALL_LAYERS),
              "--seed", str(SMALL_SEED), *overrides, "--quiet")
    assert r.returncode == 0, r.stderr
    assert f"wrote tiny checkpoint to {out}" in r.stdout
    return out


def test_make_checkpoint_then_inspect_valid(cli_small, small_ckpt):
    r = _dsv4("inspect", str(cli_small))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.rstrip().splitlines()[-1].startswith("VALID: all ")
    assert "INVALID" not in out
    assert f"model directory: {cli_small}" in out
    assert "layers 1," in out and "vocab 512" in out and "moe: 4 experts top-2" in out
    assert "layer schedule: 0:SWA+hash mtp×1:SWA" in out
    # the CLI writes exactly what the library writes with the same arguments: byte-identical files
    names = sorted(p.name for p in small_ckpt.iterdir())
    assert names == sorted(p.name for p in cli_small.iterdir())
    assert any(n.endswith(".safetensors") for n in names) and "tokenizer.json" in names
    for name in names:
        assert _sha(cli_small / name) == _sha(small_ckpt / name), name


def test_inspect_corrupted_copy_invalid(cli_small, corrupt_copy):
    import torch

    ck = corrupt_copy(cli_small)
    name = "mtp.0.attn.attn_sink"
    fname = ck.shard_of(name)
    ck.rewrite_shard(fname, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    r = _dsv4("inspect", str(ck.path))
    assert r.returncode == 1
    assert "VALID: all" not in r.stdout
    assert "INVALID: 1 problem(s)" in r.stdout
    assert f"tensor '{name}' in {fname}: dtype expected F32, found BF16" in r.stdout
    assert "config: hidden 256" in r.stdout  # the summary is still printed


def test_make_checkpoint_defaults():
    a = build_parser().parse_args(["make-checkpoint", "--out", "d"])
    assert (a.preset, a.layers, a.seed, a.expert_dtype, a.override, a.device, a.quiet) == \
        ("tiny", None, 0, "fp4", [], "cpu", False)


def test_inspect_tiny_preset_report(tiny_ckpt, capsys):
    assert main(["inspect", str(tiny_ckpt)]) == 0
    out = capsys.readouterr().out
    assert "VALID: all 667 expected tensors present with the right dtype and shape" in out
    assert "INVALID" not in out
    assert "config: hidden 256, layers 4, heads 4×512 (rope 64), q_lora 128, o 2×128, vocab 129280" in out
    assert "moe: 16 experts top-6 + 1 shared, inter 128, expert dtype fp4, scales ue8m0, hash layers 2" in out
    assert "attention: window 128, indexer 8×128 top-32" in out
    assert "rope: main θ=10000; compress θ=160000 YaRN ×16 (orig 65536, β 32/1)" in out
    assert "layer schedule: 0:SWA+hash 1:CSA+hash 2:HCA 3:CSA mtp×1:SWA" in out
    assert "files: 4 shard(s), 667 tensors" in out
    for dt in ("BF16", "F32", "F8_E4M3", "F8_E8M0", "I64", "I8"):
        assert f"  {dt} " in out


def test_inspect_truncated_copy_invalid(tiny_ckpt, corrupt_copy, capsys):
    ck = corrupt_copy(tiny_ckpt)
    last = ck.shards()[-1]
    os.truncate(last, last.stat().st_size - 10)
    assert main(["inspect", str(ck.path)]) == 1
    out = capsys.readouterr().out
    assert "INVALID:" in out and "truncated shard" in out and last.name in out


def test_inspect_missing_directory(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["inspect", str(missing)]) == 1
    out = capsys.readouterr().out
    assert f"INVALID: model directory {missing} does not exist" in out


def test_inspect_bad_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"hidden_size": 1}')
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "INVALID: config.json: missing required field" in out


def test_inspect_base_format(tiny_ckpt_fp8_experts, capsys):
    assert main(["inspect", str(tiny_ckpt_fp8_experts)]) == 0
    out = capsys.readouterr().out
    assert "expert dtype fp8, scales float32" in out
    assert "VALID: all" in out and "F8_E8M0" not in out


def test_make_checkpoint_bad_override_exit_2(tmp_path, capsys):
    out = tmp_path / "bad"
    rc = main(["make-checkpoint", "--out", str(out), "--override", "o_groups=3", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "dsv4 make-checkpoint: error: config.json: field 'o_groups' (3) must divide num_attention_heads (4)" in err
    assert not out.exists() or not any(out.iterdir())


def test_usage_errors(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["make-checkpoint", "--preset", "huge", "--out", "x"])
    assert ei.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["make-checkpoint", "--preset", "tiny"])  # --out is required
    assert ei.value.code == 2 and "--out" in capsys.readouterr().err
