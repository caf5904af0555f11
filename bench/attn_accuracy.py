"""fp32 accuracy of the Triton sparse attention on the kernel tests' scenes, against the oracle's.

Scenes built with ``tests/ops/test_ops_sparse_attention_triton.py``'s ``Scene``, fp32 queries: the
seeds of ``test_fp8_pages_fp32`` (4 heads) and ``test_dense_pages`` (fp32 pages), and two more at 16
heads (seeds 21/22; "csa dense" with fp32 pages). For each it prints the
kernel's and the torch oracle's max error relative to Σ_j p_j|v_j| (exact = float64 over the same
keys), their ratio (the test holds it ≤ 4), where the kernel's worst element is, and whether it
comes from the window or the compressed keys (the same scene with comp_idx emptied). ``--other
FILE`` adds another version of the kernel module (e.g. ``git show REV:dsv4/ops/triton/sparse_attention.py``)
and compares its bits with the current one's.

    PYTHONPATH=. python3 bench/attn_accuracy.py [--other old_sparse_attention.py]   # on the GPU
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "ops"), str(ROOT / "bench")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", help="another sparse_attention.py to compare")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from test_ops_sparse_attention_triton import LENS, QUERIES, Scene, _float64_reference, _run  # noqa: E402
    from ops_kernel_helpers import DEV, gen  # noqa: E402

    from dsv4.formats import OCP
    from dsv4.ops import torch_attention
    from dsv4.ops.triton import sparse_attention as current

    kernels = {"current": current.paged_sparse_attention}
    if args.other:
        from kernels_attention import other_attention

        kernels["other"] = other_attention(args.other)
    scenes = [("hca ocp H=4", OCP, "hca", 4, 2, 10), ("csa ocp H=4", OCP, "csa", 4, 1, 10),
              ("csa dense H=4", None, "csa", 4, 5, 13), ("csa dense H=16", None, "csa", 16, 21, 22),
              ("hca ocp H=16", OCP, "hca", 16, 21, 22)]
    scale = 512 ** -0.5
    for name, fmt, kind, H, s_scene, s_q in scenes:
        dense = torch.float32 if fmt is None else torch.bfloat16
        sc = Scene(fmt, kind, LENS, QUERIES, 40, gen(s_scene), dense_dtype=dense)
        g = gen(s_q)
        T = sc.positions.shape[0]
        q = (torch.randn(T, H, 512, generator=g) * 2).to(DEV)
        sink = torch.randn(H, generator=g).to(DEV)
        exact, a, _ = _float64_reference(sc, q, sink, scale)
        ref = _run(torch_attention.paged_sparse_attention, sc, q, sink, scale)
        err_o = ((ref.double() - exact).abs() / a)
        outs = {}
        for kname, fn in kernels.items():
            out = _run(fn, sc, q, sink, scale)
            outs[kname] = out
            err = (out.double() - exact).abs() / a
            t, h, d = (int(v) for v in torch.nonzero(err == err.max())[0])
            no_comp = torch.full((T, 0), -1, dtype=sc.comp_idx.dtype, device=DEV)
            rms_k, rms_o = err.pow(2).mean().sqrt().item(), err_o.pow(2).mean().sqrt().item()
            q_k, q_o = (torch.quantile(e.flatten().float()[:1 << 24], 0.999).item() for e in (err, err_o))
            print(f"{name:<16} {kname:<8} rms kernel {rms_k:.3g} oracle {rms_o:.3g}; 99.9 % kernel {q_k:.3g} "
                  f"oracle {q_o:.3g}", flush=True)
            print(f"{name:<16} {kname:<8} max kernel {err.max().item():.3g} oracle {err_o.max().item():.3g} "
                  f"ratio {err.max().item() / err_o.max().item():.2f}; worst at token {t} (pos "
                  f"{int(sc.positions[t])}) head {h} dim {d}; oracle there {err_o[t, h, d].item():.3g}", flush=True)
            w = _run(fn, sc, q, sink, scale, comp_idx=no_comp)
            full_idx, sc.comp_idx = sc.comp_idx, no_comp  # the reference reads the scene's own lists
            ex_w, a_w, _ = _float64_reference(sc, q, sink, scale)
            sc.comp_idx = full_idx
            print(f"{'':<16} {'':<8} window keys only: kernel {((w.double() - ex_w).abs() / a_w).max().item():.3g}",
                  flush=True)
        if len(outs) == 2:
            same = torch.equal(outs["current"], outs["other"])
            print(f"{'':<16} current vs other: {'same bits' if same else 'max |Δ| %.3g' % (outs['current'] - outs['other']).abs().max().item()}")


if __name__ == "__main__":
    main()
