"""Shared Triton helpers: exact in-kernel decoders and launch facts (Triton 3.6-compatible APIs only).

Decoders work on raw bytes with integer arithmetic, so they behave the same compiled (CUDA, ROCm,
any arch) and in the CPU interpreter:

* UE8M0 byte b -> 2^(b-127): the exponent field written directly (b=0 -> 2^-127, b=255 -> NaN,
  as ``dsv4.formats.ue8m0_decode``).
* FP8 e4m3 byte -> float32: the 7 magnitude bits shifted into an fp16 (exponent and mantissa
  line up, fp16 subnormals cover e4m3 subnormals), converted exactly to fp32, times 2^8 (OCP, bias
  7) or 2^7 (FNUZ, bias 8); NaN codes restored (0x7F/0xFF OCP, 0x80 FNUZ). With ``NATIVE`` (sm_89+
  CUDA, OCP) the byte is bitcast to ``tl.float8e4nv`` and converted by the hardware.
* E2M1 nibble -> float32: sign and 3 magnitude bits shifted into an fp16 (bits 15 and 9..11),
  times 2^14: codes give 0, .5, 1, 1.5, 2, 3, 4, 6 (and -0 for code 8), as ``E2M1_VALUES``.
* MXFP4 bytes -> scaled bf16 pairs in PTX (``e2m1_bytes_to_bf16_ptx``, CUDA sm_80+ compiled only):
  the same values, 3-4 instructions per nibble instead of ~11, bit-identical to the portable path;
  ``e2m1_bytes_to_bf16_ptx_folded``: ~2 per nibble where every scale code is ≤ 128 (same bits).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ...model import branches
from ..platform import interpreting as _interpreting_now

# triton.jit reads TRITON_INTERPRET when it decorates a kernel, so this process's kernels run interpreted
# or compiled for good once these modules are imported: read once here, not on every launch
_INTERPRETED = _interpreting_now()
# The compiled CUDA device the host code plans launches for instead of this process's own (``plan_for``): (SM
# count, compute capability, ROCm), or None
_PLAN: tuple[int, tuple[int, int], bool] | None = None


@contextlib.contextmanager
def plan_for(sms: int, capability: tuple[int, int], hip: bool = False):
    """Inside: every launch is planned as for a compiled device of ``sms`` SMs and ``capability`` — tiles, K
    chunks, decode paths and constexprs (``INTERP`` False) — whatever tensors' device and the interpreter, so
    that a CPU machine lists the specializations a GPU would build (``tools/compile_offline.py``). Only for
    recording launches: a kernel run inside would run the GPU's code path in the interpreter."""
    global _PLAN
    before, _PLAN = _PLAN, (int(sms), tuple(capability), bool(hip))
    try:
        yield
    finally:
        _PLAN = before


def interpreting() -> bool:
    """Whether this process's kernels run in Triton's CPU interpreter (the kernels' modules take it from here);
    False while launches are planned for a compiled device (``plan_for``)."""
    return _INTERPRETED and _PLAN is None


@functools.lru_cache(maxsize=None)
def _device_facts(index: int):
    props = torch.cuda.get_device_properties(index)
    hip = bool(getattr(torch.version, "hip", None))
    return int(props.multi_processor_count), (int(props.major), int(props.minor)), hip


def _compiled_facts(device: torch.device):
    """(SMs, capability, ROCm) of the compiled CUDA device launches on ``device`` are planned for, else None."""
    if _PLAN is not None:
        return _PLAN
    if device.type != "cuda" or interpreting():
        return None
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    facts = _compiled_facts(device)
    return facts[0] if facts else 8  # interpreter: few programs keep the CPU tests fast


def native_fp8(device: torch.device) -> bool:
    """Hardware e4m3 (OCP) conversion: CUDA sm_89+, compiled (not the interpreter)."""
    facts = _compiled_facts(device)
    return bool(facts) and not facts[2] and facts[1] >= (8, 9)


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def prefetchable(device: torch.device) -> bool:
    """Whether kernels on ``device`` may ask for lines ahead of their loads (PTX ``prefetch``, as
    ``bench/kernels_persistent.py``'s chain does): compiled CUDA only."""
    facts = _compiled_facts(device)
    return bool(facts) and not facts[2]


