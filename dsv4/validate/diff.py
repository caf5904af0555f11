"""``dsv4 diff``: the layered numerical evidence chain between two backends.

Each side (A, B) is a model (``ReferenceModel`` with that backend's ops) reading and writing the
engine's paged cache through a :class:`~dsv4.cache.paged.PagedSequenceView`. The chain, in causal
order — the report names the first row where the sides part beyond the tolerances:

1. **cache round trip** (per side): KV rows written through the paged view; the raw bytes at the
   writer's addresses must equal the codec's ``quantize_kv`` and the values read back through the
   view must equal the codec's fake quant (bitwise) — window KV of every layer, compressed KV and
   indexer keys of the compressed layers.
2. **prefill hidden**: a random prompt of ``--prompt-len`` tokens (crossing pages and windows);
   per-layer residual streams (the model's ``hook``): cosine and max error.
3. **decode step**: one token (A's greedy choice, fed to both): per layer the attention's
   ``q``, decoded ``k_window`` / ``k_compressed``, attention ``logits`` / ``probs`` (the model's
   attention hooks), the attention output, and the layer's hidden state.
4. **next-token logits**: after prefill and after the decode step: cosine, max error, top-k overlap.
5. **greedy**: ``--greedy-tokens`` tokens on each side; the first position where they differ.

On CPU, backend ``triton`` runs only in the Triton interpreter (``TRITON_INTERPRET=1``); otherwise
it is reported as unavailable (exit code 2). Exit code 0 when the chain agrees, 1 when it parts.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch


@dataclass
class DiffOptions:
    model: str
    backend_a: str = "torch"
    backend_b: str = "triton"
    dtype: str = "auto"
    kv_cache_dtype: str = "fp8_ds_mla"
    fp8_format: str = "ocp"
    prompt_len: int = 300
    greedy_tokens: int = 8
    top_k: int = 10
    cos_tol: float = 1e-3  # a row fails when 1 - cos exceeds this …
    rel_tol: float = 0.15  # … or max|a-b| / max|a| exceeds this (one FP8 E4M3 step: up to 12.5 % of a value)
    margin_tol: float = 0.05  # nats: top-1 disagreement within this is a near-tie
    seed: int = 0
    json_report: str | None = None
    device: str | None = None


@dataclass
class Side:
    """One backend under comparison. ``model``/``view_cls`` may be given (tests plant faults this way)."""

    name: str
    backend: str
    model: object = None
    view_cls: type | None = None


@dataclass
class Row:
    stage: str
    where: str
    cos: float | None = None
    max_abs: float | None = None
    rel: float | None = None
    status: str = "PASS"
    note: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class DiffReport:
    status: str = "PASS"  # PASS | FAIL | UNAVAILABLE
    rows: list[Row] = field(default_factory=list)
    first_divergence: Row | None = None
    greedy: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return {"PASS": 0, "FAIL": 1}.get(self.status, 2)

    def to_dict(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code,
                "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
                "rows": [r.to_dict() for r in self.rows], "greedy": self.greedy, "info": self.info}


# ---- comparisons ------------------------------------------------------------------------------------
def compare_tensors(a: torch.Tensor, b: torch.Tensor, cos_tol: float, rel_tol: float,
                    exact: bool = False) -> tuple[float | None, float | None, float | None, str, str]:
    """(cos, max_abs, rel, status, note) of b against a; ``exact``: PASS only when bitwise equal."""
    if tuple(a.shape) != tuple(b.shape):
        return None, None, None, "FAIL", f"shape {list(a.shape)} vs {list(b.shape)}"
    a64, b64 = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    fa, fb = torch.isfinite(a64), torch.isfinite(b64)
    if not bool(fa.all()) or not bool(fb.all()):
        side = " and ".join(s for s, f in (("A", fa), ("B", fb)) if not bool(f.all()))
        n = int((~fa).sum()) if not bool(fa.all()) else int((~fb).sum())
        return None, None, None, "FAIL", f"non-finite in {side} ({n} values)"
    diff = (a64 - b64).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(a64.abs().max()) if a64.numel() else 0.0
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    na, nb = float(a64.norm()), float(b64.norm())
    if na == 0 and nb == 0:
        cos = 1.0
    elif na == 0 or nb == 0:
        cos = 0.0
    else:
        cos = float((a64 @ b64) / (na * nb))
    ok = max_abs == 0 if exact else ((1 - cos) <= cos_tol and rel <= rel_tol)
    return cos, max_abs, rel, "PASS" if ok else "FAIL", ""


def _first_argmax(x: torch.Tensor) -> int:
    """Lowest id among the maxima, ignoring NaN; -1 when no value is finite."""
    fin = torch.isfinite(x)
    if not bool(fin.any()):
        return -1
    x = torch.where(fin, x, torch.full_like(x, float("-inf")))
    return int(torch.nonzero(x == x.max())[0, 0])


def compare_logits(a: torch.Tensor, b: torch.Tensor, k: int, cos_tol: float, rel_tol: float,
                   margin_tol: float) -> tuple[float | None, float | None, float | None, str, str]:
    cos, mx, rel, status, note = compare_tensors(a, b, cos_tol, rel_tol)
    if cos is None:
        return cos, mx, rel, status, note
    ta, tb = _first_argmax(a), _first_argmax(b)
    k = min(k, a.numel())
    overlap = len(set(torch.topk(a.float(), k).indices.tolist()) & set(torch.topk(b.float(), k).indices.tolist())) / k
    note = f"top-1 {ta} vs {tb}, top-{k} overlap {overlap:.2f}"
    if ta != tb:
        lp = torch.log_softmax(a.double(), dim=-1)
        margin = float(lp[ta] - lp[tb])
        note += f", A's margin {margin:.3g} nats"
        if margin > margin_tol:
            status = "FAIL"
    return cos, mx, rel, status, note


# ---- the chain ---------------------------------------------------------------------------------------
class Diff:
    def __init__(self, opts: DiffOptions, out: TextIO | None = None, sides: list[Side] | None = None):
        self.o = opts
        self.out = out or sys.stdout
        self.report = DiffReport()
        self.sides = sides or [Side("A", opts.backend_a), Side("B", opts.backend_b)]
        if len(self.sides) != 2:
            raise ValueError("dsv4 diff compares exactly two sides")
        if opts.prompt_len < 2:
            raise ValueError(f"--prompt-len {opts.prompt_len}: at least 2")
        if opts.greedy_tokens < 1:
            raise ValueError("--greedy-tokens must be ≥ 1")

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def add(self, stage: str, where: str, cmp: tuple) -> Row:
        cos, mx, rel, status, note = cmp
        r = Row(stage, where, cos, mx, rel, status, note)
        self.report.rows.append(r)
        return r

    # ---- setup ----------------------------------------------------------------------------------------
    def _availability(self) -> str | None:
        from ..ops.platform import detect_platform

        plat = detect_platform()
        self.report.info["platform"] = plat.describe()
        for s in self.sides:
            if s.model is None and s.backend == "triton" and not plat.triton:
                how = ("set TRITON_INTERPRET=1 to run the kernels in the Triton interpreter"
                       if plat.kind == "cpu" else "Triton is not importable here")
                return f"backend {s.name}={s.backend}: unavailable on {plat.describe()} ({how})"
        return None

    def _build(self) -> None:
        from ..cache.paged import PagedSequenceView
        from ..engine.settings import EngineConfig
        from ..model.cache import CacheNumerics
        from ..model.model import ReferenceModel
        from ..model.weights import ModelWeights
        from ..ops.selection import fast_path, resolve_op_set

        dev = torch.device(self.o.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.numerics = CacheNumerics(self.o.kv_cache_dtype, self.o.fp8_format)  # both sides' caches
        shared = None
        for s in self.sides:
            if s.model is not None:
                continue
            dtype = EngineConfig(model=self.o.model, dtype=self.o.dtype).torch_dtype(dev)
            if not fast_path(s.backend, dev):  # both torch sides share one set of weights
                if shared is None:
                    shared = ModelWeights(self.o.model, dtype, dev, progress=False)
                s.model = ReferenceModel(shared, numerics=self.numerics)
            else:
                s.model = ReferenceModel(self.o.model, dtype=dtype, device=dev, numerics=self.numerics,
                                         ops=resolve_op_set(s.backend, "reference", dev))
        for s in self.sides:
            s.view_cls = s.view_cls or PagedSequenceView
        self.cfg = self.sides[0].model.cfg

    def _view(self, side: Side, max_len: int):
        from ..cache.paged import CacheAllocation, CacheBudget, PagedKVCache, unit_bytes
        from ..model.step import BLOCK, SWA_PAGE

        m = side.model
        blk, swa, slot = unit_bytes(self.cfg, self.numerics, m.dtype)
        nb, npages = -(-max_len // BLOCK), -(-max_len // SWA_PAGE)
        kvc = PagedKVCache(self.cfg, self.numerics, CacheBudget(nb, npages, 1, blk, swa, slot), m.dtype, m.device)
        return side.view_cls(kvc, CacheAllocation(blocks=list(range(nb)), swa=list(range(npages)), slot=0))

    # ---- 1. cache round trip ---------------------------------------------------------------------------
    def _round_trip(self, side: Side) -> None:
        from ..formats import quantize_kv, read_kv_raw
        from ..model.step import SWA_PAGE

        cfg, num = self.cfg, self.numerics
        m = side.model
        n = max(self.o.prompt_len, SWA_PAGE + 8)
        view = self._view(side, n)
        g = torch.Generator().manual_seed(self.o.seed + 7)
        pos = torch.arange(n, device=m.device)
        stage = f"cache round trip ({side.name})"
        layers = list(range(cfg.num_hidden_layers + cfg.num_draft_layers))
        for layer in layers:
            x = (torch.randn(n, cfg.head_dim, generator=g) * 2).to(m.device)
            view.write_kv(layer, pos, x.to(m.dtype))
            want = num.kv(x.to(m.dtype).float()).to(m.dtype) if num.quantized else x.to(m.dtype)
            got = view.read_kv(layer, pos)
            cmp = list(compare_tensors(want, got, 0.0, 0.0, exact=True))
            values_ok = cmp[3] == "PASS"
            note = []
            bytes_ok = True
            if num.quantized:
                t = view.kvc.swa[layer]
                pages, off = view._swa_slots(pos)
                data, scale = read_kv_raw(t, pages, off, None, SWA_PAGE)
                qd, qs = quantize_kv(x.to(m.dtype).float(), num.fmt)
                bytes_ok = torch.equal(data.cpu(), qd.cpu()) and torch.equal(scale.cpu(), qs.cpu())
                note.append(f"bytes at the writer's addresses {'== codec' if bytes_ok else '!= codec'}")
                note.append(f"scale bytes of token 0: {scale[0].tolist()}")
                if not bytes_ok:
                    cmp[3] = "FAIL"
            if not values_ok:
                note.insert(0, "values read back != the codec's fake quant: "
                               + ("the bytes are right, so the reader" if bytes_ok
                                  else "the bytes are wrong (the writer)"))
            elif not bytes_ok:
                note.insert(0, "the writer's bytes differ from the codec")
            cmp[4] = "; ".join([cmp[4]] + note if cmp[4] else note)
            self.add(stage, f"layers.{layer} window KV ({n} tokens)", cmp)
        for layer in range(cfg.num_hidden_layers):
            ratio = cfg.compress_ratio(layer)
            if ratio == 0:
                continue
            kinds = [("kv", cfg.head_dim)] + ([("index", cfg.index_head_dim)] if ratio == 4 else [])
            for kind, width in kinds:
                cnt = max(1, n // ratio)
                idx = torch.arange(cnt, device=m.device)
                e = (torch.randn(cnt, width, generator=g) * 2).to(m.device)
                view.write_compressed(layer, kind, idx, e.float())
                if not num.quantized:
                    want = e.to(m.dtype)
                elif kind == "kv":
                    want = num.kv(e.float(), compressed=True).to(m.dtype)
                else:
                    want = num.index_k(e.float()).to(m.dtype)
                got = view.read_compressed(layer, kind, idx)
                cmp = list(compare_tensors(want, got, 0.0, 0.0, exact=True))
                if cmp[3] == "FAIL" and cmp[0] is not None:
                    cmp[4] = "values read back != the codec's fake quant"
                self.add(stage, f"layers.{layer} compressed {kind} ({cnt} entries)", cmp)

    # ---- 2-5. the model chain --------------------------------------------------------------------------
    @torch.no_grad()
    def _run_side(self, side: Side, prompt: list[int], feed: int | None) -> dict:
        """Prefill (hidden per layer, last logits), one decode step of ``feed`` with every capture,
        then greedy continuation. Returns the captures."""
        from ..model.step import SeqChunk

        m = side.model
        cap: dict = {"prefill": {}, "decode": {}, "order": []}
        view = self._view(side, len(prompt) + self.o.greedy_tokens + 2)
        dev = m.device
        ids = torch.tensor(prompt, dtype=torch.long, device=dev)

        def layer_hook(name, streams, where="prefill"):
            cap[where][name] = streams[-1].detach().float().cpu()  # the last token's streams

        out = m.forward(
            ids,
            [SeqChunk(view, 0, len(prompt))],
            logits_rows=torch.tensor([len(prompt) - 1], device=dev),
            hook=layer_hook,
        )
        cap["prefill_logits"] = out.logits[-1].float().cpu()
        first = _first_argmax(cap["prefill_logits"])
        tok = first if feed is None else feed
        tok = max(tok, 0)  # non-finite logits everywhere: feed token 0 so the chain still runs
        # decode step with attention captures
        wrapped = []
        order = cap["order"]

        def attn_hook(name, t):
            cap["decode"][name] = t.detach().float().cpu()
            order.append(name)

        for b in m.blocks:
            inner = b.attn.forward

            def fwd(x, chunks, *rest, _inner=inner, _layer=b.layer):
                y = _inner(x, chunks, *rest)
                name = f"layers.{_layer}.attn.out"
                cap["decode"][name] = y.detach().float().cpu()
                order.append(name)
                return y

            b.attn.forward = fwd
            wrapped.append(b.attn)
        m.set_hooks(attn_hook)

        def dec_hook(name, streams):
            cap["decode"][name] = streams[-1].detach().float().cpu()
            order.append(name)

        try:
            out = m.forward(torch.tensor([tok], device=dev), [SeqChunk(view, len(prompt), 1)], hook=dec_hook)
        finally:
            m.set_hooks(None)
            for a in wrapped:
                del a.forward
        cap["decode_logits"] = out.logits[-1].float().cpu()
        # greedy continuation on this side's own tokens
        seq = [first]
        last = cap["decode_logits"]
        pos = len(prompt) + 1
        for _ in range(self.o.greedy_tokens - 1):
            t = _first_argmax(last)
            seq.append(t)
            if t < 0:  # non-finite logits: nothing left to follow
                break
            last = m.forward(torch.tensor([t], device=dev), [SeqChunk(view, pos, 1)]).logits[-1].float().cpu()
            pos += 1
        cap["greedy"] = seq
        cap["fed"] = tok
        return cap

    def run(self) -> DiffReport:
        o = self.o
        A, B = self.sides
        self.say(
            f"### dsv4 diff: A={A.backend} vs B={B.backend} on {o.model} (kv cache {o.kv_cache_dtype}, "
            f"{o.fp8_format}; prompt {o.prompt_len} tokens; tolerances 1-cos ≤ {o.cos_tol:g}, rel ≤ {o.rel_tol:g})"
        )
        why = self._availability()
        if why is not None:
            self.report.status = "UNAVAILABLE"
            self.report.info["unavailable"] = why
            self.say(f"UNAVAILABLE: {why}")
            self._write_json()
            return self.report
        t0 = time.perf_counter()
        self._build()
        self.report.info.update(
            dtype=str(A.model.dtype),
            device=str(A.model.device),
            prompt_len=o.prompt_len,
            backend_a=A.backend,
            backend_b=B.backend,
        )
        for s in (A, B):
            self._round_trip(s)
        g = torch.Generator().manual_seed(o.seed)
        lo, hi = 3, max(4, min(self.cfg.vocab_size, 129000))
        prompt = torch.randint(lo, hi, (o.prompt_len,), generator=g).tolist()
        ca = self._run_side(A, prompt, None)
        cb = self._run_side(B, prompt, ca["fed"])
        for layer in range(self.cfg.num_hidden_layers):
            name = f"layers.{layer}"
            self.add(
                "prefill hidden",
                f"{name} (last token of {o.prompt_len})",
                compare_tensors(ca["prefill"][name], cb["prefill"].get(name, torch.empty(0)), o.cos_tol, o.rel_tol),
            )
        for name in ca["order"]:
            if name not in cb["decode"]:
                self.add("decode step", name, (None, None, None, "FAIL", "missing on B"))
                continue
            self.add("decode step", name, compare_tensors(ca["decode"][name], cb["decode"][name], o.cos_tol, o.rel_tol))
        self._annotate_selection()
        self.add(
            "next-token logits",
            "after prefill",
            compare_logits(ca["prefill_logits"], cb["prefill_logits"], o.top_k, o.cos_tol, o.rel_tol, o.margin_tol),
        )
        self.add(
            "next-token logits",
            f"after decode of token {ca['fed']}",
            compare_logits(ca["decode_logits"], cb["decode_logits"], o.top_k, o.cos_tol, o.rel_tol, o.margin_tol),
        )
        sa, sb = ca["greedy"], cb["greedy"]
        p = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), None)
        self.report.greedy = {"A": sa, "B": sb, "first_difference": p}
        self.report.rows.append(
            Row(
                "greedy",
                f"{len(sa)} tokens",
                status="PASS" if p is None else "FAIL",
                note="identical" if p is None else f"first differs at position {p}: {sa[p]} vs {sb[p]}",
            )
        )
        self.report.info["seconds"] = round(time.perf_counter() - t0, 2)
        bad = [r for r in self.report.rows if r.status == "FAIL"]
        self.report.status = "FAIL" if bad else "PASS"
        self.report.first_divergence = bad[0] if bad else None
        self._print()
        self._write_json()
        return self.report

    def _annotate_selection(self) -> None:
        """Attention logits that part while q and the keys agree: the key *set* differs (a near-tie in the
        CSA Lightning Indexer's top-k moves an entry in or out), not the arithmetic."""
        from ..config import LayerType

        rows = {r.where: r for r in self.report.rows if r.stage == "decode step"}
        for layer in range(self.cfg.num_hidden_layers):
            pre = f"layers.{layer}.attn."
            lg = rows.get(pre + "logits")
            if lg is None or lg.status != "FAIL":
                continue
            inputs = [rows.get(pre + k) for k in ("q", "k_window", "k_compressed")]
            if all(r is None or r.status == "PASS" for r in inputs):
                csa = self.cfg.layer_type(layer) == LayerType.CSA
                lg.note = "q and keys agree: " + (
                    "the Lightning Indexer's top-k selection differs (near-tie scores)"
                    if csa
                    else "the set of keys differs"
                )

    # ---- output ------------------------------------------------------------------------------------------
    def _print(self) -> None:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        stage = None
        for r in self.report.rows:
            if r.stage != stage:
                stage = r.stage
                self.say(f"--- {stage}")
                self.say(f"  {'where / op':<44} {'cos':>12} {'max|a-b|':>11} {'rel':>10}  status  note")
            self.say(
                f"  {r.where:<44} {f(r.cos, '.8f'):>12} {f(r.max_abs, '.3e'):>11} {f(r.rel, '.2e'):>10}  "
                f"{r.status:<6}  {r.note}"
            )
        gr = self.report.greedy
        self.say(f"greedy A: {gr.get('A')}")
        self.say(f"greedy B: {gr.get('B')}")
        fd = self.report.first_divergence
        if fd is None:
            self.say("DIFF_VERDICT: PASS (A and B agree at every step of the chain)")
        else:
            self.say(
                f"FIRST_DIVERGENCE: {fd.stage} / {fd.where}"
                + (f": cos {fd.cos:.6f}, max|a-b| {fd.max_abs:.3e}, rel {fd.rel:.2e}" if fd.cos is not None else "")
                + (f" ({fd.note})" if fd.note else "")
            )
            self.say("DIFF_VERDICT: FAIL")

    def _write_json(self) -> None:
        if self.o.json_report:
            Path(self.o.json_report).write_text(json.dumps(self.report.to_dict(), indent=2, default=str))
            self.say(f"JSON report: {self.o.json_report}")


def run_diff(opts: DiffOptions, out: TextIO | None = None, sides: list[Side] | None = None) -> DiffReport:
    return Diff(opts, out=out, sides=sides).run()
