"""Optional kernels for the oracle's building blocks, active for the duration of one forward.

The reference model's dense GEMMs (BF16/FP32 weights: compressors, indexer head weights, the MoE
gate, the head), RMSNorms and mHC maps are plain torch. On the GPU, cuBLAS and torch's reductions
choose their algorithm from the number of rows, so a token's result would depend on the batch;
the fast path swaps in batch-invariant kernels (``dsv4.ops``: dense_linear, rms_norm,
unit_rms_norm, mhc_pre, mhc_post, mhc_post_pre: a post fused with the next pre) while
``ReferenceModel.forward`` runs, and fused chains that launch once instead of many small torch kernels
(apply_rope; unit_norm_rope: the query's norm and rotation; swiglu_act: the shared expert's clamped
SwiGLU activation; same bits). Outside a forward, or for a model built without them, nothing
changes — the oracle stays the oracle.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

KERNEL_OPS = ("dense_linear", "rms_norm", "unit_rms_norm", "mhc_pre", "mhc_post", "mhc_post_pre", "apply_rope",
              "unit_norm_rope", "swiglu_act")

_active: dict[str, Callable] = {}


def kernel(name: str) -> Callable | None:
    """The kernel standing in for building block ``name`` right now, or None (use torch)."""
    return _active.get(name)


@contextmanager
def active(ops: dict[str, Callable] | None):
    """Use ``ops`` (name → kernel) for the building blocks inside the ``with`` body."""
    global _active
    before, _active = _active, dict(ops or {})
    try:
        yield
    finally:
        _active = before