def scale_kind(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor to pass, is_ue8m0): UE8M0 as uint8 bytes, other float scales as float32."""
    if scale.dtype == torch.uint8:
        return scale, True
    if _E8M0 is not None and scale.dtype == _E8M0:
        return scale.view(torch.uint8), True
    if scale.is_floating_point() and scale.dtype.itemsize > 1:
        return scale.float(), False
    raise TypeError(f"expected scales as UE8M0 (uint8 / float8_e8m0fnu) or float32, got {scale.dtype}")


def fp8_weight_bytes(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(uint8 view, is_fnuz) of an FP8 weight (float8_e4m3fn / uint8 = OCP, float8_e4m3fnuz = FNUZ)."""
    if w.dtype == torch.uint8 or w.dtype == torch.float8_e4m3fn:
        return w.view(torch.uint8), False
    if w.dtype == torch.float8_e4m3fnuz:
        return w.view(torch.uint8), True
    raise TypeError(f"expected an FP8 weight (float8_e4m3fn/fnuz or uint8), got {w.dtype}")


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """x.to(DTYPE) rounding to nearest even. The interpreter truncates fp32 -> bf16, so there the
    rounding is done on the bits first (the result is then exact in bf16)."""
    if INTERP:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def ue8m0_to_f32(b):
    """UE8M0 bytes (any int type holding 0..255) -> float32 2^(b-127), exact for every code."""
    bi = b.to(tl.int32) & 0xFF
    bits = bi << 23
    bits = tl.where(bi == 0, 0x00400000, bits)
    bits = tl.where(bi == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_to_f32(b, NATIVE: tl.constexpr, FNUZ: tl.constexpr):
    """e4m3 bytes (uint8) -> float32."""
    if NATIVE:
        v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bi = b.to(tl.int32) & 0xFF
        mag = ((bi & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if FNUZ:
            v = mag * 128.0
            nan = bi == 0x80
        else:
            v = mag * 256.0
            nan = (bi & 0x7F) == 0x7F
        # the sign as a bit: some Triton versions lower a float's unary minus as 0 - v, which turns
        # code 0x80 (OCP -0) into +0 (seen on the H200 with Triton 3.6)
        bits = v.to(tl.int32, bitcast=True) | ((bi & 0x80) << 24)
        bits = tl.where(nan, 0x7FC00000, bits)
        v = bits.to(tl.float32, bitcast=True)
    return v


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program ``pid`` in grouped order: GROUP_M row blocks share
    each weight tile while it is in L2."""
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % per_group) % gsize, (pid % per_group) // gsize


@triton.jit
def e2m1_to_f32(c):
    """E2M1 codes (int32 0..15, bit 3 = sign) -> float32 (code 8 is -0.0)."""
    h = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


def ptx_fp4(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``e2m1_bytes_to_bf16_ptx`` can decode MXFP4 for ``dtype`` activations on ``device``:
    bf16, CUDA (not ROCm) sm_80+ (``fma.rn.bf16x2``), compiled (the interpreter runs no PTX)."""
    facts = _compiled_facts(device)
    return dtype == torch.bfloat16 and bool(facts) and not facts[2] and facts[1] >= (8, 0)


@triton.jit
def e2m1_bytes_to_bf16_ptx(byte, scale):
    """(low-nibble, high-nibble) values × ``scale`` as bf16, for uint8 MXFP4 bytes and bf16 scales
    (2^(b-127), exact in bf16 for every UE8M0 code) of the same shape.

    Four bytes per invocation (one register). ``prmt`` spreads bytes 0, 1 (and 2, 3) into the low
    byte of each 16-bit half; shifts and masks put a nibble's magnitude bits at bf16 bits 6..8 and
    its sign at bit 15, which reads as code × 2^-126 (code 1, i.e. 0.5, is the bf16 subnormal
    2^-127); one ``fma.rn.bf16x2`` by 2^126 (+ -0.0) makes it exact E2M1, a second by the scale
    rounds the exact product to bf16 (RNE, subnormals kept) — the value of the portable path
    ``cast(e2m1_to_f32(code) * scale_f32, bf16)``."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, nz, c126, x0, x1, a, b;
        mov.b32 z, 0;
        mov.b32 nz, 0x80008000;
        mov.b32 c126, 0x7E807E80;
        prmt.b32 x0, $4, z, 0x4140;
        prmt.b32 x1, $4, z, 0x4342;
        shl.b32 a, x0, 6;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, x0, 12;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        fma.rn.bf16x2 a, a, c126, nz;
        fma.rn.bf16x2 $0, a, $5, nz;
        shl.b32 a, x1, 6;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, x1, 12;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        fma.rn.bf16x2 a, a, c126, nz;
        fma.rn.bf16x2 $1, a, $6, nz;
        shl.b32 a, x0, 2;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, x0, 8;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        fma.rn.bf16x2 a, a, c126, nz;
        fma.rn.bf16x2 $2, a, $5, nz;
        shl.b32 a, x1, 2;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, x1, 8;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        fma.rn.bf16x2 a, a, c126, nz;
        fma.rn.bf16x2 $3, a, $6, nz;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[byte, scale], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def e2m1_bytes_to_bf16_ptx_folded(byte, scale2):
    """``e2m1_bytes_to_bf16_ptx`` with the E2M1 bias folded into the scale: ``scale2`` is the bf16
    2^(b-1) = 2^(b-127) · 2^126, normal for every UE8M0 code b ≤ 128 (the caller checks the codes).

    Same bits as the two-multiply form for those codes: a nibble placed at bf16 bits 6..8 (sign at 15)
    reads as E2M1 × 2^-126, and its product with 2^(b-1) is E2M1 × 2^(b-127) exactly (two significant
    bits, ≥ 2^-128, ≤ 12), so the single rounding is exact, as the two of the other form are. Per output
    register: mask the nibbles, one multiply places magnitude (<< 6 or << 2) and sign (<< 12 or << 8)
    at once (the two shifted copies do not overlap), mask, one ``fma.rn.bf16x2``: 4 instructions
    instead of 6."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, nz, x0, x1, t;
        mov.b32 z, 0;
        mov.b32 nz, 0x80008000;
        prmt.b32 x0, $4, z, 0x4140;
        prmt.b32 x1, $4, z, 0x4342;
        and.b32 t, x0, 0x000F000F;
        mul.lo.u32 t, t, 0x1040;
        and.b32 t, t, 0x81C081C0;
        fma.rn.bf16x2 $0, t, $5, nz;
        and.b32 t, x1, 0x000F000F;
        mul.lo.u32 t, t, 0x1040;
        and.b32 t, t, 0x81C081C0;
        fma.rn.bf16x2 $1, t, $6, nz;
        and.b32 t, x0, 0x00F000F0;
        mul.lo.u32 t, t, 0x104;
        and.b32 t, t, 0x81C081C0;
        fma.rn.bf16x2 $2, t, $5, nz;
        and.b32 t, x1, 0x00F000F0;
        mul.lo.u32 t, t, 0x104;
        and.b32 t, t, 0x81C081C0;
        fma.rn.bf16x2 $3, t, $6, nz;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[byte, scale2], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def quant_rows(x, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr, MIN_E: tl.constexpr):
    """Per-row power-of-two-scaled FP8 quantization of an fp32 tile [R, C] (C = one 128 block): (the codes' values
    as fp32 [R, C], on the FP8 grid, and each row's scale [R]); their product is ``fake_quant_rows``.

    Bit-exact with ``dsv4.formats.fake_quant_fp8_pow2``: e = ceil(log2(max(amax,1e-4)/qmax))
    from the exponent/mantissa fields (qmax = 1.Q_MANT·2^(Q_EXP-1) in frexp terms), x·2^-e rounded
    to 3 mantissa bits half-to-even (subnormal grid below 2^MIN_E), times 2^e.
    Unlike the codec, e is clamped to [-126, 126] (amax outside ~[2^-118, 2^134] never occurs).
    """
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    ab = amax.to(tl.int32, bitcast=True)
    ea = ((ab >> 23) & 0xFF) - 126
    e = ea - Q_EXP + ((ab & 0x7FFFFF) > Q_MANT).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    q = x * inv[:, None]
    bits = tl.abs(q).to(tl.int32, bitcast=True)
    ex = ((bits >> 23) & 0xFF) - 127
    eff = tl.maximum(ex, MIN_E)
    drop = tl.minimum(20 + eff - ex, 25)
    mant = (bits & 0x7FFFFF) | 0x800000
    half = (drop * 0 + 1) << (drop - 1)
    r = (mant + (half - 1) + ((mant >> drop) & 1)) >> drop
    step = ((eff - 3 + 127) << 23).to(tl.float32, bitcast=True)
    v = r.to(tl.float32) * step
    v = tl.where(q < 0, -v, v)
    return v, scale


@triton.jit
def fake_quant_rows(x, Q_MANT: tl.constexpr, Q_EXP: tl.constexpr, MIN_E: tl.constexpr):
    """Per-row power-of-two-scaled FP8 round trip of an fp32 tile [R, C] (``quant_rows``' codes times scales)."""
    v, scale = quant_rows(x, Q_MANT, Q_EXP, MIN_E)
    return v * scale[:, None]


@triton.jit
def e4m3_bytes(v):
    """The OCP e4m3 bytes of fp32 values already on its grid (``quant_rows``' codes: exact), by integer arithmetic,
    so compiled and interpreted alike: normals (|v| ≥ 2^-6) take the exponent re-biased and the top 3 mantissa
    bits, subnormals |v|·2^9 (0..7); the sign in bit 7 (-0 -> 0x80)."""
    bits = v.to(tl.int32, bitcast=True)
    ex = ((bits >> 23) & 0xFF) - 127
    normal = ((ex + 7) << 3) | ((bits >> 20) & 7)
    sub = (tl.abs(v) * 512.0).to(tl.int32)
    return (tl.where(ex >= -6, normal, sub) | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit(do_not_specialize=["MN"])
def _sum_in_order_kernel(p_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # partial 0 first, then 1, ...: the order a single program would add them; unrolled, so the S
    # loads are in flight together (a runtime loop waits for each in turn)
    for i in tl.static_range(S):
        acc += tl.load(p_ptr + i * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, cast(acc, y_ptr.dtype.element_ty, INTERP), mask=mask)


# Split-K partials summed by each tile's last program in the GEMM's own launch (``split_sum_last``)
# instead of by a second launch (``sum_in_order``): the same additions in the same order, one launch
# fewer per split GEMM. H200, 43 layers (``bench/e2e.py``, CUDA graphs): 2,358 -> 1,909 kernels a
# decode step, batch 1 15.11 -> 14.57-14.61 ms, batch 8 20.19 -> 19.95 ms; its bits are sum_in_order's
# (tests/ops, compiled). False gives the two-launch form (``--set dsv4.ops.triton._common.SPLIT_FIXUP=false``).
SPLIT_FIXUP = True
FIXUP_ROWS = tl.constexpr(8)  # output rows the last program sums at a time (8 × BLOCK_N fp32 per partial in flight)
_COUNTERS: dict = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``split_sum_last``, one per output tile. A tile's last
    program puts its counter back to 0, so one buffer serves every launch of one stream in turn
    (CUDA-graph replays included), but not two launches at once: each lane of the model's concurrent
    branches (``dsv4.model.branches.current_lane``, a side stream each) has its own. It is made
    outside any capture (the warm-up's first launch) and replaced by a larger one only if a launch
    has more tiles (the old one stays alive for the graphs that captured it)."""
    key = (device.type, device.index, branches.current_lane())
    bufs = _COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split_counters: the arrival counters must be made before a CUDA graph captures "
                               "a split GEMM (run it once uncaptured first, as the graph warm-up does)")
        bufs.append(torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device))
    return bufs[-1]


@triton.jit
def split_sum_last(part_ptr, out_ptr, cnt_ptr, tile, m0, M, offs_n, n_mask, stride_s, stride_pm, stride_pn,
                   stride_om, stride_on, N_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   ROWS: tl.constexpr, INTERP: tl.constexpr):
    """After each program of a split GEMM stored its fp32 partial of output tile ``tile`` (rows m0..,
    columns ``offs_n``): the last to arrive (an acq_rel counter) adds the N_PARTS partials from
    s = 0 upward, ``sum_in_order``'s order and so its bits, rounds them into ``out_ptr`` and puts the
    counter back to 0. The partials are read through L2 (``.cg``): they were written by other SMs."""
    tl.debug_barrier()  # every thread's share of the partial stored before the arrival counts
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == N_PARTS - 1:
        m_end = tl.minimum(m0 + BLOCK_M, M)
        r = tl.arange(0, ROWS)
        for r0 in range(m0, m_end, ROWS):
            rows = (r0 + r).to(tl.int64)
            mask = (rows < m_end)[:, None] & n_mask[None, :]
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(N_PARTS):  # unrolled: the N_PARTS loads in flight together
                acc += tl.load(part_ptr + s * stride_s + rows[:, None] * stride_pm + offs_n[None, :] * stride_pn,
                               mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on,
                     cast(acc, out_ptr.dtype.element_ty, INTERP), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)


def sum_in_order(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = Σ_s parts[s], added from s = 0 upward in fp32 (split-K / K-chunk partials).

    A fixed order: torch.sum picks its reduction tree from the output count, which would make a
    row's value depend on how many rows share the launch. parts: contiguous fp32 [S, *out.shape].
    """
    s = parts.shape[0]
    mn = out.numel()
    block = 1024
    _sum_in_order_kernel[(triton.cdiv(mn, block),)](parts, out, mn, S=s, BLOCK=block, INTERP=interpreting(),
                                                    num_warps=4)
    return out
