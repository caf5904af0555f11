"""Does the canary's Lightning Indexer find the asked record? A diagnostic for far recall.

For each held-out recall prompt (a cluster of records ``ab:123;`` in filler, then ``?ab=``; the asked record starts at
least 150 tokens back, beyond the 128-token window), the reference model (fp32, CPU) prefills the
prompt and the CSA layers' top-k selection at the last prompt token is recorded. Reported per
layer: how often an entry holding a token of the asked key (ratio-4 entry e pools positions
4e..4e+3, and with the overlap 4e-4..4e-1 too) is selected, against the share a random choice of
k of the visible entries would hit; and the model's greedy answer.

    python bench/canary_recall_probe.py [dsv4/assets/canary] [--n 24]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import dsv4.model.attention as A  # noqa: E402
from dsv4.canary.eval import evaluate_reference, prompt_ids  # noqa: E402
from dsv4.canary.tasks import heldout  # noqa: E402
from dsv4.canary.tokenizer import CharCodec  # noqa: E402
from dsv4.model.attention import SeqChunk  # noqa: E402
from dsv4.model.model import ReferenceModel  # noqa: E402


def key_positions(prompt: str) -> tuple[list[int], int]:
    """Token positions (BOS = 0) of the asked record's key characters, and the question's distance."""
    body, key = prompt[: prompt.rindex("?")], prompt[prompt.rindex("?") + 1: -1]
    i = body.index(key + ":")
    return [1 + i, 2 + i], len(body) - i


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="dsv4/assets/canary")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--all-entries", action="store_true",
                    help="also answer with every visible compressed entry selected (the indexer bypassed): "
                         "does attention find the record when the indexer is not in the way?")
    a = ap.parse_args(argv)
    model = ReferenceModel(a.model, dtype=torch.float32)
    seen: list[tuple[int, torch.Tensor, int]] = []
    real = A.Attention.indexer_topk

    def recording(self, x, qr, chunk, n_entries):
        idx = real(self, x, qr, chunk, n_entries)
        seen.append((self.layer, idx[-1].clone(), n_entries))
        return idx

    A.Attention.indexer_topk = recording
    codec = CharCodec()
    examples = [e for e in heldout(recall_per_task=a.n) if e.task == "recall"][: a.n]
    hits: dict[int, list[tuple[bool, float]]] = {}
    for ex in examples:
        seen.clear()
        ids = prompt_ids(ex, codec)
        model.forward(torch.tensor(ids), [SeqChunk(model.new_cache(), 0, len(ids))])
        keys, dist = key_positions(ex.prompt)
        want = {p // 4 for p in keys} | {p // 4 + 1 for p in keys}  # own block, and the next one's overlap
        for layer, idx, n in seen:
            sel = {int(e) for e in idx.tolist() if e >= 0}
            visible = (len(ids)) // 4
            hits.setdefault(layer, []).append((bool(sel & want), min(1.0, len(sel) * len(want & set(range(visible)))
                                                                        / max(visible, 1))))
    res = evaluate_reference(model, examples)
    A.Attention.indexer_topk = real
    for layer, rows in sorted(hits.items()):
        got = sum(h for h, _ in rows)
        chance = sum(c for _, c in rows) / len(rows)
        print(f"layer {layer}: an entry of the asked key selected in {got} of {len(rows)} prompts "
              f"(a random top-k: ~{chance:.2f} of them)")
    print(f"greedy recall accuracy on these prompts: {res['accuracy'].get('recall')}")
    if a.all_entries:
        def everything(self, x, qr, chunk, n_entries):
            vis = (chunk.positions + 1) // 4
            ar = torch.arange(n_entries)
            return torch.where(ar[None, :] < vis[:, None], ar[None, :], -1)

        A.Attention.indexer_topk = everything
        res = evaluate_reference(model, examples)
        A.Attention.indexer_topk = real
        print(f"with every visible entry selected: recall accuracy {res['accuracy'].get('recall')}")


if __name__ == "__main__":
    main()
