"""What a kernel boundary costs a decode step (``bench/kernels.py --sweep --only persistent``).

A batch-1 decode step is a chain of dependent launches (about 17 a layer on the critical path), each a few
µs longer than its bytes. This sweep measures whether one persistent launch per chain (a program per SM
looping over the stages, a grid barrier between dependent stages) would remove that cost, before any
model kernel is rewritten that way:

* ``tiny``: L stages of one small program each (a 4,096-value vector op), as L launches of a CUDA graph
  and as one persistent launch whose programs meet at a grid barrier after every stage: the cost of a
  boundary itself (launch, fill, drain) against the barrier's.
* ``gemv``: L dependent FP8 decode GEMMs with the decode tile's arithmetic (``fp8_linear._dequant_tile``:
  e4m3 bytes × UE8M0 block scale → bf16, a 64-row weight tile times the token padded to 16 rows, swap-AB,
  whole-K chunks), each reading the first K outputs of the one before: [N, K] = [16384, 1024] weights (16 MiB,
  wq_b's K and tile count), as L launches and as one persistent launch, with and without an L2 prefetch of
  the program's next-stage weight lines issued before the barrier (weights do not depend on the stage before,
  so a persistent program can ask for them while it waits). Every variant's outputs are compared bit for bit
  with the launches' (the same tiles, the same order).

Bound: the stages' weight bytes over the copy bandwidth measured in the same run. The persistent launch needs
all its programs resident at once (the barrier waits for every one): one or two programs per SM (the GEMV chain
takes 111 registers and 28 KB of shared memory a program on sm_90a), nothing else running.
Under the interpreter (CPU smoke test) programs run one after another, so the persistent launch runs with one
program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.triton._common import cast, interpreting, native_fp8, prefetchable
from dsv4.ops.triton.dense import dot_acc
from dsv4.ops.triton.fp8_linear import _dequant_tile

BLOCK_N = 64  # the FP8 decode launch's tile at batch 1 (``fp8_linear.decode_block_m``): 64 weight rows, the token
_BN, _BM, _BK = tl.constexpr(BLOCK_N), tl.constexpr(16), tl.constexpr(128)  # padded to 16 rows, K steps of 128


# polls before a barrier gives up (~tens of ms): a program that never became resident must not hang the device
# call; the chain's bits then differ from the launches' and the row says so
SPIN_LIMIT = tl.constexpr(1 << 16)


@triton.jit
def _grid_barrier(cnt_ptr, target):
    """Wait until ``target`` programs have arrived at ``cnt_ptr`` (monotonic: stage s waits for P·(s+1)).
    One thread per program counts (Triton runs a scalar atomic once a program); the CTA barriers order the
    program's stores before its arrival and its later loads after the others' arrivals."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    tl.debug_barrier()


