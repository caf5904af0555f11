"""Batch invariance of the fast kernels: one switch the tile pickers consult.

A request's decode logits must not depend on which other requests share the step (greedy output
must not change with batch composition). Kernels whose per-row arithmetic depends on the number of
rows M — split-K counts derived from M, a GEMV kernel for small M and a grouped one for larger M —
break that. With the switch on (the default), every decode-sized launch (M ≤ ``DECODE_MAX_ROWS``)
uses one tile configuration chosen from the weight shape alone; prefill-sized launches keep their
fastest tiles but the FP8 linear reduces K in the same chunks, in the same order, as at decode
sizes (a prompt prefilled alone, among others, in chunks or after a prefix-cache hit gets the same
bits; on the H200 the MMA tile shape does not change a row's value). ``DSV4_BATCH_INVARIANT=0``
(or ``set_batch_invariant(False)``) restores the fastest per-M choice (``bench/`` measures what
invariance costs).
"""

from __future__ import annotations

from .. import env

DECODE_MAX_ROWS = 64  # the largest decode batch (max_num_seqs) the fixed decode tiles cover

_enabled = env.batch_invariant()


def batch_invariant() -> bool:
    return _enabled


def set_batch_invariant(on: bool) -> bool:
    """Turn the fixed decode tiles on or off; returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    return before
