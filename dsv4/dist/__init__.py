"""Tensor and expert parallelism over torch.distributed (see docs/distributed.md).

``driver`` (rank 0, inside the engine), ``worker`` (the other ranks), ``plan`` (the per-step
message), ``shard`` (which slice of each tensor a rank reads), ``group`` (the collectives the
model calls), ``errors`` (``EngineDeadError``). Nothing here is imported at tensor_parallel_size=1
except ``errors`` (by the server).
"""
