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
