"""The canary: a small DeepSeek-V4-architecture model trained to answer, shipped as the default model.

Random weights produce noise, so they cannot show that a backend, a cache format or a parallel
layout keeps the model *working*. The canary answers exact tasks (addition, multiplication,
copying, key-value recall across compressed caches), so its greedy accuracy collapses when
something is wrong. ``dsv4 eval canary`` measures it; ``dsv4 generate`` / ``serve`` / ``probe``
use it when no ``--model`` is given. See ``docs/canary.md``.
"""

from __future__ import annotations

from pathlib import Path

CANARY_DIR = Path(__file__).resolve().parent.parent / "assets" / "canary"


def default_model_dir() -> str:
    """The embedded canary's model directory (``dsv4/assets/canary``)."""
    if not (CANARY_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the embedded canary model is missing: no config.json in {CANARY_DIR} "
                                "(train it with tools/train_canary.py, or pass --model DIR)")
    return str(CANARY_DIR)


def recorded_accuracy(model_dir: str | Path) -> dict | None:
    """Per-task accuracy recorded at training time (``canary.json``), or None if the file is absent."""
    import json

    p = Path(model_dir) / "canary.json"
    if not p.is_file():
        return None
    return json.loads(p.read_text()).get("accuracy")
