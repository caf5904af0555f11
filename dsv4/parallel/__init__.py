"""Tensor, expert and data parallelism over torch.distributed (see docs/distributed.md).

Tensor parallelism: ``driver`` (rank 0: the engine's executor), ``worker`` (the other ranks),
``plan`` (the per-step message), ``shard`` (which slice of each tensor a rank reads), ``group``
(the collectives the sharded layers call). Data-parallel attention with expert parallelism:
``dp_engine`` (the front end: one engine over N ranks), ``dp_rank`` (one rank's engine core),
``balance`` (which rank takes a request), ``expert`` (the MoE all-to-all); tensor parallelism
inside the data-parallel ranks reuses ``driver`` / ``worker`` per rank (``dp_rank.Layout``).
``ranks``: rank 0's view of the other processes, for both. The engine never imports this package: its caller starts
the executor (``start_executor``) or the data-parallel engine (``start_data_parallel``)
(``dsv4.llm.build_engine``).
"""

from __future__ import annotations


def start_executor(config):
    """The multi-process executor of a parallel ``EngineConfig``: spawns the local worker ranks, loads
    rank 0's shard in this process, and returns the driver the engine runs its steps through."""
    import torch

    from .driver import TPDriver

    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return TPDriver(config, device)


def start_data_parallel(config, tokenizer=None):
    """The engine of a ``data_parallel_size`` > 1 config: spawns ranks 1 … N−1, builds rank 0's engine
    core in this process, and returns the front end (``DPEngine``: LLMEngine's interface)."""
    from .dp_engine import DPEngine

    return DPEngine(config, tokenizer)
