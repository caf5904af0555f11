"""Registers, spills and shared memory of the Triton kernels for sm_90a, compiled offline (no GPU).

Triton compiles a kernel for a named target without a device; the PTX then goes through the
``ptxas`` shipped with Triton (``ptxas-blackwell`` when the bundled one is older than the PTX),
whose ``-v`` report gives registers per thread and spill bytes. ``kWidth`` is the MMA operands'
k elements per thread (from the TTGIR): Triton picks it from the code around the dot, and on the
GPU it changes a kernel's bits (the tensor core groups products by it), so an edit that changes it
needs its bit-equality checked compiled (``docs/numerics.md`` §3). Arguments are specialized as the
JIT does at run time: integer strides equal to 1 become constants and every other integer and
pointer is marked divisible by 16 (what the real shapes give), so loads vectorize as on the GPU.
The local Triton may be newer than the device's: treat the numbers as a guide, time on the GPU.

    python bench/ptxas_usage.py moe_up:128,128,8,3 moe_down:128,128,8,3 fp8_linear:256,128,8,3

Each case is ``kernel:BLOCK_M,BLOCK_N,num_warps,num_stages`` (sparse_attention: BLOCK_H,BLOCK_N,...).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def _kernels():
    """name -> (kernel, pointer element types, float args, integer args that are 1, constexprs(bm, bn))."""
    from dsv4.ops.triton import fp8_linear, mhc, moe, sparse_attention

    fp4 = dict(BLOCK_K=128, FP4=True, SCALE_UE8M0=True, NATIVE=False, FNUZ=False, DOT_F32=False, INTERP=False,
               PTX_FP4=True)
    return {
        "moe_up": (moe._moe_up_kernel,
                   dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", h_ptr="*bf16", slot_ptr="*i32", bexp_ptr="*i32"),
                   {"limit"}, {"stride_wk", "stride_sk", "stride_xh", "stride_hi"}, {"TOPK", "S3_ROW"},
                   lambda a, b: dict(fp4, BLOCK_M=a, BLOCK_N=b, ROWS=a, PART=0)),
        "moe_down": (moe._moe_down_kernel,
                     dict(h_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", y_ptr="*bf16", slot_ptr="*i32", bexp_ptr="*i32"),
                     set(), {"stride_wk", "stride_sk", "stride_hi", "stride_yh"}, set(),
                     lambda a, b: dict(fp4, BLOCK_M=a, BLOCK_N=b, ROWS=a, PART=0)),
        "fp8_linear": (fp8_linear._fp8_linear_kernel,
                       dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", y_ptr="*bf16"),
                       set(), {"stride_xk", "stride_wk", "stride_sk", "stride_yn"}, {"CHUNKS_PER_PROGRAM"},
                       lambda a, b: dict(_linear_consts(a, b), ONE_CHUNK=False)),
        "fp8_linear_1": (fp8_linear._fp8_linear_kernel,  # one K chunk per program (split mode, small K)
                         dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", y_ptr="*bf16"),
                         set(), {"stride_xk", "stride_wk", "stride_sk", "stride_yn"}, {"CHUNKS_PER_PROGRAM"},
                         lambda a, b: dict(_linear_consts(a, b), ONE_CHUNK=True)),
        "mhc_post_mix": (mhc._post_mix_kernel,  # tile = (MIX_BLOCK_T, MIX_BLOCK_K); SPLIT 256, n = 4
                         dict(s_ptr="*bf16", o_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", y_ptr="*bf16",
                              fn_ptr="*fp32", part_ptr="*fp32"), set(), set(), set(),
                         lambda a, b: dict(N=4, NMIX=24, NMIX_P=32, SPLIT=256, BLOCK_T=a, BLOCK_K=b, BF16X3=True,
                                           INTERP=False)),
        "sparse_attention": (sparse_attention._sparse_attn_kernel, _attn_ptrs(sparse_attention), {"scale_log2"},
                             None, set(), lambda a, b: _attn_consts(a, b)),
        "sparse_attention_pre": (sparse_attention._sparse_attn_kernel,  # the predecoded form: bf16 pages
                                 _attn_ptrs(sparse_attention, pages="*bf16"), {"scale_log2"}, None, set(),
                                 lambda a, b: dict(_attn_consts(a, b), DENSE=True, AHEAD=False)),
    }


def _linear_consts(bm, bn):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, SCALE_UE8M0=True, NATIVE=True, FNUZ=False,
                DOT_F32=False, INTERP=False, ACT_QUANT=False, Q_MANT=0, Q_EXP=0, MIN_E=0)


def _attn_ptrs(mod, pages="*u8"):
    kinds = {"q_ptr": "*bf16", "out_ptr": "*bf16", "sink_ptr": "*fp32", "swa_ptr": pages, "comp_ptr": pages,
             "ones_ptr": "*u8"}
    return {n: kinds.get(n, "*i32") for n in mod._sparse_attn_kernel.arg_names if n.endswith("_ptr")}


def _attn_consts(bh, bn):
    return dict(BLOCK_H=bh, BLOCK_N=bn, QP=1, PP=2, KEYS_F32=False, DENSE=False, FNUZ=False, NATIVE=True,
                INTERP=False, AHEAD=True, KEEP=False)  # the engine's form: bf16 q over FP8 records


def _ptxas() -> str:
    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (base / name).exists():
            return str(base / name)
    return "ptxas"


def usage(name: str, a: int, b: int, warps: int, stages: int) -> dict:
    fn, ptrs, floats, ones, nodiv, consts_of = _kernels()[name]
    consts = consts_of(a, b)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    for prm in fn.params:  # constexprs left at their defaults (a new tuning flag) stay constexprs
        if prm.is_constexpr and prm.name not in consts and prm.default is not inspect.Parameter.empty:
            consts[prm.name] = prm.default
    if ones is None:  # every stride_*_d / stride_*_dim of the attention: innermost, 1
        ones = {n for n in fn.arg_names if n.startswith("s_") and n.endswith("dim")}
    for n in ones:
        consts.setdefault(n, 1)
    sig = {}
    for n in fn.arg_names:
        sig[n] = "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] not in ("constexpr", "fp32") and n not in nodiv}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        rep = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", rep)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
    return dict(kernel=name, tile=(a, b), num_warps=warps, num_stages=stages,
                registers=int(regs[0]) if regs else None,
                spill_store=int(spill[0][0]) if spill else None, spill_load=int(spill[0][1]) if spill else None,
                shared=k.metadata.shared, wgmma=k.asm["ptx"].count("wgmma.mma_async"),
                mma_sync=k.asm["ptx"].count("mma.sync"),
                kwidth=sorted({int(v) for v in re.findall(r"kWidth = (\d+)", k.asm["ttgir"])}),
                waits=[int(v) for v in re.findall(r"warp_group_dot_wait .*pendings = (\d+)", k.asm["ttgir"])],
                converts=k.asm["ttgir"].count("ttg.convert_layout"), local_allocs=k.asm["ttgir"].count("local_alloc"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="kernel:A,B,num_warps,num_stages")
    args = ap.parse_args(argv)
    print(f"{'kernel':18s} {'tile':>9s} {'warps':>5s} {'stages':>6s} {'regs':>5s} {'spill st/ld':>12s} "
          f"{'smem':>7s} {'wgmma':>5s} {'mma':>4s} {'kWidth':>6s} {'cvt':>4s} {'alloc':>5s} wgmma waits (pendings)")
    for case in args.cases:
        name, _, nums = case.partition(":")
        a, b, w, s = (int(v) for v in nums.split(","))
        try:
            r = usage(name, a, b, w, s)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
            print(f"{name:18s} {a}x{b:<6d} {w:5d} {s:6d}  {type(e).__name__}: {str(e)[:120]}")
            continue
        print(f"{name:18s} {a}x{b:<6d} {w:5d} {s:6d} {r['registers']!s:>5s} "
              f"{r['spill_store']!s:>5s}/{r['spill_load']!s:<6s} {r['shared']:7d} {r['wgmma']:5d} {r['mma_sync']:4d} "
              f"{','.join(map(str, r['kwidth'])) or '-':>6s} {r['converts']:4d} {r['local_allocs']:5d} "
              f"{','.join(map(str, r['waits'])) or '-'}",
              flush=True)


if __name__ == "__main__":
    main()
