"""Weights into L2 ahead of the GEMM that reads them (CUDA sm_90, inside a decode graph).

A decode step's GEMMs at batch 1 read each weight once; a launch spends a few microseconds filling
its pipeline from HBM before the bytes flow at full rate, and between the large GEMMs the step runs
latency-bound kernels (the mHC gates, the attention) that leave the HBM idle. ``prefetch_l2`` issues,
on a side stream beside those kernels, the bulk L2 prefetches (``cp.async.bulk.prefetch.L2``: the
copy engine fetches a byte range into L2, no register or shared-memory destination) of the weights
the next GEMMs read, so that they read L2. A prefetch changes no value: it only moves bytes into a
cache.

One launch covers up to ``MAX_TENSORS`` tensors (program axis 1), each cut into ranges of ``PER``
bytes (one instruction each). Only where it can run: CUDA sm_90+, compiled (the interpreter and other
GPUs have no bulk prefetch), ``ENABLED``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _device_facts, interpreting

__all__ = ["prefetch_l2", "supported", "ENABLED"]

ENABLED = True  # False: prefetch nothing (A/B: --set dsv4.ops.triton.prefetch.ENABLED=false)
MAX_TENSORS = 4
PER = 16384  # bytes per bulk prefetch (a multiple of 16)
BLOCK = 256  # prefetches per program
EVICT_LAST = False  # issue with an L2 evict_last policy (kept lines outlive streaming reads)
_built: set = set()  # devices the kernel was built for outside a capture

_ASM = {
    False: """{
        .reg .pred p;
        setp.ne.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
    }""",
    True: """{
        .reg .pred p;
        .reg .b64 pol;
        createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
        setp.ne.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
        mov.u32 $0, 0;
    }""",
}


@triton.jit(do_not_specialize=["b0", "n0", "b1", "n1", "b2", "n2", "b3", "n3"])  # one build for every weight
def _prefetch_kernel(b0, n0, b1, n1, b2, n2, b3, n3, PER: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
    t = tl.program_id(1)
    base = tl.where(t == 0, b0, tl.where(t == 1, b1, tl.where(t == 2, b2, b3)))
    nbytes = tl.where(t == 0, n0, tl.where(t == 1, n1, tl.where(t == 2, n2, n3)))
    off = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * PER
    size = tl.minimum(tl.maximum(nbytes - off, 0), PER) // 16 * 16  # the last < 16 bytes are left out
    tl.inline_asm_elementwise(ASM, "=r,l,r", [base + off, size.to(tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


def supported(device: torch.device) -> bool:
    """Whether ``prefetch_l2`` issues anything on ``device``."""
    if not ENABLED or device.type != "cuda" or interpreting():
        return False
    _, cap, hip = _device_facts(device.index if device.index is not None else torch.cuda.current_device())
    return not hip and cap >= (9, 0)


def _ranges(ts: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(16-byte aligned start, bytes) of each tensor's memory (a bulk prefetch needs an aligned start)."""
    out = []
    for t in ts:
        if not t.is_contiguous():
            raise ValueError(f"prefetch_l2 needs contiguous tensors, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")
        start = t.data_ptr()
        out.append((start - start % 16, start % 16 + t.numel() * t.element_size()))
    return out


def prefetch_l2(*tensors: torch.Tensor | None, launch: bool | None = None) -> None:
    """Issue L2 prefetches of the bytes of ``tensors`` (each contiguous; None and empty ones skipped) on
    the current stream; the launch returns at once (the copy engine fetches them while later kernels run).

    ``launch`` (default: whether the current stream is capturing a CUDA graph): outside a capture the
    kernel is only built, so that an eager step (host-bound: a launch costs more there than it saves)
    issues nothing while the warm-up before a capture still builds the kernel the graph launches."""
    ts = [t for t in tensors if t is not None and t.numel()]
    if not ts or not supported(ts[0].device):
        return
    pairs = _ranges(ts)
    if launch is None:
        launch = torch.cuda.is_current_stream_capturing()
    for i in range(0, len(pairs), MAX_TENSORS):
        part = pairs[i: i + MAX_TENSORS]
        programs = max(triton.cdiv(n, PER * BLOCK) for _, n in part)
        part = part + [(part[0][0], 0)] * (MAX_TENSORS - len(part))  # unused slots: nothing to fetch
        args = [v for pair in part for v in pair]
        opts = dict(PER=PER, BLOCK=BLOCK, ASM=_ASM[EVICT_LAST], num_warps=4)
        if launch:
            _prefetch_kernel[(programs, len(pairs[i: i + MAX_TENSORS]))](*args, **opts)
        elif ts[0].device not in _built:  # one build (a warm-up call costs host time like a launch)
            _prefetch_kernel.warmup(*args, grid=(1, 1), **opts)
            _built.add(ts[0].device)
