"""Fixtures for the foundation tests (config, checkpoint schema/reader/generator, CLI).

The tiny checkpoints themselves come from the session fixtures in ``tests/conftest.py``; tests that
corrupt a checkpoint copy the fixture directory first (``corrupt_copy``) and never touch the original.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from foundation_helpers import CkptCopy, flash_0423_dict, write_small
from foundation_helpers import flash_0731_dict as _flash_0731


@pytest.fixture
def flash_dict() -> dict:
    """The real 0423 Flash config.json as a dict (a fresh copy: tests may mutate it)."""
    return flash_0423_dict()


@pytest.fixture
def flash_0731_dict() -> dict:
    return _flash_0731()


@pytest.fixture
def base_dict() -> dict:
    """The Flash-Base variant: FP8 experts, float32 block scales (no expert_dtype, no scale_fmt)."""
    d = flash_0423_dict()
    d.pop("expert_dtype", None)
    d["quantization_config"].pop("scale_fmt", None)
    return d


@pytest.fixture
def corrupt_copy(tmp_path):
    """``corrupt_copy(src)`` → CkptCopy of ``src`` under tmp_path (the fixture dir stays intact)."""

    def make(src: Path) -> CkptCopy:
        dst = tmp_path / "ckpt"
        shutil.copytree(src, dst)
        return CkptCopy(dst)

    return make


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory) -> Path:
    """foundation_helpers.write_small(): 1 layer + MTP, vocab 512, 4 experts, seed 7 (about a second)."""
    return write_small(tmp_path_factory.mktemp("small") / "ckpt")
