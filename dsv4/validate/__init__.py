"""Validation toolkit: the evidence-chain probe, the backend diff, the serving benchmark.

* :mod:`dsv4.validate.verdict` — judge one generated token sequence from its **token ids**
  (never from the final text): BOS/EOS/pad after the first token, repeated tokens, n-gram loops,
  empty or truncated output.
* :mod:`dsv4.validate.finite` — ``--validate``: finite checks at every layer boundary and inside
  attention through the model's hooks; names the first layer/op that went non-finite.
* :mod:`dsv4.validate.oracle` — reference agreement: the engine's greedy tokens against the
  dense-cache reference model run teacher-forced in the same numerics.
* :mod:`dsv4.validate.probe` — ``dsv4 probe``: env → config → checkpoint → engine init → generate
  → batch/repeat consistency → reference agreement → golden tokens, with a JSON report.
* :mod:`dsv4.validate.diff` — ``dsv4 diff``: the layered evidence chain between two backends.
* :mod:`dsv4.validate.bench` — ``dsv4 bench serve``: a load generator for OpenAI-compatible servers.

Submodules import torch/httpx lazily where they can; import them directly.
"""

from .verdict import SequenceVerdict, VerdictConfig, judge_tokens  # noqa: F401  (pure Python)

__all__ = ["VerdictConfig", "SequenceVerdict", "judge_tokens"]