@triton.jit
def _l2_prefetch(ptrs, ON: tl.constexpr):
    """Ask for the lines of ``ptrs`` in L2 without waiting (PTX ``prefetch.global.L2``; nothing when not ON)."""
    if ON:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _gemv_tile(x_ptr, w_ptr, s_ptr, y_ptr, tile, K, NATIVE: tl.constexpr, INTERP: tl.constexpr):
    """y[tile·64 .. +64] = W[tile rows] · x[:K] for one token (row 0 of a 16-row operand), as the FP8 decode
    launch forms it: e4m3 × UE8M0 block scale rounded to bf16, fp32 accumulation over K steps of 128. x is
    read past L1 (``.cg``): another program of the same launch may have written it (the persistent chain)."""
    offs_n = tile * _BN + tl.arange(0, _BN)
    offs_m = tl.arange(0, _BM)
    offs_k = tl.arange(0, _BK)
    acc = tl.zeros((_BN, _BM), dtype=tl.float32)
    for k0 in range(0, K, _BK):
        x = tl.load(x_ptr + offs_m[:, None] * 0 + (k0 + offs_k)[None, :], mask=(offs_m < 1)[:, None], other=0.0,
                    cache_modifier=".cg")
        wb = tl.load(w_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :])
        sb = tl.load(s_ptr + (offs_n // 128) * (K // 128) + k0 // 128)
        w = _dequant_tile(wb, sb, tl.bfloat16, True, NATIVE, False, INTERP)
        if INTERP:
            acc = dot_acc(w, tl.trans(x), acc, True, INTERP)
        else:
            acc += tl.dot(w, tl.trans(x))
    out = tl.sum(tl.where((offs_m == 0)[None, :], acc, 0.0), axis=1)  # the token's column (others are 0)
    tl.store(y_ptr + offs_n, cast(out, tl.bfloat16, INTERP))


@triton.jit
def _gemv_stage_kernel(x_ptr, w_ptr, s_ptr, y_ptr, K, NATIVE: tl.constexpr, INTERP: tl.constexpr):
    _gemv_tile(x_ptr, w_ptr, s_ptr, y_ptr, tl.program_id(0), K, NATIVE, INTERP)


@triton.jit
def _gemv_chain_kernel(buf_ptr, w_ptr, s_ptr, cnt_ptr, L, N, K, P, NATIVE: tl.constexpr, INTERP: tl.constexpr,
                       PREFETCH: tl.constexpr):
    """L stages in one launch of P programs: stage s reads buf[s][:K] and writes buf[s + 1][:N] with weight s,
    program p taking tiles p, p + P, ...; a grid barrier between stages. PREFETCH: before the barrier the
    program asks L2 for the weight lines of its first tile of the next stage."""
    pid = tl.program_id(0)
    tiles = N // _BN
    rows = tl.arange(0, _BN)
    for s in range(0, L):
        w_s = w_ptr + s * N * K  # (int32 offsets: the sweep's L·N·K < 2^31)
        s_s = s_ptr + s * (N // 128) * (K // 128)
        for tile in range(pid, tiles, P):
            _gemv_tile(buf_ptr + s * N, w_s, s_s, buf_ptr + (s + 1) * N, tile, K, NATIVE, INTERP)
        if s + 1 < L:
            nxt = w_ptr + (s + 1) * N * K + (pid * _BN + rows) * K
            for c in range(0, K, 128):  # one line of each of the tile's rows a step: its K bytes in K / 128 steps
                _l2_prefetch(nxt + c, PREFETCH)
        _grid_barrier(cnt_ptr, P * (s + 1))


@triton.jit
def _tiny_stage_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, cache_modifier=".cg") * 1.0001 + 1.0)


@triton.jit
def _tiny_chain_kernel(buf_ptr, cnt_ptr, L, P, BLOCK: tl.constexpr):
    """L dependent vector ops in one launch of P programs: program 0 does each stage, all meet at the barrier."""
    offs = tl.arange(0, BLOCK)
    for s in range(0, L):
        if tl.program_id(0) == 0:
            v = tl.load(buf_ptr + s * BLOCK + offs, cache_modifier=".cg")
            tl.store(buf_ptr + (s + 1) * BLOCK + offs, v * 1.0001 + 1.0)
        _grid_barrier(cnt_ptr, P * (s + 1))


def fp8_stages(L: int, N: int, K: int, dev, g) -> tuple[torch.Tensor, torch.Tensor]:
    """L random e4m3 weights [N, K] (finite codes) and UE8M0 block scales [N/128, K/128] (codes 118..121);
    N ≥ K (a stage reads the first K outputs of the one before), both multiples of 128."""
    if N < K or N % 128 or K % 128:
        raise ValueError(f"stages need N ≥ K, both multiples of 128: got N={N}, K={K}")
    w = torch.randint(0, 256, (L, N, K), device=dev, dtype=torch.uint8, generator=g)
    w = torch.where((w & 0x7F) == 0x7F, w ^ 1, w)  # no NaN codes
    s = torch.randint(118, 122, (L, N // 128, K // 128), device=dev, dtype=torch.uint8, generator=g)
    return w, s


def gemv_launches(buf: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The chain as one launch a stage (a graph of L launches when captured)."""
    L, N, K = w.shape
    native = native_fp8(buf.device)
    for i in range(L):
        _gemv_stage_kernel[(N // BLOCK_N,)](buf[i], w[i], s[i], buf[i + 1], K, NATIVE=native, INTERP=interpreting(),
                                            num_warps=4)
    return buf


def gemv_persistent(buf: torch.Tensor, w: torch.Tensor, s: torch.Tensor, programs: int, prefetch: bool,
                    cnt: torch.Tensor) -> torch.Tensor:
    """The chain as one persistent launch of ``programs`` programs (``cnt``: a zeroed int32 counter, zeroed
    again before each launch by the caller's graph)."""
    L, N, K = w.shape
    _gemv_chain_kernel[(programs,)](buf, w, s, cnt, L, N, K, programs, NATIVE=native_fp8(buf.device),
                                    INTERP=interpreting(), PREFETCH=prefetch and prefetchable(buf.device),
                                    num_warps=4)
    return buf


def sweep_persistent(dev, bench_graph, stages=(4, 16), programs_per_sm=(1, 2)) -> dict:
    """The table of the module docstring: per variant the graph µs of the chain and per stage, against the
    launches' and the bytes bound; bits compared with the launches'."""
    g = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (bench_graph(lambda: dst.copy_(src), 40) * 1e-3)  # bytes/s, read + write
    out = {"copy_GBps": bw / 1e9, "rows": []}
    print(f"persistent: copy bandwidth {bw / 1e9:.0f} GB/s, {sms} SMs", flush=True)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)

    def row(kind, L, variant, ms, base_ms, bound_us, same):
        r = dict(kind=kind, stages=L, variant=variant, us=ms * 1e3, us_per_stage=ms * 1e3 / L,
                 vs_launches=ms / base_ms, bound_us_per_stage=bound_us, same=same)
        out["rows"].append(r)
        print(f"persistent {kind:4s} L={L:3d} {variant:28s} {r['us']:8.1f} us  {r['us_per_stage']:6.2f} us/stage  "
              f"{r['vs_launches']:5.2f}x launches  bound {bound_us:5.2f} us/stage  {same}", flush=True)

    for L in stages:
        buf = torch.zeros(L + 1, 4096, device=dev, dtype=torch.float32)
        buf[0].uniform_(-1, 1, generator=g)

        def tiny_launches():
            for i in range(L):
                _tiny_stage_kernel[(1,)](buf[i], buf[i + 1], BLOCK=4096, num_warps=4)

        base = bench_graph(tiny_launches, 40)
        want = buf.clone()
        row("tiny", L, "launches (graph)", base, base, 0.0, "")
        for per in programs_per_sm:
            p = sms * per

            def tiny_chain(p=p):
                cnt.zero_()
                _tiny_chain_kernel[(p,)](buf, cnt, L, p, BLOCK=4096, num_warps=4)

            ms = bench_graph(tiny_chain, 40)
            row("tiny", L, f"persistent, {p} programs", ms, base, 0.0,
                "same bits" if torch.equal(buf, want) else "DIFFERS")

    for L in stages:
        N, K = 16384, 1024
        w, s = fp8_stages(L, N, K, dev, g)
        buf = torch.zeros(L + 1, N, device=dev, dtype=torch.bfloat16)
        buf[0].uniform_(-1, 1, generator=g)
        bound_us = (N * K + s[0].numel()) / bw * 1e6 * 2  # read once: bytes / (copy bytes per s / 2)
        base = bench_graph(lambda: gemv_launches(buf, w, s), 40)
        want = buf.clone()
        row("gemv", L, "launches (graph)", base, base, bound_us, "")
        for per in programs_per_sm:
            for pf in (False, True):
                p = sms * per

                def chain(p=p, pf=pf):
                    cnt.zero_()
                    gemv_persistent(buf, w, s, p, pf, cnt)

                buf[1:].zero_()
                ms = bench_graph(chain, 40)
                row("gemv", L, f"persistent, {p} programs{', L2 prefetch' if pf else ''}", ms, base, bound_us,
                    "same bits" if torch.equal(buf, want) else "DIFFERS")
    return {"persistent": out}
