"""Reference agreement: the engine's greedy tokens against the dense-cache reference model.

A deterministic wrong cache reader gives *consistent* garbage — the same tokens at every batch
size and on every repeat — so consistency checks alone cannot see it. The oracle here is the
reference model's forward over a :class:`~dsv4.model.cache.DenseSequenceCache` (plain tensors, no
paging, no block-packed bytes to misread) in the same numerics as the engine (compute dtype, KV
cache dtype, FP8 encoding). It runs **teacher-forced**: one forward over the prompt plus the
engine's first ``n - 1`` tokens gives the oracle's next-token distribution at each of the engine's
first ``n`` steps, so a disagreement at step 3 is not blurred by a divergence at step 2.

Per step: the engine's token vs the oracle's top-1 (FAIL when they differ by a log-prob margin above
``tol``; a near-tie below it is a warning), the engine's reported log-prob of its token vs the
oracle's (FAIL above ``logprob_tol``), and the top-k overlap. Both tolerances bound the *drift* of
the computation; when the logits are rounded to a low-precision ``logit_dtype`` (bf16: the LM head's
output), each bound also admits the rounding of the logits it reads, one ulp at their magnitude —
at |logit| in [16, 32) a bf16 ulp is 0.125 nats, so two computations that differ in the last bit of
one hidden value can part by 0.125 in a logprob with no fault anywhere. By default the oracle shares the
engine's model object (weights and kernels) and differs only in the cache path and batching: it
cannot see a fault both share — a wrong activation formula, say. The probe's golden-token check
(``--expect``) and a trained canary are the detectors for those.

**Precision-conditioned steps.** On random weights a bf16 model is ill-conditioned: MoE routing
scores sit within 1e-3 of each other, so a last-bit difference in a hidden state swaps an expert,
and one swapped expert moves a logprob by 0.1–0.5 nats. Two correct bf16 computations then part
far beyond any rounding bound — measured on the 4-layer flash-width checkpoint on the H200: the
bf16 reference itself is up to 0.25 nats from
the float32 reference, with routing flips at score gaps of 3e-4..8e-2. When ``exact_logits`` (the
same reference in float32, teacher-forced on the same tokens) is given, a step that fails against
the same-precision reference is judged again against the exact one: it passes, as a warning, when
the engine is no farther from the exact function than the same-precision reference is (plus the
drift tolerance) — its logprob within ``lp_tol + |ref - exact|`` of the exact one, its token's exact
margin within ``tie_tol`` + the exact margin of the reference's own top-1. A real fault moves the
engine away from both references; only rounding that the reference shares is forgiven.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class StepAgreement:
    step: int
    engine_token: int
    oracle_token: int
    margin: float  # oracle logprob(top-1) - oracle logprob(engine token); 0 when they agree
    engine_logprob: float | None
    oracle_logprob: float  # oracle's logprob of the engine's token
    topk_overlap: float | None  # |engine top-k ∩ oracle top-k| / k, when the engine reported top-k
    oracle_logit: float | None = None  # the oracle's logit of the engine's token (its magnitude sets its rounding)
    logprob_tol: float | None = None  # the logprob tolerance applied: drift plus the logits' rounding

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Agreement:
    steps: list[StepAgreement] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "warnings": self.warnings,
                "steps": [s.to_dict() for s in self.steps]}


@torch.no_grad()
def teacher_forced_logits(model, numerics, prompt_ids: list[int], gen_ids: list[int], n: int) -> torch.Tensor:
    """Oracle logits [n, V] (fp32, CPU) for the engine's steps 0..n-1 of ``gen_ids`` after ``prompt_ids``."""
    from ..model.cache import DenseSequenceCache
    from ..model.step import SeqChunk

    n = min(n, len(gen_ids))
    ids = list(prompt_ids) + list(gen_ids[: max(n - 1, 0)])
    cache = DenseSequenceCache(model.cfg, numerics)
    dev = model.device
    rows = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + n, device=dev)
    out = model.forward(torch.tensor(ids, dtype=torch.long, device=dev), [SeqChunk(cache, 0, len(ids))],
                        logits_rows=rows)
    return out.logits.float().cpu()


