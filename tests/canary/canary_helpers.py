"""Helpers shared by tests/canary (imported by its conftest and test files)."""

from __future__ import annotations


def subset(held, counts: dict[str, int]):
    """The first ``counts[task]`` held-out examples of each task (in the recorded order)."""
    out = []
    for task, n in counts.items():
        out += [e for e in held if e.task == task][:n]
    return out


def recorded_on(info: dict, key: str, counts: dict[str, int]) -> dict[str, float]:
    """Recorded accuracy of ``key`` (e.g. 'checkpoint/auto') on the same first-n examples per task."""
    masks = info["correct"][key]
    return {t: masks[t][:n].count("1") / n for t, n in counts.items()}
