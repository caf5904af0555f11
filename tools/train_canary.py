"""Train the embedded canary model (``dsv4/assets/canary``) on synthetic tasks.

The model is the reference DeepSeek-V4 forward (:mod:`dsv4.model`) run on fp32 tensors that
require grad, so what is trained is exactly what the engine runs. Training is time-boxed: the
learning-rate schedule and the phases follow the fraction of ``--budget-s`` that has elapsed, so
one device call of known length always ends with a finished, quantized checkpoint.

Phases (fractions of the budget):
- ``[0, dense_until)``: the CSA layers attend to *every* compressed entry while the Lightning
  Indexer learns, by a KL loss, to predict where the main attention looks (as in DeepSeek's
  sparse-attention warm-up; top-k selection itself has no gradient);
- ``[dense_until, 1)``: the real top-16 selection;
- ``[qat_from, 1)``: quantization-aware: forwards use the values the checkpoint will store
  (FP8 128×128 + UE8M0, MXFP4 experts, BF16) with straight-through gradients, and every other
  step the ``fp8_ds_mla`` KV-cache rounding (also straight-through).
At the end the weights are quantized to the release formats and written as a normal model
directory; the held-out accuracy per task (before and after quantization, both cache dtypes) goes
to ``canary.json`` next to the weights.

Training swaps two things in, both undone before any accuracy is measured: the per-64-query
``sparse_attention`` loop becomes one masked dense softmax computing the same function (the
per-op overhead, not arithmetic, bounds a step), and hooks collect the indexer KL loss and expert
loads (the gate bias is balanced aux-loss-free, by sign updates).

The committed canary (docs/canary.md), on one H200:

    PYTHONPATH=. python tools/train_canary.py --out $OUT/canary --budget-s 370            # 411 steps
    PYTHONPATH=. python tools/train_canary.py --out $OUT/canary --resume dsv4/assets/canary \
        --budget-s 95 --seqs 6 --seq-len 3072 --recall-per-seq 2 --dense-until 0 --qat-from 0.6 \
        --lr 5e-4 --warmup 15 --lr-floor 0.3 --evals fp32/auto                            # +207 steps
    python tools/train_canary.py --out /tmp/x --device cpu --evaluate dsv4/assets/canary   # canary.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv4.model.attention as attention_mod  # noqa: E402
import dsv4.model.moe as moe_mod  # noqa: E402
from dsv4.canary.data import make_batch  # noqa: E402
from dsv4.canary.eval import evaluate_reference  # noqa: E402
from dsv4.canary.model import (  # noqa: E402
    TensorWeights,
    canary_config_dict,
    forward_tensors,
    init_params,
    load_params,
    write_checkpoint,
)
from dsv4.canary.tasks import heldout, make_record_run  # noqa: E402
from dsv4.canary.tokenizer import CharCodec  # noqa: E402
from dsv4.config import LayerType, config_from_dict  # noqa: E402
from dsv4.model.attention import Attention, Compressor  # noqa: E402
from dsv4.model.cache import CacheNumerics, DenseSequenceCache  # noqa: E402
from dsv4.model.linear import linear  # noqa: E402
from dsv4.model.model import ReferenceModel  # noqa: E402
from dsv4.model.rope import apply_rope, cos_sin  # noqa: E402
from dsv4.model.step import SeqChunk  # noqa: E402


# ---- training-only hooks on the reference model ----------------------------------------------
class STENumerics(CacheNumerics):
    """The cache's rounding with a straight-through gradient (the codecs themselves have none)."""

    def kv(self, x, compressed=False):
        return x + (super().kv(x.detach(), compressed) - x).detach()

    def index_k(self, x):
        return x + (super().index_k(x.detach()) - x).detach()


class Hooks:
    """Collects the indexer KL loss and the expert loads while a training forward runs."""

    def __init__(self):
        self.active = False
        self.kl_sum = None
        self.kl_rows = 0
        self.loads: dict[int, torch.Tensor] = {}  # id(bias tensor) → expert counts

    def reset(self):
        self.kl_sum, self.kl_rows, self.loads = None, 0, {}


HOOKS = Hooks()


