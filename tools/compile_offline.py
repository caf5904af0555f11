"""Compile every Triton specialization the engine's start-up plan launches for a CUDA target, on this CPU machine.

The CPU tests run the kernels in Triton's interpreter, which executes their Python: a kernel the GPU compiler
rejects (a string constexpr default in Triton 3.6, a type the lowering does not take, a register or shared-memory
limit) passes there and fails only on a device call, where the call's minutes are gone. Here the warm-up plan of an
engine on a small checkpoint is listed under the interpreter (``dsv4.engine.precompile.list_launches``: every
launch's recipe, no kernel run) as planned for a compiled sm_ARCH device of ``--sms`` SMs (``_common.plan_for``:
the GPU's tiles, K chunks, decode paths and ``INTERP`` False, not the interpreter's), then each distinct
specialization is compiled for sm_ARCH with the ptxas Triton
ships (``dsv4.ops.compiles.build_offline``), in parallel; failures are printed by kernel with the compiler's
message, and the exit status is 1 if any. Run it with the Triton version of the device image for its verdict
(compile errors differ between versions). The engine's settings pick the tiles, so other settings may meet other
specializations (``--act-quant``, ``--set MODULE.NAME=JSON`` as ``bench/e2e.py``'s).

    python tools/compile_offline.py                  # a tiny checkpoint written to a temporary folder
    python tools/compile_offline.py --ckpt DIR --arch 90 --jobs 4 \
        --set dsv4.ops.triton.fp8_linear.ACT_QUANT_FP8_MMA=true
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def apply_settings(items: list[str]) -> None:
    """``bench/e2e.py``'s ``--set`` items (``MODULE.NAME=JSON``, one definition of their form and checks)."""
    if not items:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "e2e.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    e2e.apply_settings(items)


def list_recipes(ckpt: str, out: str, act_quant: bool, settings: list[str], arch: int, sms: int) -> None:
    """(Run under TRITON_INTERPRET=1.) Pickle the recipes of the start-up plan's launches to ``out``, planned as
    for a compiled sm_ARCH device of ``sms`` SMs (``plan_for``: the GPU's tiles, chunks and constexprs)."""
    from dsv4.engine.precompile import list_launches
    from dsv4.llm import LLM
    from dsv4.ops.triton._common import plan_for

    apply_settings(settings)
    llm = LLM(ckpt, backend="triton", kv_cache_dtype="fp8_ds_mla", dtype="bfloat16", enforce_eager=True,
              max_model_len=512, kv_cache_memory=1 << 28, max_num_seqs=8, max_num_batched_tokens=1024,
              warm_up=False, act_quant=act_quant)
    with plan_for(sms, divmod(arch, 10)):
        recipes = list(list_launches(llm.engine, None).recipes.values())
    with open(out, "wb") as f:
        pickle.dump(recipes, f)


def _build(args: tuple) -> tuple[str, str | None]:
    rec, arch = args
    from dsv4.ops import compiles

    try:
        return compiles.build_offline(rec, arch), None
    except Exception as e:  # noqa: BLE001 - the compiler's own error is the report
        return rec[1], f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:400] if str(e).strip() else ''}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="checkpoint folder (default: the tiny preset, written to a temporary folder)")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: sm_90a)")
    ap.add_argument("--sms", type=int, default=132, help="SM count the launches are planned for (132: H100, H200)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--act-quant", action="store_true", help="the engine with the release's FP8 activations")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=JSON")
    ap.add_argument("--list-only", metavar="OUT", help=argparse.SUPPRESS)  # the interpreted listing step
    a = ap.parse_args()
    if a.list_only:
        list_recipes(a.ckpt, a.list_only, a.act_quant, a.set, a.arch, a.sms)
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the compile step needs Triton's JIT kernels")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.ckpt
        if ckpt is None:
            ckpt = os.path.join(tmp, "tiny")
            subprocess.run([sys.executable, "-m", "dsv4.cli", "make-checkpoint", "--preset", "tiny", "--out", ckpt,
                            "--quiet"], check=True, cwd=ROOT)
        listing = os.path.join(tmp, "recipes.pkl")
        t0 = time.time()
        cmd = [sys.executable, __file__, "--ckpt", ckpt, "--list-only", listing, "--arch", str(a.arch), "--sms",
               str(a.sms)]
        cmd += [arg for item in a.set for arg in ("--set", item)]
        if a.act_quant:
            cmd.append("--act-quant")
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"})
        with open(listing, "rb") as f:
            recipes = pickle.load(f)
    print(f"{len(recipes)} specializations of {len({r[1] for r in recipes})} kernels listed in "
          f"{time.time() - t0:.0f} s; compiling for sm_{a.arch} in {a.jobs} processes", flush=True)
    t0 = time.time()
    with ProcessPoolExecutor(a.jobs, initializer=apply_settings, initargs=(a.set,)) as pool:
        results = list(pool.map(_build, [(r, a.arch) for r in recipes]))
    failed = [(name, err) for name, err in results if err]
    for name, err in failed:
        print(f"FAILED {name}: {err}")
    print(f"{len(results) - len(failed)} compiled, {len(failed)} failed in {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
