"""Judge one generated sequence from its token ids.

The verdict never looks at the final text: a tokenizer drops special tokens from text, so
``[32, 0, 0, …, 0]`` ('>' followed by BOS) prints as the harmless-looking ``'>'``, which a weak
"non-empty and not repetitive" text check passed in a real bring-up. Every rule here works on ids:

* empty output;
* BOS anywhere in the output (a generated BOS is never legitimate; ``[token, BOS, BOS, …]`` is the
  signature of a decode step reading a corrupted cache);
* BOS/EOS/pad repeated after the first token (with ``ignore_eos`` the engine keeps going past an
  EOS, so one EOS is allowed, a second is not); without ``ignore_eos`` an EOS that is not the last
  token (the engine should have stopped there);
* one token repeated ``max_run`` times in a row, or making up more than ``max_token_share`` of an
  output of at least ``share_min_tokens`` tokens;
* an n-gram loop: a stretch that repeats an n-gram (2 ≤ n ≤ ``loop_max_period``) at least
  ``loop_min_repeats`` times and covers at least ``loop_min_tokens`` tokens;
* a run that did not finish, or stopped before ``max_tokens`` although ``ignore_eos`` was set.

Pure Python (no torch), so it is cheap to call on every output and to unit-test.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class VerdictConfig:
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = None  # DeepSeek-V4's pad token is EOS; set it when it differs
    max_run: int = 8
    max_token_share: float = 0.5
    share_min_tokens: int = 16
    loop_max_period: int = 8
    loop_min_repeats: int = 3
    loop_min_tokens: int = 12



@dataclass
class SequenceVerdict:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        return "PASS" if self.ok else "FAIL"

    def summary(self) -> str:
        if self.ok:
            return "PASS" + (f" (warnings: {'; '.join(self.warnings)})" if self.warnings else "")
        return "FAIL: " + "; ".join(self.problems)

    def to_dict(self) -> dict:
        return {"status": self.status, "problems": list(self.problems), "warnings": list(self.warnings)}


def _positions(ids: Sequence[int], token: int, start: int = 0) -> list[int]:
    return [i for i in range(start, len(ids)) if ids[i] == token]


def _short(xs: list[int], n: int = 8) -> str:
    return str(xs[:n])[:-1] + (", …]" if len(xs) > n else "]")


def longest_run(ids: Sequence[int]) -> tuple[int, int, int]:
    """(length, token, start) of the longest run of one repeated token (0, -1, -1 when empty)."""
    best = (0, -1, -1)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[i]:
            j += 1
        if j - i + 1 > best[0]:
            best = (j - i + 1, ids[i], i)
        i = j + 1
    return best


def find_loop(
    ids: Sequence[int], max_period: int = 8, min_repeats: int = 3, min_tokens: int = 12
) -> tuple[int, int, int] | None:
    """The first periodic stretch (period n ≥ 2) long enough to be a loop: (period, start, length).

    A stretch of period n is a maximal range where ``ids[i] == ids[i - n]``; its length counts the
    n tokens that start it. Smallest period first, so a 2-gram loop is not reported as a 4-gram.
    """
    L = len(ids)
    for n in range(2, max_period + 1):
        need = max(min_repeats * n, min_tokens)
        i = n
        while i < L:
            if ids[i] != ids[i - n]:
                i += 1
                continue
            j = i
            while j < L and ids[j] == ids[j - n]:
                j += 1
            start, length = i - n, j - (i - n)
            if length >= need and len(set(ids[start : start + n])) > 1:
                return n, start, length
            i = j
    return None


def judge_tokens(
    token_ids: Sequence[int],
    *,
    finish_reason: str | None = "length",
    max_tokens: int | None = None,
    ignore_eos: bool = False,
    config: VerdictConfig | None = None,
) -> SequenceVerdict:
    """Verdict on one completion's token ids; see the module docstring for the rules."""
    c = config or VerdictConfig()
    ids = [int(t) for t in token_ids]
    v = SequenceVerdict()
    if not ids:
        v.problems.append("empty output (0 tokens)")
        return v
    # ---- special tokens ---------------------------------------------------------------------
    if c.bos_token_id is not None:
        bos = _positions(ids, c.bos_token_id)
        later = [p for p in bos if p >= 1]
        if later:
            v.problems.append(
                f"BOS (id {c.bos_token_id}) after the first token at positions {_short(later)} "
                f"({len(later)} of {len(ids)} tokens): the [token, BOS, BOS, …] pattern of a broken decode"
            )
        elif bos:
            v.problems.append(f"BOS (id {c.bos_token_id}) generated as the first token")
    ends = {t for t in (c.eos_token_id, c.pad_token_id) if t is not None and t != c.bos_token_id}
    for t in sorted(ends):
        name = "EOS" if t == c.eos_token_id else "pad"
        if t == c.eos_token_id and c.pad_token_id == t:
            name = "EOS/pad"
        pos = _positions(ids, t)
        if ignore_eos and len(pos) >= 2:
            v.problems.append(f"{name} (id {t}) repeated {len(pos)} times at positions {_short(pos)}")
        elif not ignore_eos and pos and pos[0] != len(ids) - 1:
            v.problems.append(
                f"{name} (id {t}) at position {pos[0]} is not the last token: the run should have stopped there"
            )
    # ---- repetition ---------------------------------------------------------------------------
    run, tok, start = longest_run(ids)
    if run >= c.max_run:
        v.problems.append(f"token {tok} repeated {run} times in a row from position {start} (limit {c.max_run - 1})")
    if len(ids) >= c.share_min_tokens:
        top, count = Counter(ids).most_common(1)[0]
        if count / len(ids) > c.max_token_share and not (run >= c.max_run and top == tok):
            v.problems.append(f"token {top} makes up {count} of {len(ids)} tokens (> {c.max_token_share:.0%})")
    loop = find_loop(ids, c.loop_max_period, c.loop_min_repeats, c.loop_min_tokens)
    if loop is not None:
        n, s, length = loop
        v.problems.append(f"{n}-gram loop {ids[s : s + n]} repeated over {length} tokens from position {s}")
    # ---- termination ----------------------------------------------------------------------------
    if finish_reason not in ("length", "stop"):
        v.problems.append(f"did not finish normally (finish_reason={finish_reason!r})")
    elif max_tokens is not None:
        if len(ids) > max_tokens:
            v.problems.append(f"{len(ids)} tokens generated but max_tokens={max_tokens}")
        elif ignore_eos and len(ids) < max_tokens:
            v.problems.append(
                f"stopped after {len(ids)} of max_tokens={max_tokens} tokens although ignore_eos was set "
                f"(finish_reason={finish_reason!r})"
            )
        elif finish_reason == "length" and len(ids) != max_tokens:
            v.problems.append(f"finish_reason 'length' after {len(ids)} tokens, max_tokens={max_tokens}")
        if max_tokens >= 2 and len(ids) == 1:
            v.warnings.append("only one token was generated: it came from prefill, decode never ran")
    return v
