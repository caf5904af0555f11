"""Why does the engine's token differ from the probe's oracle? Routing near-ties or a real error?

``dsv4 probe`` at TP=1 bf16 on the 4-layer flash-width checkpoint failed reference agreement
(first token off by a 0.25-nat margin) while TP=2 passed on the same prompts. Random weights make
MoE routing scores nearly tied: a bf16 rounding difference in a hidden state can swap the 6th and
7th expert of a token, and one swapped expert moves the logits far more than rounding does. This
script separates the two explanations. For each probe prompt it runs

- the engine (eager, so every op is visible), greedy, recording each MoE layer's expert choice and
  each block's output rows;
- the probe's oracle (a separate torch reference model, dense cache) in bf16 and in float32,
  teacher-forced on the engine's tokens, recording the same;

and reports per step the three logprobs and top-1 tokens, and per layer how many (token, layer)
choices differ between engine and bf16 oracle and between the bf16 and float32 oracles, with the
score gap at the top-k boundary of the rows that differ (a flip at a gap of one bf16 spacing of
the scores is rounding; a flip at a large gap is an error).

    python bench/probe_divergence.py --ckpt /tmp/fw4 --out divergence.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Tape:
    """Per MoE layer: the selection scores and chosen experts of every row; per block: its output."""

    def __init__(self):
        self.layer = None
        self.route: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.block: dict[int, list[torch.Tensor]] = {}

    def keep_route(self, logits, bias, ids):
        sel = torch.sqrt(F.softplus(logits.double())).float()
        if bias is not None:
            sel = sel + bias.float()
        self.route.setdefault(self.layer, []).append((sel.detach().cpu(), ids.detach().long().cpu()))

    def rows(self, what: dict, layer: int):
        parts = what.get(layer, [])
        if not parts:
            return None
        if isinstance(parts[0], tuple):
            return tuple(torch.cat([p[i] for p in parts]) for i in range(2))
        return torch.cat(parts)


def instrument(model, tape: Tape) -> None:
    import dsv4.model.moe as moe_mod

    for b in model.blocks:
        def block_fwd(*a, _f=b.forward, _l=b.layer, **k):
            tape.layer = _l
            out = _f(*a, **k)
            tape.block.setdefault(_l, []).append(out.detach().float().reshape(out.shape[0], -1).cpu())
            return out
        b.forward = block_fwd
    ops = getattr(model.w, "ops", None) or {}
    if "moe_route" in ops:
        real = ops["moe_route"]

        def route_op(logits, bias, topk, scale=1.0, norm=True, hash_ids=None, *a, **k):
            ids, w = real(logits, bias, topk, scale, norm, hash_ids, *a, **k)
            if hash_ids is None:
                tape.keep_route(logits, bias, ids)
            return ids, w
        ops["moe_route"] = route_op
    if not getattr(moe_mod, "_tapes", None):
        moe_mod._tapes = {}
        real_route = moe_mod.route

        def route(x, gate_w, cfg, bias=None, tid2eid=None, token_ids=None):
            ids, w = real_route(x, gate_w, cfg, bias, tid2eid, token_ids)
            t = moe_mod._tapes.get("active")
            if t is not None and tid2eid is None:
                from dsv4.model.linear import linear
                t.keep_route(linear(x.float(), gate_w.float()), bias, ids)
            return ids, w
        moe_mod.route = route


def flips(a, b, k):
    """Rows whose chosen expert sets differ, with the boundary gap of ``b``'s scores at each."""
    (_, ia), (sb, ib) = a, b
    n = min(ia.shape[0], ib.shape[0])
    out = []
    for r in range(n):
        if set(ia[r].tolist()) != set(ib[r].tolist()):
            s = sb[r].sort(descending=True).values
            out.append({"row": r, "gap": float(s[k - 1] - s[k]), "score": float(s[k - 1])})
    return out


