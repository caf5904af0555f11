"""The engine on the GPU fast path (batched paged attention, Triton kernels, CUDA graphs) against
the engine on the torch path (reference attention, torch ops), both bf16 on the GPU, for the
engine regression prompts (lengths around every page/window/block boundary, decoding across them).

Greedy tokens must agree wherever the torch path's top-2 margin exceeds the tolerance
(``gpu_greedy.TOL``).
"""

import pytest
import torch
from gpu_greedy import assert_greedy_agrees, greedy_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (5, 63, 64, 126, 129, 255, 257, 300, 600)
NEW = 12


def test_engine_gpu_fast_path_matches_torch_path(tiny_ckpt):
    fast_llm, fast = greedy_run(tiny_ckpt, LENGTHS, NEW, seed=5)
    runner = fast_llm.engine.runner
    assert runner.paged_attention and runner.graphs is not None, "fast path must be batched + graphs"
    _, ref = greedy_run(tiny_ckpt, LENGTHS, NEW, seed=5, backend="torch", attention="reference")
    checked = assert_greedy_agrees(fast, ref, LENGTHS, "the fast path (torch path: the second)")
    print(f"greedy tokens compared: {checked} of {len(LENGTHS) * NEW}")
    assert checked >= len(LENGTHS) * NEW // 2