def indexer_logits(att: Attention, x, qr, chunk: SeqChunk, n: int):
    """The indexer's pre-top-k scores [t, n] and visibility mask, as in ``Attention.indexer_topk``."""
    cfg = att.cfg
    pos, t = chunk.positions, chunk.length
    q = linear(qr, att.idx_wq_b).view(t, cfg.index_n_heads, cfg.index_head_dim)
    cos, sin = cos_sin(cfg.rope_compress, pos)
    q = apply_rope(q, cos, sin).float()
    w = linear(x, att.idx_weights).float() * (cfg.index_n_heads ** -0.5) * (cfg.index_head_dim ** -0.5)
    ar = torch.arange(n, device=x.device)
    k = chunk.cache.read_compressed(att.layer, "index", ar).float()
    logits = (torch.einsum("thd,nd->thn", q, k).relu() * w[:, :, None]).sum(dim=1)
    return logits, ar[None, :] < ((pos + 1) // 4)[:, None]


_orig_attend = Attention._attend
_orig_state_rows = Compressor.state_rows
_orig_route = moe_mod.route


def _attend(self, x, qr, q, kv, c):
    out = _orig_attend(self, x, qr, q, kv, c)
    if HOOKS.active and self.type == LayerType.CSA:
        n = (c.start + c.length) // 4
        if n > 0:
            logits, visible = indexer_logits(self, x.detach(), qr.detach(), c, n)
            comp = c.cache.read_compressed(self.layer, "kv", torch.arange(n, device=x.device)).detach().float()
            s = torch.einsum("thd,nd->thn", q.detach().float(), comp) * (self.cfg.head_dim ** -0.5)
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
            rows = visible.any(dim=1)
            if bool(rows.any()):
                p = torch.softmax(s[rows], dim=-1).sum(dim=1)
                p = p / p.sum(dim=-1, keepdim=True)
                logq = torch.log_softmax(logits[rows].masked_fill(~visible[rows], float("-inf")), dim=-1)
                kl = (p * (torch.log(p.clamp_min(1e-12)) - logq.clamp_min(-1e4))).masked_fill(~visible[rows], 0).sum()
                HOOKS.kl_sum = kl if HOOKS.kl_sum is None else HOOKS.kl_sum + kl
                HOOKS.kl_rows += int(rows.sum())
    return out


def _state_rows(self, x, positions):
    # the indexer's keys learn from the KL loss only, never push on the residual stream
    return _orig_state_rows(self, x.detach() if (HOOKS.active and self.kind == "index") else x, positions)


def _route(ops, x, gate_w, cfg, bias=None, tid2eid=None, token_ids=None):
    ids, w = _orig_route(ops, x, gate_w, cfg, bias, tid2eid, token_ids)
    if HOOKS.active and bias is not None:
        cnt = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts).float()
        HOOKS.loads[id(bias)] = HOOKS.loads.get(id(bias), 0) + cnt
    return ids, w