def gaps(rt, k):
    s = rt[0].sort(dim=-1, descending=True).values
    return s[:, k - 1] - s[:, k]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--kv-gib", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import dsv4.model.moe as moe_mod
    from dsv4 import LLM, SamplingParams
    from dsv4.chat import effort_version_for_config, encode_messages
    from dsv4.model.cache import CacheNumerics
    from dsv4.model.model import ReferenceModel
    from dsv4.validate.oracle import teacher_forced_logits
    from dsv4.validate.probe import DEFAULT_PROMPTS

    llm = LLM(a.ckpt, dtype="bfloat16", kv_cache_dtype="fp8_ds_mla", max_model_len=4096,
              kv_cache_memory=a.kv_gib << 30, enforce_eager=True, enable_prefix_caching=False)
    eng = llm.engine
    cfg = eng.model_config
    k = cfg.num_experts_per_tok
    tok = eng.tokenizer
    prompts = []
    for spec in DEFAULT_PROMPTS:
        if spec.kind == "chat":
            text = encode_messages(spec.messages, thinking=False, reasoning_effort=None, tools=None,
                                   effort_version=effort_version_for_config(cfg.raw))
            prompts.append(tok.encode(text))
        else:
            prompts.append(tok.encode(spec.text))
    numerics = CacheNumerics(eng.config.kv_cache_dtype, eng.config.fp8_format)
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True, logprobs=5)

    eng_tape = Tape()
    instrument(eng.model, eng_tape)
    moe_mod._tapes["active"] = eng_tape  # the torch path routes through moe.route, the fast path through the op
    gens = []
    for i, ids in enumerate(prompts):
        eng_tape.route.clear(), eng_tape.block.clear()
        o = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
        gens.append({"tokens": list(o.token_ids), "logprobs": [float(d[t].logprob) for d, t in zip(o.logprobs, o.token_ids)],
                     "route": {l: eng_tape.rows(eng_tape.route, l) for l in eng_tape.route},
                     "block": {l: eng_tape.rows(eng_tape.block, l) for l in eng_tape.block}})
    moe_mod._tapes["active"] = None
    res = [{"prompt": i, "len": len(ids), "engine_tokens": g["tokens"]} for i, (ids, g) in enumerate(zip(prompts, gens))]
    oracle = {}
    for name, dt in (("o16", torch.bfloat16), ("o32", torch.float32)):
        model = ReferenceModel(a.ckpt, dtype=dt, device=eng.model.device, numerics=CacheNumerics(eng.config.kv_cache_dtype, eng.config.fp8_format))
        tape = Tape()
        instrument(model, tape)
        moe_mod._tapes["active"] = tape
        outs = []
        for ids, g in zip(prompts, gens):
            tape.route.clear(), tape.block.clear()
            with torch.no_grad():
                lg = teacher_forced_logits(model, numerics, ids, g["tokens"], a.tokens)
            outs.append({"logits": lg, "route": {l: tape.rows(tape.route, l) for l in tape.route},
                         "block": {l: tape.rows(tape.block, l) for l in tape.block}})
        moe_mod._tapes["active"] = None
        oracle[name] = outs
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None

    for r, g, o16, o32 in zip(res, gens, oracle["o16"], oracle["o32"]):
        steps = []
        for s, t in enumerate(g["tokens"]):
            row = {"step": s, "engine": t, "engine_lp": round(g["logprobs"][s], 4)}
            for nm, o in (("o16", o16), ("o32", o32)):
                lp = torch.log_softmax(o["logits"][s].double(), -1)
                top = lp.topk(2)
                row[f"{nm}_top1"] = int(top.indices[0])
                row[f"{nm}_lp"] = round(float(lp[t]), 4)
                row[f"{nm}_margin"] = round(float(top.values[0] - lp[t]), 4)
            steps.append(row)
        r["steps"] = steps
        layers = []
        for l in sorted(o16["route"]):
            e, b16, b32 = g["route"].get(l), o16["route"][l], o32["route"].get(l)
            if e is None:
                continue
            f_e16 = flips(e, b16, k)
            f_1632 = flips(b16, b32, k) if b32 is not None else []
            g16 = gaps(b16, k)
            blk = {}
            for nm, o in (("e-o16", o16), ("o16-o32", o32)):
                x = g["block"][l] if nm == "e-o16" else o16["block"][l]
                y = o["block"][l]
                n = min(x.shape[0], y.shape[0])
                d = (x[:n] - y[:n]).abs().amax(1) / y[:n].abs().amax(1).clamp_min(1e-30)
                blk[nm] = round(float(d.max()), 5)
            layers.append({"layer": l, "rows": int(b16[1].shape[0]),
                           "flips_engine_vs_o16": f_e16, "flips_o16_vs_o32": f_1632,
                           "gap_median": float(g16.median()), "gap_min": float(g16.min()),
                           "block_rel_err": blk})
        r["layers"] = layers

    for r in res:
        print(f"\n== prompt {r['prompt']} ({r['len']} tokens)")
        print("step | engine | o16 top1 | o32 top1 | lp engine | lp o16 | lp o32 | o32 margin of engine tok")
        for s in r["steps"]:
            print(f"{s['step']} | {s['engine']} | {s['o16_top1']} | {s['o32_top1']} | {s['engine_lp']} | "
                  f"{s['o16_lp']} | {s['o32_lp']} | {s['o32_margin']}")
        print("layer | rows | flips e/o16 (gaps) | flips o16/o32 (gaps) | gap median | block rel err e-o16 / o16-o32")
        for L in r["layers"]:
            fe = [f"r{f['row']}:{f['gap']:.2g}" for f in L["flips_engine_vs_o16"]]
            fo = [f"r{f['row']}:{f['gap']:.2g}" for f in L["flips_o16_vs_o32"]]
            print(f"{L['layer']} | {L['rows']} | {len(fe)} {' '.join(fe)} | {len(fo)} {' '.join(fo)} | "
                  f"{L['gap_median']:.3g} | {L['block_rel_err']['e-o16']} / {L['block_rel_err']['o16-o32']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
