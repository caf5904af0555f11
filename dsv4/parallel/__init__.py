"""Tensor and expert parallelism over torch.distributed (see docs/distributed.md).

``driver`` (rank 0: the engine's executor), ``worker`` (the other ranks), ``plan`` (the per-step
message), ``shard`` (which slice of each tensor a rank reads), ``group`` (the collectives the model
calls). The engine never imports this package: its caller starts the executor (``start_executor``)
and hands it over (``dsv4.llm.build_engine``).
"""

from __future__ import annotations


def start_executor(config):
    """The multi-process executor of a parallel ``EngineConfig``: spawns the local worker ranks, loads
    rank 0's shard in this process, and returns the driver the engine runs its steps through."""
    import torch

    from .driver import TPDriver

    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return TPDriver(config, device)
