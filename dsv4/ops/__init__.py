"""Compute ops with swappable backends (torch reference, Triton kernels) chosen per platform.

    from dsv4.ops import resolve, describe_table
    name, fp8_linear = resolve("fp8_linear")      # highest-priority available backend
    log.info(describe_table())                    # once at startup

Ops: ``fp8_linear``, ``moe_route``, ``moe_experts`` (signatures in ``dsv4.ops.torch_ops``).
Force with ``DSV4_OPS="fp8_linear=torch,moe=triton"`` or ``resolve(..., force={...})``.
"""

from .platform import Platform, detect_platform
from .registry import OPS, BackendError, describe, describe_table, get, register, resolve
from .torch_ops import stack_experts, stack_experts_from_checkpoint

__all__ = ["Platform", "detect_platform", "OPS", "BackendError", "register", "resolve", "get", "describe",
           "describe_table", "stack_experts", "stack_experts_from_checkpoint"]
