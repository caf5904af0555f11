"""``compiles.build_offline``: a launch's recipe compiled for sm_90a on a CPU machine, with Triton's own ptxas
(``tools/compile_offline.py`` does it for a whole start-up plan): what the interpreter cannot show is whether a
kernel builds for the GPU."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")
pytest.importorskip("triton.backends.nvidia.compiler", reason="this Triton has no CUDA backend")

from dsv4.ops import compiles  # noqa: E402
from dsv4.ops.triton import fp8_linear as tfl  # noqa: E402

BUILD = """
import pickle, sys
from dsv4.ops import compiles
good, bad = pickle.load(open(sys.argv[1], "rb"))
print("built", compiles.build_offline(good, 90))
try:
    compiles.build_offline(bad, 90)
except Exception as e:
    print("refused", type(e).__name__)
"""


def test_a_recorded_launch_builds_for_sm90_and_a_bad_one_is_refused(tmp_path):
    """The act_quant codes launch as the op makes it, recorded without running (``recording``), builds for sm_90a
    in a process without the interpreter; the same recipe with a block count that is not a power of two is refused
    by the compiler (the error reaches the caller)."""
    with compiles.recording(launch=False) as rec:
        tfl.act_quant_codes(torch.zeros(3, 384, dtype=torch.bfloat16))
    (good,) = rec.recipes.values()
    assert good[1] == "_act_quant_kernel" and good[2]["CODES"] == ("value", True)
    bad = (good[0], good[1], {**good[2], "NB": ("value", 3)})
    path = tmp_path / "recipes.pkl"
    path.write_bytes(pickle.dumps((good, bad)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", BUILD, str(path)], env={**env, "TRITON_DEFAULT_FP_FUSION": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["built", "_act_quant_kernel", "refused", "CompilationError"], out.stdout


def test_launches_planned_for_a_compiled_device_take_its_tiles_and_paths():
    """Inside ``plan_for`` the host code plans a launch as for a compiled sm_90 device of 132 SMs whatever the
    tensors' device: the FP8 linear's decode launch of wo_b's shape takes the K chunks of 132 SMs (8 partials and the
    in-launch sum), the hardware e4m3 decode and the MMA path (not the interpreter's), and the MXFP4 experts the PTX
    decode; outside, the process's own facts are back."""
    from ops_kernel_helpers import gen, mxfp4_experts

    from dsv4.formats import quantize_block_fp8
    from dsv4.formats.experts import stack_experts
    from dsv4.ops.triton import _common
    from dsv4.ops.triton import moe as tmoe

    before = (_common.interpreting(), _common.num_sms(torch.device("cpu")))
    w, s = quantize_block_fp8(torch.randn(4096, 8192) * 0.02)
    layer = stack_experts(*mxfp4_experts(8, 256, 128, gen(1)))
    ids = torch.tensor([[0, 3, 5, 6, 1, 2]])
    with _common.plan_for(132, (9, 0)), compiles.recording(launch=False) as rec:
        assert not _common.interpreting() and _common.num_sms(torch.device("cpu")) == 132
        tfl.fp8_linear(torch.zeros(1, 8192, dtype=torch.bfloat16), w, s)
        tmoe.moe_experts(torch.zeros(1, 256, dtype=torch.bfloat16), ids, torch.full((1, 6), 1 / 6), *layer)
    assert (_common.interpreting(), _common.num_sms(torch.device("cpu"))) == before
    named = {r[1]: {k: v[1] for k, v in r[2].items()} for r in rec.recipes.values()}
    lin = named["_fp8_linear_kernel"]
    assert lin["CHUNK"] == tfl.BLOCK * 8 and lin["N_PARTS"] == 8 and lin["FIXUP"], lin
    assert lin["NATIVE"] and not lin["INTERP"] and not lin["DOT_F32"], lin
    up = named["_moe_up_kernel"]
    assert up["PTX_FP4"] and not up["INTERP"] and not up["DOT_F32"], up
