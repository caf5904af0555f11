"""What the engine runs its model through: this process alone (``LocalExecutor``), or a group of
processes (``dsv4.parallel``'s tensor-parallel driver, a data-parallel rank's executor).

The engine schedules, samples and keeps its cache books the same way for every executor: it asks
one to mirror the cache it allocates, to capture the decode graphs, and to stop; a step's forward
goes through the executor's ``model``, whose forward runs the step on every process.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .runner import ModelBackend


class Executor(Protocol):
    """``model``: the forward the runner and the proposer call (a multi-process executor's sends the
    step to the other processes first). ``one_process``: no other process takes part in a step (only
    then are the speculative graphs captured, and nothing is left to stop). ``takes_host_inputs``:
    ``model.forward`` takes the step's host-side inputs (``host=``, ``runner.HostInputs``) so that
    shipping the step never reads the device."""

    model: ModelBackend
    device: torch.device
    one_process: bool
    takes_host_inputs: bool

    def start_caches(self, budget, numerics, kv) -> None:
        """The engine made its paged cache (``budget``, ``numerics``) and its manager ``kv``: other
        processes make the same, and replay the cache writes ``kv`` publishes."""

    def capture_graphs(self, kvc, max_num_seqs: int, max_model_len: int):
        """The decode forward's CUDA graphs over ``kvc``, captured on every process; returns what
        the runner replays (``runner.graphs``)."""

    def shutdown(self) -> None:
        """Stop the other processes (the engine released its graphs first)."""


class LocalExecutor:
    """The one-process executor: the model runs here and the cache is only this process's."""

    one_process = True
    takes_host_inputs = False

    def __init__(self, model: ModelBackend):
        self.model = model
        self.device = model.device

    def start_caches(self, budget, numerics, kv) -> None:
        pass

    def capture_graphs(self, kvc, max_num_seqs: int, max_model_len: int):
        from .cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, kvc, max_num_seqs, max_model_len)
        graphs.capture()
        return graphs

    def shutdown(self) -> None:
        pass
