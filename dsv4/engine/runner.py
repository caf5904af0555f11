"""Model runner: turn a step's schedule into one batched forward and hand back logits per request.

The batch metadata (token ids, positions, per-request chunks with their cache views, which rows
need logits) is built once per step; the model is called through the :class:`ModelBackend`
interface, so a GPU backend replaces the torch reference without touching the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache.manager import KVCacheManager
from ..model.attention import SeqChunk
from .scheduler import ScheduledChunk


class ModelBackend(Protocol):
    cfg: object
    device: torch.device

    def forward(self, token_ids: torch.Tensor, chunks: list[SeqChunk], logits_rows: torch.Tensor | None = None): ...


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [T]
    chunks: list[SeqChunk]
    logits_rows: torch.Tensor  # rows of the batch whose logits are needed
    row_owner: list[tuple[int, str]]  # (index into schedule, "sample" | "prompt")


class ModelRunner:
    def __init__(self, backend: ModelBackend, kv: KVCacheManager):
        self.backend, self.kv = backend, kv
        self.device = backend.device

    def build(self, schedule: list[ScheduledChunk]) -> StepBatch:
        ids, chunks, rows, owners = [], [], [], []
        off = 0
        for si, sc in enumerate(schedule):
            req, n, start = sc.req, sc.num_tokens, sc.req.num_computed
            ids.extend(req.all_token_ids[start: start + n])
            chunks.append(SeqChunk(self.kv.view(req.alloc), start, n, offset=off, device=self.device))
            if req.params.prompt_logprobs is not None and start < len(req.prompt_token_ids) - 1:
                last = min(start + n, len(req.prompt_token_ids) - 1)
                for r in range(start, last):
                    rows.append(off + r - start)
                    owners.append((si, "prompt"))
            if start + n == req.num_tokens:  # the chunk reaches the end: sample the next token
                rows.append(off + n - 1)
                owners.append((si, "sample"))
            off += n
        return StepBatch(torch.tensor(ids, dtype=torch.long, device=self.device), chunks,
                         torch.tensor(rows, dtype=torch.long, device=self.device), owners)

    @torch.no_grad()
    def run(self, schedule: list[ScheduledChunk]) -> tuple[StepBatch, torch.Tensor]:
        batch = self.build(schedule)
        out = self.backend.forward(batch.token_ids, batch.chunks, logits_rows=batch.logits_rows)
        return batch, out.logits.float().cpu()
