"""``EngineStats``: what an engine's queues and counters say, as one snapshot (the server's metrics read
only this, so they need no engine internals, and a data-parallel front end sums its ranks' snapshots)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .speculative import SpecStats


@dataclass(frozen=True)
class EngineStats:
    """Counters are cumulative since the engine started (a warm-up resets them); tokens for the
    prefix cache, bytes for the host tier's copies. ``ranks``: a data-parallel engine's per-rank
    snapshots (its own fields are their sums); empty for one engine core."""

    running: int = 0
    waiting: int = 0
    waiting_ids: frozenset[str] = frozenset()  # requests none of whose sequences has been scheduled yet
    kv_cache_usage: float = 0.0  # the share of the device tier's blocks in use
    kv_blocks: int = 0
    kv_capacity_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    host_kv_cache_usage: float = 0.0  # the host tier's slots in use (0 without one)
    host_prefix_cache_queries: int = 0
    host_prefix_cache_hits: int = 0
    host_offloaded_bytes: int = 0
    host_restored_bytes: int = 0
    spec_decode: SpecStats | None = None  # a copy of the engine's; None without speculative decoding
    ranks: tuple[EngineStats, ...] = ()

    def as_dict(self) -> dict:
        """The fields, not copied (a data-parallel rank's report: plain keys)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> EngineStats:
        """``as_dict``'s inverse; other keys are ignored."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def total(cls, ranks: list[EngineStats]) -> EngineStats:
        """The data-parallel engine's snapshot: counts and capacities summed, usages weighted by each
        rank's blocks (host usage averaged), ``ranks`` kept (speculation is refused with data parallelism)."""
        counts = {f.name: sum(getattr(r, f.name) for r in ranks) for f in fields(cls) if f.type == "int"}
        blocks = counts["kv_blocks"]
        return cls(**counts, waiting_ids=frozenset().union(*(r.waiting_ids for r in ranks)),
                   kv_cache_usage=sum(r.kv_cache_usage * r.kv_blocks for r in ranks) / max(1, blocks),
                   host_kv_cache_usage=sum(r.host_kv_cache_usage for r in ranks) / max(1, len(ranks)),
                   ranks=tuple(ranks))
