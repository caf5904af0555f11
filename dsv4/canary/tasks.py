"""The canary's synthetic tasks, generated on the fly from a seed.

Each task has an exact answer, so greedy accuracy is a sharp signal that the model is *working*:

- ``add``: ``1234+56=`` → ``1290`` (operands of 1–4 digits);
- ``mul``: ``123*45=`` → ``5535`` (1–3 digits times 1–2 digits);
- ``copy``: ``copy:k3x9q=`` → ``k3x9q`` (4–24 characters);
- ``recall``: a needle cluster — 3 to 8 records ``ab:123;`` — inside ``.`` filler, then ``?ab=`` →
  ``123``. In the held-out set the record sits 150+ tokens before the question, beyond the
  128-token window, so the answer can only come through the compressed caches (CSA entries chosen
  by the indexer, HCA entries). The cluster is dense so that one HCA entry (ratio 32) mixes several
  records while a CSA entry (ratio 4) holds about one: the lookup needs the indexer's selection.

A prompt is what the model is given (BOS included); the answer is followed by EOS.
"""

from __future__ import annotations

import random
import string
from dataclasses import asdict, dataclass

TASKS = ("add", "mul", "copy", "recall")
KEY_CHARS = string.ascii_lowercase
COPY_CHARS = string.ascii_lowercase + string.digits
RECORD_LEN = 7  # "ab:123;"
FAR = 150  # held-out recall: the record starts at least this many tokens before the question
FILLER = "."  # the haystack around a recall cluster
CLUSTER = (3, 8)  # records per recall cluster
KEYS = tuple(a + b for a in KEY_CHARS for b in KEY_CHARS)


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # text after BOS (raw form)
    answer: str

    def to_dict(self) -> dict:
        return asdict(self)


def _num(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)


def make_add(rng: random.Random) -> Example:
    a, b = _num(rng, 1, 4), _num(rng, 1, 4)
    return Example("add", f"{a}+{b}=", str(a + b))


def make_mul(rng: random.Random) -> Example:
    a, b = _num(rng, 1, 3), _num(rng, 1, 2)
    return Example("mul", f"{a}*{b}=", str(a * b))


def make_copy(rng: random.Random) -> Example:
    s = "".join(rng.choice(COPY_CHARS) for _ in range(rng.randint(4, 24)))
    return Example("copy", f"copy:{s}=", s)


def make_record_run(rng: random.Random, length: int | None = None, min_distance: int = FAR) -> Example:
    """Records ``ab:123;`` back to back up to about ``length`` tokens, then a question about one.

    ``min_distance``: tokens between the asked record's start and the question (0 = anywhere).
    The training mix uses short runs for in-window recall (the lookup's format).
    """
    length = length or rng.randint(300, 800)
    n = max(2, length // RECORD_LEN)
    keys = rng.sample(KEYS, n)
    values = [f"{rng.randint(0, 999):03d}" for _ in range(n)]
    total = n * RECORD_LEN  # question starts at this offset (after BOS)
    far = [i for i in range(n) if total - i * RECORD_LEN >= min_distance]
    i = rng.choice(far or [0])
    text = "".join(f"{k}:{v};" for k, v in zip(keys, values))
    return Example("recall", f"{text}?{keys[i]}=", values[i])


def make_cluster(rng: random.Random) -> tuple[list[str], list[str]]:
    """A needle cluster's keys (distinct) and 3-digit values."""
    n = rng.randint(*CLUSTER)
    return rng.sample(KEYS, n), [f"{rng.randint(0, 999):03d}" for _ in range(n)]


def make_recall(rng: random.Random, length: int | None = None, min_distance: int = FAR) -> Example:
    """Filler, a needle cluster, filler, then a question about one of the cluster's records.

    About ``length`` tokens before the question; the asked record starts at least
    ``min_distance`` tokens before it.
    """
    length = length or rng.randint(300, 800)
    keys, values = make_cluster(rng)
    cluster = "".join(f"{k}:{v};" for k, v in zip(keys, values))
    i = rng.randrange(len(keys))
    after = (len(keys) - i) * RECORD_LEN  # from the asked record's start to the cluster's end
    tail = rng.randint(max(0, min_distance - after), max(min_distance - after, length - len(cluster), 0))
    head = max(0, length - len(cluster) - tail)
    return Example("recall", f"{FILLER * head}{cluster}{FILLER * tail}?{keys[i]}=", values[i])


MAKERS = {"add": make_add, "mul": make_mul, "copy": make_copy, "recall": make_recall}


def heldout(per_task: int = 32, seed: int = 20260501, recall_per_task: int | None = None) -> list[Example]:
    """The fixed held-out set: the same examples on every machine (``random.Random`` is portable)."""
    out = []
    for task in TASKS:
        rng = random.Random(f"{seed}:{task}")
        n = recall_per_task if (task == "recall" and recall_per_task is not None) else per_task
        out.extend(MAKERS[task](rng) for _ in range(n))
    return out


def score(example: Example, generated: str) -> bool:
    """Exact match of the generated text (up to EOS) with the answer."""
    return generated.strip() == example.answer
