"""``bench/kernels_persistent.py``: the persistent chain computes what the chain of launches does.

The sweep times one persistent launch (grid barriers between dependent stages) against one launch a stage on
the GPU; its bit comparison there is only meaningful if both forms run the same tiles. Here (interpreter, one
program, so the barrier never waits) the chain equals the launches bit for bit, the launches equal the FP8
linear reference (bf16 weights from the e4m3 codes and UE8M0 scales, fp32 sums) within fp32 summation order,
and the barrier counts one arrival a stage.
"""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: Triton kernel tests skipped")

from ops_kernel_helpers import DEV, gen  # noqa: E402

from dsv4.formats import dequantize_block_fp8  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernels_persistent as kp  # noqa: E402


@pytest.mark.skipif(DEV != "cpu", reason="one program (the interpreter's order); the GPU sweep checks its own bits")
def test_chain_in_one_launch_equals_the_launches_and_the_reference():
    L, N, K = 3, 256, 128
    w, s = kp.fp8_stages(L, N, K, DEV, gen(0))
    buf = torch.zeros(L + 1, N, dtype=torch.bfloat16)
    buf[0].uniform_(-1, 1, generator=gen(1))
    launches = kp.gemv_launches(buf.clone(), w, s)
    cnt = torch.zeros(1, dtype=torch.int32)
    chain = kp.gemv_persistent(buf.clone(), w, s, 1, True, cnt)
    assert torch.equal(chain, launches) and cnt.item() == L
    x = buf[0, :K]
    for i in range(L):
        wd = dequantize_block_fp8(w[i], s[i].view(torch.float8_e8m0fnu), out_dtype=torch.bfloat16).float()
        y = wd @ x.float()
        bound = 1e-5 * (wd.abs() @ x.float().abs()) + 2.0**-8 * y.abs()  # fp32 order, then one bf16 rounding
        assert ((launches[i + 1].float() - y).abs() <= bound).all(), i
        x = launches[i + 1, :K]
    tiny = torch.zeros(L + 1, 4096)
    tiny[0].uniform_(-1, 1, generator=gen(2))
    cnt.zero_()
    kp._tiny_chain_kernel[(1,)](tiny, cnt, L, 1, BLOCK=4096)
    want = tiny[0]
    for _ in range(L):
        want = want * 1.0001 + 1.0
    assert cnt.item() == L and torch.allclose(tiny[L], want, rtol=1e-6, atol=0)
