"""Built-in backends: torch (always, priority 0) and Triton (priority 10, where Triton runs).

Triton backends are registered by module path, so nothing here imports Triton.
"""

from __future__ import annotations

from . import torch_ops
from .platform import Platform
from .registry import register

TORCH_PRIORITY = 0
TRITON_PRIORITY = 10


def _triton_ok(p: Platform) -> bool:
    return bool(p.triton)


register("fp8_linear", "torch", torch_ops.fp8_linear, lambda p: True, TORCH_PRIORITY)
register("moe_route", "torch", torch_ops.moe_route, lambda p: True, TORCH_PRIORITY)
register("moe_experts", "torch", torch_ops.moe_experts, lambda p: True, TORCH_PRIORITY)

register("fp8_linear", "triton", "dsv4.ops.triton.fp8_linear:fp8_linear", _triton_ok, TRITON_PRIORITY)
register("moe_route", "triton", "dsv4.ops.triton.moe:moe_route", _triton_ok, TRITON_PRIORITY)
register("moe_experts", "triton", "dsv4.ops.triton.moe:moe_experts", _triton_ok, TRITON_PRIORITY)