def logit_ulp(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each |x| (0 for float32/64 or ``None``: their
    rounding is far below any tolerance here). Subnormals are ignored: logits that small do not
    matter to a logprob."""
    if dtype is None or dtype in (torch.float32, torch.float64):
        return torch.zeros_like(x, dtype=torch.float64)
    fi = torch.finfo(dtype)
    e = torch.floor(torch.log2(x.double().abs().clamp_min(fi.tiny)))
    return torch.exp2(e) * fi.eps


def _first_argmax(x: torch.Tensor) -> int:
    return int(torch.nonzero(x == x.max())[0, 0])


def compare(gen_ids: list[int], oracle_logits: torch.Tensor, engine_logprobs: list[dict] | None = None,
            tol: float = 0.05, logprob_tol: float = 0.1, top_k: int = 5,
            logit_dtype: torch.dtype | None = None, exact_logits: torch.Tensor | None = None) -> Agreement:
    """Judge the engine's tokens (and reported logprobs) against teacher-forced oracle logits.

    ``logit_dtype``: the precision both sides' logits were rounded to. A logprob l_t - lse moves
    under rounding by at most ulp(l_t) + Σ_i p_i·ulp(l_i) (first order), and a top-1 margin by
    ulp(l_o) + ulp(l_t); each is added to the drift tolerance of that check.

    ``exact_logits``: the reference in float32 on the same tokens; steps that fail the checks above
    are judged again against it (see the module docstring) and pass as warnings when the engine is
    no farther from it than the same-precision reference."""
    a = Agreement()
    for i in range(oracle_logits.shape[0]):
        row = oracle_logits[i]
        t = int(gen_ids[i])
        if not bool(torch.isfinite(row).all()):
            a.problems.append(f"step {i}: the reference itself produced non-finite logits (a fault it shares with "
                              f"the engine, or bad weights)")
            break
        lp = torch.log_softmax(row.double(), dim=-1)
        o = _first_argmax(row)
        margin = float(lp[o] - lp[t])
        ulp = logit_ulp(row, logit_dtype)
        tie_tol = tol + float(ulp[o] + ulp[t])
        lp_tol = logprob_tol + float(ulp[t] + (lp.exp() * ulp).sum())
        e_lp = None
        overlap = None
        if engine_logprobs is not None and i < len(engine_logprobs) and engine_logprobs[i]:
            d = engine_logprobs[i]
            entry = d.get(t)
            e_lp = None if entry is None else float(getattr(entry, "logprob", entry))
            ranked = [k for k, v in d.items() if getattr(v, "rank", None) is not None and v.rank <= top_k]
            if top_k > 0 and len(ranked) >= top_k:
                otop = set(torch.topk(row, top_k).indices.tolist())
                overlap = len(otop & set(ranked)) / top_k
        s = StepAgreement(i, t, o, margin, e_lp, float(lp[t]), overlap, float(row[t]), lp_tol)
        a.steps.append(s)
        what = "first token" if i == 0 else f"step {i}"
        lpx = None if exact_logits is None else torch.log_softmax(exact_logits[i].double(), dim=-1)
        if t != o:
            msg = (f"{what}: engine token {t} differs from the reference's top-1 {o} "
                   f"(margin {margin:.4g} nats, tolerance {_tol_text(tol, tie_tol)})")
            if margin <= tie_tol:
                a.warnings.append(msg + ": a near-tie")
            elif lpx is not None and (ex := float(lpx.max() - lpx[t])) <= tie_tol + (eo := float(lpx.max() - lpx[o])):
                a.warnings.append(msg + f": precision-conditioned — in the float32 reference the engine's token is "
                                  f"{ex:.4g} below the top-1 and the reference's own pick {eo:.4g}")
            else:
                a.problems.append(msg)
        if e_lp is not None and (not torch.isfinite(torch.tensor(e_lp)) or abs(e_lp - float(lp[t])) > lp_tol):
            msg = (f"{what}: engine logprob of token {t} is {e_lp:.5g}, the reference's {float(lp[t]):.5g} "
                   f"(|Δ| > {_tol_text(logprob_tol, lp_tol)})")
            if lpx is not None and math.isfinite(e_lp) and \
                    abs(e_lp - float(lpx[t])) <= lp_tol + abs(float(lp[t] - lpx[t])):
                a.warnings.append(msg + f": precision-conditioned — the float32 reference gives {float(lpx[t]):.5g}: "
                                  f"the engine is {abs(e_lp - float(lpx[t])):.3g} from it, the reference "
                                  f"{abs(float(lp[t] - lpx[t])):.3g}")
            else:
                a.problems.append(msg)
    return a


def _tol_text(drift: float, total: float) -> str:
    return f"{drift:g}" if total == drift else f"{drift:g} + {total - drift:.3g} logit rounding"
