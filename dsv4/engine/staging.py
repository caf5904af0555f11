"""One host→device copy for all of a step's small int64 inputs, from a reused pinned buffer.

A step's token ids, logits rows, positions and page tables are built on the host. Moving each
with its own ``torch.tensor(list, device=cuda)`` is a synchronous copy from pageable memory per
tensor (a decode step made seven). Here they are packed into one int64 buffer and moved at once;
the step's tensors are views of the one device tensor.
"""

from __future__ import annotations

import torch

from ..model.step import Part, _dest, pack, split, upload


class HostStaging:
    """A reused host buffer for :func:`upload`: pinned on CUDA, so the copy is asynchronous.

    The buffer is rewritten every step, so the next step first waits for the previous copy to
    have read it (an event recorded after the copy; normally long done, as the step's sampled
    tokens came back since). On the CPU the packed tensor is used as it is: every step gets
    its own memory, so tensors a caller keeps are never overwritten.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self._pinned: torch.Tensor | None = None
        self._copied = None  # torch.cuda.Event after the last copy out of the pinned buffer

    def upload(self, parts: list[Part], into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """As :func:`upload`; ``into`` must stay allocated (a graph's static buffer)."""
        if self.device.type != "cuda":
            return upload(parts, self.device, into)
        flat = pack(parts)
        n = flat.numel()
        if self._pinned is None or self._pinned.numel() < n:
            # the old buffer may still be read by its copy: the caching host allocator keeps it
            # until that copy's event has passed
            self._pinned = torch.empty(max(n, 4096, 2 * (0 if self._pinned is None else self._pinned.numel())),
                                       dtype=torch.long, pin_memory=True)
        elif self._copied is not None:
            self._copied.synchronize()
        self._pinned[:n].copy_(flat)
        if into is None:
            dev = self._pinned[:n].to(self.device, non_blocking=True)
        else:
            dev = _dest(into, n)
            dev.copy_(self._pinned[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return split(dev, parts)
