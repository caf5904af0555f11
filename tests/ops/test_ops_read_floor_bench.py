"""``bench/kernels_read.py``: the read kernel whose launches the read-floor sweep times reads every word once.

The sweep checks one result per size on the GPU; here (the interpreter, or a GPU) its per-program xors fold to the
xor of every word for slices that do and do not divide evenly, with programs left without words.
"""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernels_read as kr  # noqa: E402


@pytest.mark.parametrize("words,programs", [(3 * kr.BLOCK, 3), (5 * kr.BLOCK + 7, 2), (kr.BLOCK + 1, 4)])
def test_read_xor_folds_to_the_xor_of_every_word(words, programs):
    src = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen(words)).to(DEV)
    out = kr.read_xor(src, programs)
    assert out.shape == (programs,) and kr.xor_all(out) == kr.xor_all(src)
    src[words // 2] ^= 1 << 7  # one bit of one word: the fold must see it
    assert kr.xor_all(kr.read_xor(src, programs)) == kr.xor_all(out) ^ (1 << 7)
