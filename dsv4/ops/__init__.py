"""Compute ops with swappable backends (torch reference, Triton kernels) chosen per platform.

    from dsv4.ops import resolve_op_set
    ops = resolve_op_set("auto", "auto", device)    # once per engine: the op set the model is built with

``registry`` holds each op's backends with an availability test and a priority (force single ops
with ``DSV4_OPS="fp8_linear=torch,moe=triton"``); ``selection.resolve_op_set`` is the one place an
engine's op set is chosen; ``platform`` says what this machine runs.
"""

from .platform import Platform, detect_platform
from .registry import OPS, BackendError, describe, describe_table, get, register, resolve
from .selection import resolve_op_set

__all__ = ["Platform", "detect_platform", "OPS", "BackendError", "register", "resolve", "get", "describe",
           "describe_table", "resolve_op_set"]
