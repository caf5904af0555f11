"""Is a request's prefill independent of the other requests in its step? Where does it first move?

``dsv4 probe`` at TP=2 on the H200 found first tokens that change between batch 1 and batch 8
(prefills of several prompts in one step). This prefills a target prompt alone, then in one step
with other prompts (target first, then target last), compares the target's logits bitwise and,
when they differ, reports the first recorded value that moved: per layer the block output, inside
it mHC pre/post, attention, MoE, and every registered op (``sparse_attention``, ``indexer``,
``moe_route``, ``moe_experts``, ``dense_linear``, ``rms_norm`` ...), each restricted to the target's
rows. Run on a GPU (the Triton path); ``--device cpu`` runs the torch path.

    python bench/prefill_invariance.py --ckpt /tmp/fw4 --make-preset flash-width --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from step_control import add, step_with  # noqa: E402  (tests/step_control.py)


class Recorder:
    """Wraps model parts and ops; while ``on``, keeps each call's output rows [lo, hi) (the target)."""

    def __init__(self):
        self.on, self.total, self.lo, self.hi, self.log = False, 0, 0, 0, []

    def keep(self, name, out):
        if not self.on:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == self.total:
                self.log.append((f"{name}[{i}]", t[self.lo:self.hi].detach().float().cpu()))

    def wrap(self, name, fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            self.keep(name, out)
            return out
        return wrapped


def instrument(engine, rec: Recorder) -> None:
    import dsv4.model.model as model_mod

    model = engine.model
    for fn_name in ("hc_pre", "hc_post", "hc_post_pre", "rms_norm"):
        setattr(model_mod, fn_name, rec.wrap(fn_name, getattr(model_mod, fn_name)))
    for b in model.blocks:
        b.attn.forward = rec.wrap(f"L{b.layer}.attn", b.attn.forward)
        b.moe.forward = rec.wrap(f"L{b.layer}.moe", b.moe.forward)
        b.run = rec.wrap(f"L{b.layer}.block", b.run)  # ReferenceModel.hidden calls run, not forward
    seen = set()
    for d in (model.w.ops, model.kernel_ops, engine.runner.attention_ops or {}):
        if id(d) in seen:
            continue
        seen.add(id(d))
        for k in list(d):
            d[k] = rec.wrap(f"op.{k}", d[k])


def prompts(n, lo, hi, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def first_moved(a, b):
    for (na, ta), (nb, tb) in zip(a, b):
        if na != nb:
            return {"op": f"call order differs: {na} vs {nb}"}
        if "indexer" in na and ta.shape[:-1] == tb.shape[:-1]:  # top-k width follows the step's longest
            w = max(ta.shape[-1], tb.shape[-1])                 # context: compare with -1 padding
            ta, tb = (torch.nn.functional.pad(t, (0, w - t.shape[-1]), value=-1) for t in (ta, tb))
        if ta.shape != tb.shape or not torch.equal(ta.nan_to_num(), tb.nan_to_num()):
            d = (ta - tb).abs() if ta.shape == tb.shape else None
            return {"op": na, "shape": list(ta.shape),
                    "max_abs_diff": None if d is None else float(d.max()),
                    "rows_differing": None if d is None else int((d.reshape(d.shape[0], -1).amax(1) > 0).sum())}
    return None


def per_layer(a, b):
    out = {}
    for (na, ta), (nb, tb) in zip(a, b):
        if na == nb and na.endswith(".block[0]") and ta.shape == tb.shape:
            out[na[:-9]] = float((ta - tb).abs().max())
    return out


def run(a, ckpt: str) -> dict:
    from dsv4.engine.engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model=ckpt, kv_cache_dtype=a.kv_cache_dtype, max_model_len=4096, max_num_seqs=16,
                                 max_num_batched_tokens=16384, kv_cache_memory=a.kv_gib << 30,
                                 enable_prefix_caching=False, enforce_eager=True, device=a.device,
                                 attention="batched"))
    rec = Recorder()
    instrument(eng, rec)
    vocab = eng.model_config.vocab_size
    others = prompts(7, 5, 700, vocab, seed=11)
    results = []
    for n in a.targets:
        target = prompts(1, n, n + 1, vocab, seed=n)[0]
        logs, logits = {}, {}
        for layout in ("alone", "first", "last"):
            t = add(eng, target, max_tokens=2)
            rest = [add(eng, p, max_tokens=2) for p in others] if layout != "alone" else []
            reqs = [t] + rest if layout != "last" else rest + [t]
            total = sum(len(r.prompt_token_ids) for r in reqs)
            lo = 0 if layout != "last" else total - n
            rec.on, rec.total, rec.lo, rec.hi, rec.log = layout != "last", total, lo, lo + n, []
            got = step_with(eng, reqs)
            rec.on = False
            logits[layout], logs[layout] = got[id(t)].float().cpu(), rec.log
            for r in reqs:
                eng.abort_request(r.request_id)
        row = {"target_len": n}
        for layout in ("first", "last"):
            d = (logits[layout] - logits["alone"]).abs()
            row[layout] = {"bitwise_equal": bool(torch.equal(logits[layout], logits["alone"])),
                           "max_abs_logit_diff": float(d.max()),
                           "argmax_equal": int(logits[layout].argmax()) == int(logits["alone"].argmax())}
        row["first_moved"] = first_moved(logs["alone"], logs["first"])
        row["block_max_diff"] = per_layer(logs["alone"], logs["first"])
        row["calls_recorded"] = len(logs["alone"])
        results.append(row)
        print(json.dumps(row), flush=True)
    return {"ckpt": ckpt, "ops": {k: getattr(v, "__qualname__", str(v)) for k, v in (eng.runner.attention_ops or {}).items()},
            "results": results}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", action="append", required=True, help="checkpoint dir (repeatable; written if missing)")
    p.add_argument("--make-preset", default="flash-width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--targets", default="10,300,1100")
    p.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    p.add_argument("--kv-gib", type=int, default=8)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.targets = [int(x) for x in a.targets.split(",")]
    docs = []
    for ck in a.ckpt:
        if not Path(ck, "config.json").exists():
            from dsv4.checkpoint.synthetic import write_checkpoint

            preset = "tiny" if "tiny" in Path(ck).name else a.make_preset
            t0 = time.perf_counter()
            write_checkpoint(ck, preset=preset, layers=None if preset == "tiny" else a.layers,
                             device=a.device or ("cuda" if torch.cuda.is_available() else "cpu"), progress=False)
            print(f"wrote {ck} ({preset}) in {time.perf_counter() - t0:.0f} s", flush=True)
        print(f"== {ck}", flush=True)
        docs.append(run(a, ck))
    if a.out:
        Path(a.out).write_text(json.dumps(docs, indent=1))
    bad = [r for d in docs for r in d["results"] if not (r["first"]["bitwise_equal"] and r["last"]["bitwise_equal"])]
    print(f"{'FAIL' if bad else 'PASS'}: {len(bad)} target(s) whose prefill logits depend on the batch")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
