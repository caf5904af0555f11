"""How often the canary's SwiGLU clamp engages: the share of routed/shared-expert gate values above
the limit or up values beyond ±limit, over the held-out mul and copy prompts (reference model, CPU),
with the accuracy on them. docs/canary.md compares checkpoints with it (runs 4, 6, 7: ~24 % each).

    python bench/canary_clamp_share.py dsv4/assets/canary /path/to/other/canary
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import dsv4.model.moe as moe  # noqa: E402
from dsv4.canary.eval import evaluate_reference  # noqa: E402
from dsv4.canary.tasks import heldout  # noqa: E402
from dsv4.model.linear import linear  # noqa: E402
from dsv4.model.model import ReferenceModel  # noqa: E402


def main(dirs: list[str]) -> None:
    stats = {"n": 0, "past": 0}
    real = moe.swiglu

    def counting_swiglu(x, w1, w3, w2, limit, act_quant=False):
        g, u = linear(x, w1, act_quant).float(), linear(x, w3, act_quant).float()
        stats["n"] += g.numel()
        stats["past"] += int(((g > limit) | (u.abs() > limit)).sum())
        return real(x, w1, w3, w2, limit, act_quant)

    moe.swiglu = counting_swiglu
    examples = [e for e in heldout(8) if e.task in ("mul", "copy")]
    for d in dirs:
        stats.update(n=0, past=0)
        acc = evaluate_reference(ReferenceModel(d, dtype=torch.float32), examples)["accuracy"]
        print(f"{d}: {stats['past'] / stats['n']:.4f} of gate/up values past the limit; accuracy {acc}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["dsv4/assets/canary"])
