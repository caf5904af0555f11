"""Which data-parallel rank takes a new request: the least loaded, prefix-cache affinity breaking ties.

Load is the number of the rank's unfinished requests (every request it holds is one the front end
sent it, and the front end sees each finish or abort). Among the least-loaded ranks a prompt goes
where the longest run of its leading 256-token blocks was sent before — a rank's prefix cache can
only hold blocks of prompts it computed — else to the lowest rank. The remembered blocks are the
prompts' full blocks, as the ranks' caches hash them (``KVCacheManager.chain_hashes``), the most
recent ``memory`` per rank; a rank may have evicted some since, so affinity is a hint, never a
promise.
"""

from __future__ import annotations

from collections import OrderedDict

from ..cache.manager import KVCacheManager
from ..model.step import BLOCK


class RankBalancer:
    def __init__(self, n_ranks: int, memory: int = 8192):
        self.load = [0] * n_ranks
        self.memory = memory
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_ranks)]

    @staticmethod
    def _hashes(token_ids: list[int]) -> list[int]:
        return KVCacheManager.chain_hashes(token_ids, len(token_ids) // BLOCK)

    def pick(self, token_ids: list[int]) -> int:
        low = min(self.load)
        ranks = [r for r, n in enumerate(self.load) if n == low]
        if len(ranks) > 1 and len(token_ids) > BLOCK:
            hashes = self._hashes(token_ids)

            def run(r: int) -> int:
                seen = self._blocks[r]
                return next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))

            best = max(run(r) for r in ranks)
            ranks = [r for r in ranks if run(r) == best]
        return ranks[0]

    def added(self, rank: int, token_ids: list[int]) -> None:
        self.load[rank] += 1
        seen = self._blocks[rank]
        for h in self._hashes(token_ids):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.memory:
            seen.popitem(last=False)

    def removed(self, rank: int) -> None:
        self.load[rank] -= 1
