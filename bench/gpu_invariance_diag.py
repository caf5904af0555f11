"""Where does a decode row stop being batch-invariant on the GPU? (diagnostic for issue 8)

Prefills a target request alone, then runs one decode step of it alone and inside a batch of 4
(eager, no CUDA graphs), capturing the target's residual streams after every layer and its logits;
prints the max |Δ| per layer, so the first differing layer names the op family to look at. Then
the same step through the CUDA graph of bucket 4 against eager.

    python bench/gpu_invariance_diag.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from step_control import add, step_with  # noqa: E402


def engine(ckpt, eager):
    from dsv4.engine.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=ckpt, kv_cache_dtype="fp8_ds_mla", max_model_len=1024, max_num_seqs=8,
                                  kv_cache_memory=1 << 30, enable_prefix_caching=False, enforce_eager=eager))


def decode_capture(eng, target, others):
    """Prefill everyone alone, then one decode step with [others..., target at 1]; returns
    ({layer: target streams}, target logits)."""
    step_with(eng, [target])
    for o in others:
        step_with(eng, [o])
    batch = list(others)
    batch.insert(min(1, len(batch)), target)
    row = batch.index(target)
    cap = {}
    fwd = eng.model.forward

    def hooked(ids, chunks, logits_rows=None, hook=None, **kw):
        def h(name, streams):
            cap[name] = streams[row].detach().float().clone()
        return fwd(ids, chunks, logits_rows, hook=h, **kw)

    eng.model.forward = hooked
    try:
        logits = step_with(eng, batch)[id(target)]
    finally:
        del eng.model.forward
    return cap, logits


def main():
    ckpt = "/tmp/tiny_smoke"
    if not Path(ckpt, "config.json").exists():
        subprocess.run([sys.executable, "-m", "dsv4.cli", "make-checkpoint", "--preset", "tiny", "--out", ckpt,
                        "--quiet"], check=True, cwd=ROOT)
    g = torch.Generator().manual_seed(3)
    target = torch.randint(3, 120000, (300,), generator=g).tolist()
    others = [torch.randint(3, 120000, (n,), generator=g).tolist() for n in (40, 257, 130)]
    e1 = engine(ckpt, True)
    a, la = decode_capture(e1, add(e1, target), [])
    e2 = engine(ckpt, True)
    b, lb = decode_capture(e2, add(e2, target), [add(e2, p) for p in others])
    print("eager: target alone vs in a batch of 4 (max |Δ| of its streams after each layer):")
    for k in a:
        print(f"  {k:12s} {(a[k] - b[k]).abs().max().item():.3g}")
    print(f"  logits       {(la - lb).abs().max().item():.3g}")
    e3 = engine(ckpt, False)
    t3 = add(e3, target)
    o3 = [add(e3, p) for p in others]
    step_with(e3, [t3])
    for o in o3:
        step_with(e3, [o])
    lc = step_with(e3, o3[:1] + [t3] + o3[1:])[id(t3)]
    print(f"graph (bucket 4) vs eager batch of 4, logits max |Δ| {(lc - lb).abs().max().item():.3g}; "
          f"graph vs eager alone {(lc - la).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
