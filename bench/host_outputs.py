"""Host time a request's output costs per engine step, cumulative against delta outputs (CPU).

A completion of ``--tokens`` tokens with top-``--logprobs`` logprobs is appended token by token, as
the engine does; after each token the step's output is built (``Request.completion``) and pickled
(what a data-parallel rank sends to the front end every step). A cumulative output copies the whole
output every step (quadratic in its length); a delta output (``output_kind="delta"``, what the server
streams) costs what the step added. Prints µs per step at a few lengths and the whole completion's
total; ``--out`` writes them as JSON.

    python bench/host_outputs.py --tokens 16384 --logprobs 5
"""

from __future__ import annotations

import argparse
import json
import pickle
import time

from dsv4.engine.outputs import Logprob, RequestOutput
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams


class _Pieces:
    """A detokenizer stand-in: four characters a token."""

    def feed(self, token: int) -> str:
        return f"{token % 1000:03d} "


def run(kind: str, tokens: int, top: int, marks: list[int], window: int = 32) -> dict:
    """µs per step (the mean of the ``window`` steps ending at each mark) and the seconds of the whole
    completion: measured for deltas (built every step, as they must be); for cumulative outputs built
    only in the windows (every step would take minutes) and integrated linearly between the marks."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=top, output_kind=kind)
    req = Request("r0", [1, 2, 3], params, detokenizer=_Pieces())
    delta = kind == "delta"
    per_step, build_step, total, acc, acc_build = {}, {}, 0.0, 0.0, 0.0
    for i in range(1, tokens + 1):
        t = i + 6
        req.append_token(t, {t + j: Logprob(-0.1 * j, j + 1, None) for j in range(top + 1)}, -0.1)
        timed = any(m - window < i <= m for m in marks)
        if not (delta or timed):
            continue
        t0 = time.perf_counter()
        out = RequestOutput("r0", None, req.prompt_token_ids, [req.completion(delta=delta)], False)
        t1 = time.perf_counter()
        pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        dt = time.perf_counter() - t0
        total += dt
        if timed:
            acc, acc_build = acc + dt, acc_build + t1 - t0
            if i in marks:
                per_step[i], build_step[i] = acc / window * 1e6, acc_build / window * 1e6
                acc = acc_build = 0.0
    if not delta:  # the per-step cost grows linearly with the length: integrate between the marks
        pts = [(0, 0.0)] + sorted(per_step.items())
        total = sum((b - a) * (ya + yb) / 2 for (a, ya), (b, yb) in zip(pts, pts[1:])) / 1e6
    return {"us_per_step": per_step, "build_us_per_step": build_step, "total_s": total, "total_measured": delta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--logprobs", type=int, default=5, help="top logprobs per token (0: the sampled one only)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    marks = sorted({m for m in (1024, 4096, 8192, 16384, a.tokens) if m <= a.tokens})
    res = {kind: run(kind, a.tokens, a.logprobs, marks) for kind in ("cumulative", "delta")}
    print(f"host time of one request's output per step (build + pickle), {a.tokens} tokens, top-{a.logprobs} logprobs")
    print(f"{'output length':>13} {'cumulative µs':>14} {'of which build':>14} {'delta µs':>9} {'of which build':>14}")
    c, d = res["cumulative"], res["delta"]
    for m in sorted(d["us_per_step"]):
        print(f"{m:>13} {c['us_per_step'][m]:>14.1f} {c['build_us_per_step'][m]:>14.1f} {d['us_per_step'][m]:>9.1f} "
              f"{d['build_us_per_step'][m]:>14.1f}")
    print(f"{'whole output':>13} {res['cumulative']['total_s']:>13.2f}s {res['delta']['total_s']:>8.3f}s"
          "  (cumulative: integrated from the marks)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"tokens": a.tokens, "logprobs": a.logprobs, **res}, f, indent=1)


if __name__ == "__main__":
    main()