def masked_attention(q, table, idx, sink, scale, check=None, query_block=None):
    """The function ``attention.sparse_attention`` computes, as one masked dense softmax.

    Same keys, same sink, same scale; only the reduction order differs (no 64-key blocks, fp32
    softmax), which the reference needs for batch invariance and training does not. A chunk's
    table is small (its window rows plus the compressed entries), so scoring every query against
    every row and masking to the listed ones is far cheaper on a GPU than gathering a
    [queries, keys, 512] tensor per 64-query block.
    """
    t, h, _ = q.shape
    n = table.shape[0]
    allowed = torch.zeros(t, n + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(1, torch.where(idx >= 0, idx, n), True)
    allowed = allowed[:, :n]
    tf = table.float()
    logits = torch.einsum("thd,nd->thn", q.float(), tf) * scale
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    full = torch.cat([sink.float()[None, :, None].expand(t, h, 1), logits], dim=-1)
    probs = torch.softmax(full, dim=-1)[..., 1:]
    return torch.einsum("thn,nd->thd", probs, tf).to(q.dtype)


_orig_sparse_attention = attention_mod.sparse_attention


def install_hooks(fast_attention: bool = True) -> None:
    Attention._attend = _attend
    Compressor.state_rows = _state_rows
    moe_mod.route = _route
    if fast_attention:
        attention_mod.sparse_attention = masked_attention


def uninstall_hooks() -> None:
    """Back to the plain reference: accuracy is measured on exactly what the engine runs."""
    Attention._attend = _orig_attend
    Compressor.state_rows = _orig_state_rows
    moe_mod.route = _orig_route
    attention_mod.sparse_attention = _orig_sparse_attention


# ---- one step --------------------------------------------------------------------------------
def run_batch(params, cfg, seqs, device, quantized: bool, fp8_cache: bool, mtp_weight: float):
    """Forward one batch; returns (loss, main CE, mtp CE, indexer KL, bias-name → load)."""
    ts = forward_tensors(params, cfg, quantized)
    model = ReferenceModel(TensorWeights(cfg, ts, device=device), numerics=CacheNumerics("auto"))
    numerics = STENumerics("fp8_ds_mla") if fp8_cache else CacheNumerics("auto")
    ids, rows, mrows, wts, mwts, chunks, mchunks = [], [], [], [], [], [], []
    off = 0
    for s in seqs:
        n = len(s.ids)
        ids += s.ids
        rows += [off + i for i in range(n - 1) if s.target[i + 1]]
        wts += [w for w in s.target[1:] if w]
        mrows += [off + i for i in range(n - 2) if s.target[i + 2]]
        mwts += [w for w in s.target[2:] if w]
        chunks.append(SeqChunk(DenseSequenceCache(cfg, numerics), 0, n))
        mchunks.append(SeqChunk(DenseSequenceCache(cfg, numerics), 0, n))
        off += n
    ids_t = torch.tensor(ids, device=device)
    rows_t = torch.tensor(rows, device=device)
    HOOKS.reset()
    HOOKS.active = True
    try:
        out = model.forward(ids_t, chunks, logits_rows=rows_t)
        w = torch.tensor(wts, device=device)
        main = (F.cross_entropy(out.logits, ids_t[rows_t + 1], reduction="none") * w).sum() / w.sum()
        nxt = torch.cat([ids_t[1:], ids_t.new_zeros(1)])  # row i's next token (rows past a sequence end are unused)
        mlog = model.mtp_forward(nxt, out.streams, mchunks).logits
        mrows_t = torch.tensor(mrows, device=device)
        mw = torch.tensor(mwts, device=device)
        mtp = (F.cross_entropy(mlog[mrows_t], ids_t[mrows_t + 2], reduction="none") * mw).sum() / mw.sum()
    finally:
        HOOKS.active = False
    kl = HOOKS.kl_sum / max(HOOKS.kl_rows, 1) if HOOKS.kl_sum is not None else torch.zeros((), device=device)
    names = {id(t): n for n, t in ts.items()}
    loads = {names[k]: v for k, v in HOOKS.loads.items()}
    return main + mtp_weight * mtp + kl, main.detach(), mtp.detach(), kl.detach(), loads


def lr_at(frac: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine over the time budget down to ``floor``·peak."""
    warm = min(1.0, (step + 1) / warmup)
    return peak * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def correct_masks(res: dict) -> dict[str, str]:
    """Per task, '1'/'0' per held-out example in order: tests compare any subset exactly."""
    out: dict[str, str] = {}
    for o in res["outputs"]:
        out[o["task"]] = out.get(o["task"], "") + ("1" if o["output"].strip() == o["answer"] else "0")
    return out


EVALS = ("checkpoint/auto", "checkpoint/fp8_ds_mla", "fp32/auto", "fp32/fp8_ds_mla")


def evaluate_into(model_dir, info: dict, keys, held, dev, log, fp32: dict | None = None, cfg=None) -> None:
    """Held-out accuracy of the written checkpoint (and of the fp32 weights, when given) on the plain
    reference; each result is added to ``info['accuracy']`` and ``canary.json`` rewritten at once."""
    from dsv4.model.weights import ModelWeights

    for key in keys:
        kind, kv = key.split("/")
        if kind == "fp32" and fp32 is None:
            continue
        t = time.time()
        try:
            w = (ModelWeights(model_dir, torch.float32, dev, progress=False) if kind == "checkpoint"
                 else TensorWeights(cfg, fp32, device=dev))
            res = evaluate_reference(ReferenceModel(w, numerics=CacheNumerics(kv)), held)
        except Exception as e:  # keep what was measured so far
            log(f"evaluation {key} failed: {type(e).__name__}: {e}")
            continue
        info.setdefault("accuracy", {})[key] = res["accuracy"]
        info.setdefault("correct", {})[key] = correct_masks(res)
        log(f"held-out accuracy, {key} ({time.time() - t:.1f}s): {res['accuracy']}")
        (Path(model_dir) / "canary.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="model directory to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock seconds of training")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--seqs", type=int, default=12, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=1536, help="tokens per sequence (about)")
    ap.add_argument("--recall-len", type=int, nargs=2, default=[150, 1000], help="record-run length range")
    ap.add_argument("--recall-per-seq", type=int, default=1, help="record runs per sequence")
    ap.add_argument("--far-from", type=float, default=0.0,
                    help="fraction of the budget before which every recall question is answered inside the "
                         "window (short record runs): the lookup is learnt before the compressed path is asked")
    ap.add_argument("--far-distance", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="far recall questions ask records LO..HI tokens back (default: at least 150, as the "
                         "held-out set); e.g. 130 250 just beyond the 128-token window")
    ap.add_argument("--record-runs", action="store_true",
                    help="far recall over dense record runs (runs 1-10) instead of needle clusters in filler")
    ap.add_argument("--near-eval", type=int, default=16,
                    help="in-window recall examples for the end-of-run diagnostic (0: none)")
    ap.add_argument("--dense-until", type=float, default=0.35)
    ap.add_argument("--qat-from", type=float, default=0.75)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free balancing step of the gate bias")
    ap.add_argument("--reference-attention", action="store_true",
                    help="train through attention.sparse_attention itself (slow) instead of its masked-dense twin")
    ap.add_argument("--eval-per-task", type=int, default=32)
    ap.add_argument("--eval-recall", type=int, default=24)
    ap.add_argument("--save-every-s", type=float, default=150.0,
                    help="write a checkpoint this often (a timeout still returns one)")
    ap.add_argument("--log", default=None, help="also append log lines to this file")
    ap.add_argument("--resume", default=None, metavar="DIR", help="start from this canary checkpoint's stored weights")
    ap.add_argument(
        "--swiglu-limit",
        type=float,
        default=None,
        help="the config's SwiGLU clamp (default: the canary config's 10). Smaller makes the trained "
        "function depend on the clamp, so a missing clamp stays visible as the model improves",
    )
    ap.add_argument("--lr-floor", type=float, default=0.1, help="final learning rate as a fraction of --lr")
    ap.add_argument("--evals", default=",".join(EVALS), help=f"held-out evaluations at the end, from {EVALS}")
    ap.add_argument(
        "--evaluate",
        default=None,
        metavar="DIR",
        help="only evaluate this checkpoint (--evals checkpoint/*) and update its canary.json",
    )
    a = ap.parse_args(argv)

    t_start = time.time()
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    install_hooks(not a.reference_attention)
    cfg_dict = canary_config_dict(**({} if a.swiglu_limit is None else {"swiglu_limit": a.swiglu_limit}))
    cfg = config_from_dict(cfg_dict)
    dense_cfg = dataclasses.replace(cfg, index_topk=1 << 20)
    codec = CharCodec()
    held = heldout(a.eval_per_task, recall_per_task=a.eval_recall)
    exclude = frozenset(e.prompt for e in held)
    logf = open(a.log, "a") if a.log else None

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        if logf:
            logf.write(line + "\n")
            logf.flush()

    if a.evaluate:
        uninstall_hooks()
        info_path = Path(a.evaluate) / "canary.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        h = info.setdefault("heldout", {"per_task": a.eval_per_task, "recall": a.eval_recall})
        held = heldout(h["per_task"], recall_per_task=h["recall"])  # the set the file records
        info.setdefault("evaluated_on", {}).update(
            {k: f"{dev.type} fp32, torch {torch.__version__}" for k in a.evals.split(",") if k.startswith("checkpoint")}
        )
        evaluate_into(a.evaluate, info, [k for k in a.evals.split(",") if k.startswith("checkpoint")], held, dev, log)
        return 0
    params = load_params(a.resume, dev) if a.resume else init_params(cfg, a.seed, dev)
    prior = json.loads((Path(a.resume) / "canary.json").read_text()) if a.resume else None
    trainable = {
        n: p.requires_grad_() for n, p in params.items() if p.is_floating_point() and not n.endswith("gate.bias")
    }
    opt = torch.optim.AdamW(trainable.values(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.0, eps=1e-8)
    n_params = sum(p.numel() for p in trainable.values())
    log(f"canary: {cfg.schedule_summary()}; {n_params / 1e6:.2f}M trainable params on {dev}")

    rng = random.Random(a.seed)
    t0 = time.time()
    step, last_save, skipped = 0, t0, 0
    hist: list[dict] = []
    ema = None
    while step < a.max_steps:
        frac = (time.time() - t0) / a.budget_s
        if frac >= 1.0:
            break
        sparse, qat = frac >= a.dense_until, frac >= a.qat_from
        near = frac < a.far_from
        seqs = make_batch(
            rng,
            codec,
            a.seqs,
            a.seq_len,
            tuple(a.recall_len),
            exclude,
            a.recall_per_seq,
            near,
            tuple(a.far_distance) if a.far_distance else None,
            haystack=not a.record_runs,
        )
        lr = lr_at(frac, step, a.lr, a.warmup, a.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, main_ce, mtp_ce, kl, loads = run_batch(
            params, cfg if sparse else dense_cfg, seqs, dev, qat, qat and step % 2 == 1, a.mtp_weight
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
        if not (torch.isfinite(loss) and torch.isfinite(gn)):
            skipped += 1
            log(f"step {step}: non-finite loss {float(loss)} / grad norm {float(gn)}, update skipped")
            step += 1
            continue
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing: raise the bias of under-used experts
            for name, cnt in loads.items():
                params[name] += a.bias_rate * torch.sign(cnt.mean() - cnt)
        step += 1
        cur = {"main": float(main_ce), "mtp": float(mtp_ce), "kl": float(kl)}
        ema = cur if ema is None else {k: 0.9 * ema[k] + 0.1 * v for k, v in cur.items()}
        if step % 10 == 0 or step <= 3:
            ntok = sum(len(s.ids) for s in seqs)
            log(
                f"step {step} frac {frac:.3f} lr {lr:.2e} loss main {ema['main']:.3f} mtp {ema['mtp']:.3f} "
                f"kl {ema['kl']:.3f} gnorm {float(gn):.2f} tokens {ntok} {'sparse' if sparse else 'dense'}"
                f"{' qat' if qat else ''}{' near-recall' if near else ''}"
            )
            hist.append({"step": step, "t": round(time.time() - t0, 1), **{k: round(v, 4) for k, v in ema.items()}})
        if time.time() - last_save > a.save_every_s:
            write_checkpoint(params, cfg_dict, a.out, extra={"partial": True, "step": step})
            last_save = time.time()
            log(f"saved partial checkpoint at step {step}")
    train_s = time.time() - t0
    log(f"trained {step} steps in {train_s:.1f}s ({skipped} skipped)")
    uninstall_hooks()
    if dev.type == "cuda":  # accuracy in true fp32, as the CPU engine computes it
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    # ---- the checkpoint first (so a failure below still leaves it), then accuracy ------------
    info = {
        "description": "dsv4 canary: DeepSeek-V4 architecture at small widths trained on synthetic tasks",
        "architecture": cfg.schedule_summary(),
        "trainable_params": n_params,
        "steps": step,
        "skipped_steps": skipped,
        "train_seconds": round(train_s, 1),
        "seconds_per_step": round(train_s / max(step, 1), 3),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(a),
        "heldout": {"per_task": a.eval_per_task, "recall": a.eval_recall},
        "accuracy": {},
        "history": hist,
    }
    if prior is not None:  # a resumed run: keep the earlier runs' record
        info["previous_runs"] = prior.get("previous_runs", []) + [
            {k: v for k, v in prior.items() if k != "previous_runs"}
        ]
        info["total_steps"] = step + sum(r.get("steps", 0) for r in info["previous_runs"])
        info["total_train_seconds"] = round(train_s + sum(r.get("train_seconds", 0) for r in info["previous_runs"]), 1)
    write_checkpoint(params, cfg_dict, a.out, extra=info)
    fp32 = {n: p.detach() for n, p in params.items()}
    evaluate_into(a.out, info, [k for k in a.evals.split(",") if k], held, dev, log, fp32=fp32, cfg=cfg)
    if a.near_eval > 0:  # has the lookup itself been learnt? (the held-out recall is all beyond the window)
        near_rng = random.Random(f"{a.seed}:near")
        near_set = [
            make_record_run(near_rng, length=near_rng.randint(60, 110), min_distance=0) for _ in range(a.near_eval)
        ]
        res = evaluate_reference(
            ReferenceModel(TensorWeights(cfg, fp32, device=dev), numerics=CacheNumerics("auto")), near_set
        )
        info["diagnostics"] = {"recall_in_window_fp32": res["accuracy"]["recall"]}
        (Path(a.out) / "canary.json").write_text(json.dumps(info, indent=2) + "\n")
        log(f"in-window recall (fp32 weights, {a.near_eval} examples of 60-110 tokens): {res['accuracy']['recall']}")
    log(f"wrote {a.out} ({sum(f.stat().st_size for f in Path(a.out).iterdir()) / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
