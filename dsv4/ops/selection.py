"""The one place an engine's op set is chosen: ``resolve_op_set(backend, attention, device)``."""

from __future__ import annotations

import logging

import torch

from ..model.opset import ATTENTION_OPS, BLOCK_OPS, SAMPLER_OPS, WEIGHT_OPS, OpSet
from . import streams
from .registry import resolve

log = logging.getLogger("dsv4.ops")

BACKENDS = ("auto", "torch", "triton")
ATTENTION = ("auto", "batched", "reference")


def fast_path(backend: str, device: torch.device) -> bool:
    """Whether the model runs the kernels: ``triton``, or ``auto`` off the CPU (on the CPU the Triton
    kernels only run in the interpreter, for tests)."""
    return backend == "triton" or (backend == "auto" and torch.device(device).type != "cpu")


def resolve_op_set(backend: str = "auto", attention: str = "auto", device="cpu", force=None) -> OpSet:
    """The op set of an engine on ``device``.

    ``backend``: ``auto`` (the registry's choice per op: Triton where it runs, off the CPU), ``torch``
    (the reference path: no kernels) or ``triton`` (every op's Triton backend, also under the CPU
    interpreter). ``attention``: ``batched`` (a step's attention over the pages at once),
    ``reference`` (per request, through the oracle) or ``auto`` (batched on the fast path). On the
    fast path weights stay in their checkpoint formats; a building block keeps the oracle's torch code
    unless a real kernel is chosen for it, and the model's concurrent branches run on CUDA side streams
    (``dsv4.ops.streams``). ``force`` (and ``DSV4_OPS``) pin single ops
    (``dsv4.ops.registry``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}; got {attention!r}")
    fast = fast_path(backend, device)
    chosen: dict[str, tuple[str, object]] = {}
    if fast:
        pin = dict(force or {}) if backend == "auto" else {
            **{op: "triton" for op in WEIGHT_OPS + BLOCK_OPS + SAMPLER_OPS}, **dict(force or {})}
        for op in WEIGHT_OPS + SAMPLER_OPS + BLOCK_OPS:
            name, fn = resolve(op, force=pin)
            if op not in BLOCK_OPS or name != "torch":  # a torch building block is the oracle's own code
                chosen[op] = (name, fn)
    if attention == "batched" or (attention == "auto" and fast):
        pin = dict(force or {})
        if backend != "auto":
            pin = {**{op: backend for op in ATTENTION_OPS}, **pin}
        for op in ATTENTION_OPS:
            chosen[op] = resolve(op, force=pin)
    ops = OpSet({op: fn for op, (_, fn) in chosen.items()}, {op: name for op, (name, _) in chosen.items()},
                fork=streams.fork if fast else None)
    log.info("dsv4 ops (backend=%s, attention=%s, %s): %s", backend, attention, torch.device(device), ops.describe())
    return ops
