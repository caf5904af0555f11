"""One host→device copy for all of a step's small int64 inputs.

A step's token ids, logits rows, positions and page tables are built on the host. Moving each
with its own ``torch.tensor(list, device=cuda)`` is a synchronous copy from pageable memory per
tensor (a decode step made seven). Here they are packed into one int64 buffer and moved at once;
the step's tensors are views of the one device tensor.
"""

from __future__ import annotations

import array

import torch

Part = tuple[array.array, tuple[int, ...]]  # an int64 array and the shape of its tensor


def pack(parts: list[Part]) -> torch.Tensor:
    """The parts end to end as one host int64 tensor (it shares the packed array's memory)."""
    flat = array.array("q")
    for a, _ in parts:
        flat.extend(a)
    if not flat:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(flat, dtype=torch.long)


def split(flat: torch.Tensor, parts: list[Part]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``parts`` (each contiguous)."""
    out, o = [], 0
    for a, shape in parts:
        out.append(flat[o:o + len(a)].view(shape))
        o += len(a)
    return out


def upload(parts: list[Part], device, into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The parts as tensors on ``device`` with one copy (from pageable memory: for occasional
    callers; the engine's runner keeps a :class:`HostStaging`). ``into``: a device int64 buffer
    (a CUDA graph's static inputs) that receives the copy; the tensors are views of it."""
    flat = pack(parts)
    if into is None:
        return split(flat.to(device), parts)
    dest = _dest(into, flat.numel())
    dest.copy_(flat)
    return split(dest, parts)


def _dest(into: torch.Tensor, n: int) -> torch.Tensor:
    if into.dtype != torch.long or into.dim() != 1 or into.numel() < n:
        raise ValueError(f"staging target must be a 1-D int64 tensor of at least {n} values, got "
                         f"{into.dtype} {tuple(into.shape)}")
    return into[:n]


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
