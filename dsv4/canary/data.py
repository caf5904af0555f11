"""Training batches for the canary: token ids, loss masks and one sequence chunk per sample run.

A batch is a list of independent sequences (each its own :class:`SeqChunk` with a fresh cache,
starting at position 0), concatenated along the token axis the way the engine batches requests:
each holds a few *recall* parts (a needle cluster of records in filler, then several questions
about records 150+ tokens back: the long-context signal) and short add/mul/copy/near-recall
samples packed back to back,
so a sequence of ~1500 tokens carries dozens of answers. Some short samples drop their BOS (raw
``dsv4 generate`` prompts have none) and some are wrapped in the chat encoding (``dsv4 serve``).
Only answer tokens and the closing EOS are trained on: the rest of a prompt is random by design.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .tasks import FAR, FILLER, RECORD_LEN, Example, make_add, make_cluster, make_copy, make_mul, make_record_run
from .tokenizer import CharCodec


@dataclass
class Sequence:
    ids: list[int]
    target: list[float]  # loss weight of token i (predicted from row i-1): 0 for prompt tokens


def sample_tokens(ex: Example, codec: CharCodec, bos: bool = True, chat: str | None = None) -> Sequence:
    """One sample: [BOS] prompt answer EOS, or the chat form ``<｜User｜>prompt<｜Assistant｜></think>``
    (``chat='plain'``) / ``…<｜Assistant｜><think></think>`` (``chat='think'``)."""
    p = codec.encode(ex.prompt)
    if chat is not None:
        tail = (
            [codec.assistant, codec.think_end]
            if chat == "plain"
            else [codec.assistant, codec.ids["<think>"], codec.think_end]
        )
        p = [codec.user] + p + tail
    head = ([codec.bos] if bos else []) + p
    a = codec.encode(ex.answer) + [codec.eos]
    return Sequence(head + a, [0.0] * len(head) + [1.0] * len(a))


def short_example(rng: random.Random) -> Example:
    r = rng.random()
    if r < 0.32:
        return make_add(rng)
    if r < 0.64:
        return make_mul(rng)
    if r < 0.86:
        return make_copy(rng)
    return make_record_run(rng, length=rng.randint(20, 110), min_distance=0)  # in-window recall: the format


def packed_sequence(
    rng: random.Random, codec: CharCodec, length: int, p_no_bos=0.15, p_chat=0.15, exclude: frozenset[str] = frozenset()
) -> Sequence:
    ids: list[int] = []
    target: list[float] = []
    while True:
        ex = short_example(rng)
        if ex.prompt in exclude:
            continue
        chat = None
        if rng.random() < p_chat:
            chat = "plain" if rng.random() < 0.5 else "think"
        s = sample_tokens(ex, codec, bos=rng.random() >= p_no_bos, chat=chat)
        if ids and len(ids) + len(s.ids) > length:
            return Sequence(ids, target)
        ids += s.ids
        target += s.target


def recall_sequence(
    rng: random.Random,
    codec: CharCodec,
    lo: int,
    hi: int,
    queries: int = 16,
    p_far: float = 0.8,
    weight: float = 3.0,
    far: tuple[int, int] | None = None,
) -> Sequence:
    """One record run followed by up to ``queries`` questions ``?ab=`` each answered and closed by
    EOS. Several answers per run, each weighted ``weight``: the long-context signal is otherwise
    sparse next to the short samples' answers. A far question (probability ``p_far``) asks a record
    that starts at least FAR tokens back, or, with ``far`` = (lo, hi), lo..hi tokens back."""
    d_lo, d_hi = far or (FAR, None)
    ex = make_record_run(rng, length=rng.randint(lo, hi), min_distance=0)
    text = ex.prompt[: ex.prompt.rindex("?")]
    records = dict(r.split(":") for r in text.split(";") if r)
    keys = list(records)
    order = list(range(len(keys)))
    start = {k: i * RECORD_LEN for i, k in enumerate(keys)}
    ids = [codec.bos] + codec.encode(text)
    target = [0.0] * len(ids)
    for _ in range(rng.randint(1, queries)):
        is_far = rng.random() < p_far
        pick = [i for i in order if d_lo <= len(ids) - 1 - start[keys[i]] <= (d_hi or len(ids))] if is_far else order
        k = keys[rng.choice(pick or order)]
        q = codec.encode(f"?{k}=")
        a = codec.encode(records[k]) + [codec.eos]
        ids += q + a
        target += [0.0] * len(q) + [weight] * len(a)
    return Sequence(ids, target)


def haystack_sequence(
    rng: random.Random,
    codec: CharCodec,
    lo: int,
    hi: int,
    queries: int = 8,
    p_far: float = 0.8,
    weight: float = 3.0,
    far: tuple[int, int] | None = None,
) -> Sequence:
    """The held-out recall format (:func:`tasks.make_recall`) with several answered questions: about
    lo..hi tokens of filler around one needle cluster, then up to ``queries`` questions about its
    records. With probability ``p_far`` the filler after the cluster is ``far`` = (lo, hi) tokens
    long (default FAR..hi), so every record starts more than lo tokens before any question;
    otherwise the questions follow the cluster inside the window."""
    keys, values = make_cluster(rng)
    cluster = "".join(f"{k}:{v};" for k, v in zip(keys, values))
    if rng.random() < p_far:
        d_lo, d_hi = far or (FAR, max(FAR, hi - len(cluster)))
        tail = rng.randint(d_lo, d_hi)
    else:
        tail = rng.randint(0, 16)
    head = max(0, rng.randint(lo, hi) - len(cluster) - tail)
    ids = [codec.bos] + codec.encode(FILLER * head + cluster + FILLER * tail)
    target = [0.0] * len(ids)
    for _ in range(rng.randint(1, queries)):
        k = rng.randrange(len(keys))
        q = codec.encode(f"?{keys[k]}=")
        a = codec.encode(values[k]) + [codec.eos]
        ids += q + a
        target += [0.0] * len(q) + [weight] * len(a)
    return Sequence(ids, target)


NEAR_RUN = (20, 90)  # a near-phase record run: with NEAR_QUERIES questions it stays in the window
NEAR_QUERIES = 4  # 1 + 90 + 4 × 8 tokens < 128


def mixed_sequence(
    rng: random.Random,
    codec: CharCodec,
    length: int,
    recall_len: tuple[int, int],
    exclude: frozenset[str] = frozenset(),
    n_recall: int = 1,
    near: bool = False,
    far: tuple[int, int] | None = None,
    haystack: bool = True,
) -> Sequence:
    """``n_recall`` recall runs (with their questions) and short samples, in random order, about
    ``length`` tokens.

    ``near``: the recall runs are short and every question is answered inside the sliding window
    (curriculum: the lookup itself is learnt over plain attention before it has to go through the
    compressed caches, whose questions give no usable signal until it is).
    ``far`` = (lo, hi): far questions ask records lo..hi tokens back (curriculum: just beyond the
    window first, where the ratio-4 entries are fine-grained and the indexer has few candidates).
    ``haystack``: the far runs are needle clusters in filler (the held-out format); otherwise dense
    record runs (the format of runs 1-10).

    Few long sequences rather than many short ones: the reference runs attention per sequence, so
    a training step's cost grows with the number of sequences far more than with their length.
    """
    if near:
        parts = [recall_sequence(rng, codec, *NEAR_RUN, queries=NEAR_QUERIES, p_far=0.0) for _ in range(n_recall)]
    else:
        make = haystack_sequence if haystack else recall_sequence
        parts = [make(rng, codec, *recall_len, far=far) for _ in range(n_recall)]
    used = sum(len(r.ids) for r in parts)
    parts.append(packed_sequence(rng, codec, max(length - used, 32), exclude=exclude))
    rng.shuffle(parts)
    return Sequence(sum((q.ids for q in parts), []), sum((q.target for q in parts), []))


def make_batch(
    rng: random.Random,
    codec: CharCodec,
    n_seqs: int,
    length: int,
    recall_len: tuple[int, int],
    exclude: frozenset[str] = frozenset(),
    n_recall: int = 1,
    near: bool = False,
    far: tuple[int, int] | None = None,
    haystack: bool = True,
) -> list[Sequence]:
    return [
        mixed_sequence(rng, codec, length, recall_len, exclude, n_recall, near, far, haystack) for _ in range(n_seqs)
    ]
