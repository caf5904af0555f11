"""What one launch needs to read S bytes from HBM (``bench/kernels.py --sweep --only read_floor``).

A batch-1 decode step's GEMMs each read one weight of 0.25–34 MiB in one launch, one after another. The decode
bound divides those bytes by the rate of a 256 MiB copy; a launch of a few MiB cannot reach that rate (its programs
start in a ramp, wait one HBM latency for their first bytes and end unevenly). This sweep measures that floor before
a GEMM is blamed for it: one launch reading S bytes, L2 cold (each replay of the graph reads the next of enough
buffers to pass the L2 several times), by a plain Triton read (P contiguous slices, 16 KiB a program step, an xor
checksum stored so that nothing is optimized away) at 1, 2, 4 and 8 programs per SM, and by torch's sum; µs a read
and its bytes per second against the copy bandwidth of the same run. The fastest row at each size is the time a
decode launch of that weight cannot beat with that many bytes to read.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 4096  # int32 words a program step: 16 KiB
SIZES_MIB = (0.5, 2, 8, 16, 32, 64, 256)
L2_PASSES_BYTES = 512 << 20  # each size's buffers together: several times any Hopper L2 (50-60 MB)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, words_per_prog, BLOCK: tl.constexpr):
    """Program p xors words [p·words_per_prog, (p + 1)·words_per_prog) of ``src`` and stores the result at
    ``out[p]`` (every byte read once; the xor keeps the loads alive)."""
    pid = tl.program_id(0)
    lo = pid * words_per_prog
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(lo, tl.minimum(lo + words_per_prog, n_words), BLOCK):
        idx = off + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def read_xor(src: torch.Tensor, programs: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of ``programs`` programs reading the int32 words of ``src`` (contiguous): their xor per
    program ([programs] int32; the xor of those is the xor of every word)."""
    n = src.numel()
    per = math.ceil(math.ceil(n / programs) / BLOCK) * BLOCK
    out = torch.empty(programs, dtype=torch.int32, device=src.device) if out is None else out
    _read_kernel[(programs,)](src, out, n, per, BLOCK=BLOCK, num_warps=4)
    return out


def xor_all(t: torch.Tensor) -> int:
    """The xor of every int32 element of ``t`` (on the host)."""
    a = t.reshape(-1).cpu().numpy()
    return int(np.bitwise_xor.reduce(a)) if a.size else 0


def sweep_read_floor(dev, bench_graph, sizes_mib=SIZES_MIB, programs_per_sm=(1, 2, 4, 8)) -> dict:
    """The table of the module docstring: µs a read, GB/s, and the read's time over its bytes at the copy
    bandwidth (the decode bound's rate: ``bench/e2e.py`` divides a step's bytes by it)."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (bench_graph(lambda: dst.copy_(src), 40) * 1e-3)  # bytes/s, read + write
    src = dst = None  # freed (the timed closure above refers to them)
    out = {"copy_GBps": bw / 1e9, "sms": sms, "rows": []}
    print(f"read_floor: copy bandwidth {bw / 1e9:.0f} GB/s, {sms} SMs", flush=True)
    for mib in sizes_mib:
        nbytes = int(mib * (1 << 20))
        count = max(2, math.ceil(L2_PASSES_BYTES / nbytes))
        bufs = torch.randint(-(2**31), 2**31 - 1, (count, nbytes // 4), device=dev, dtype=torch.int32)
        for per in tuple(programs_per_sm) + (None,):
            if per is None:
                name, flat = "torch sum", bufs.view(torch.float32)  # the same bytes as floats: sum reads them all

                def reads(flat=flat):
                    for i in range(count):
                        flat[i].sum()
            else:
                name, res = f"triton, {per} programs an SM", torch.empty(count, sms * per, dtype=torch.int32,
                                                                          device=dev)

                def reads(res=res, per=per, bufs=bufs):
                    for i in range(count):
                        read_xor(bufs[i], sms * per, res[i])
            ms = bench_graph(reads, 40) / count
            check = "" if per is None else ("checked" if xor_all(res[-1]) == xor_all(bufs[-1]) else "WRONG")
            row = dict(MiB=mib, variant=name, us=ms * 1e3, GBps=nbytes / (ms * 1e-3) / 1e9,
                       x_bound=ms * 1e-3 / (nbytes / bw), check=check)
            out["rows"].append(row)
            print(f"read_floor {mib:6.1f} MiB {name:26s} {row['us']:8.2f} us  {row['GBps']:7.0f} GB/s  "
                  f"{row['x_bound']:5.2f}x its bytes at the copy bandwidth  {check}", flush=True)
        bufs = flat = res = None
        torch.cuda.empty_cache()
    return {"read_floor": out}
