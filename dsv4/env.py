"""Every environment variable dsv4 reads, parsed in one place.

Each is read when asked (not at import), so a test or a launcher may set it first; a value that
cannot be parsed is an error naming the variable.

| variable | meaning |
| --- | --- |
| ``DSV4_OPS`` | force op backends: ``"fp8_linear=torch,moe=triton"``, ``"all=torch"`` (``dsv4.ops.registry``) |
| ``DSV4_BATCH_INVARIANT`` | ``0`` turns the batch-invariant kernel tiles off (``dsv4.ops.invariance``; default on) |
| ``DSV4_PLATFORM_FP8`` | ``ocp`` / ``fnuz``: the FP8 encoding of this machine, whatever it is (``dsv4.ops.platform``) |
| ``TRITON_INTERPRET`` | ``1``: Triton kernels run in its CPU interpreter (Triton's own switch, read here for dsv4) |
| ``DSV4_API_KEY`` | the server's API key when ``--api-key`` is not given |
| ``OPENAI_API_KEY`` | the key ``dsv4 bench serve`` sends when ``--api-key`` is not given |
"""

from __future__ import annotations

import os

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return default
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {_TRUE + _FALSE}, found {v!r}")


def ops_override() -> str | None:
    """``DSV4_OPS``: the forced backends (parsed by ``dsv4.ops.registry.parse_force``), or None."""
    return os.environ.get("DSV4_OPS") or None


def batch_invariant() -> bool:
    """``DSV4_BATCH_INVARIANT`` (default on)."""
    return _flag("DSV4_BATCH_INVARIANT", True)


def platform_fp8() -> str | None:
    """``DSV4_PLATFORM_FP8``: "ocp", "fnuz", or None when unset."""
    v = os.environ.get("DSV4_PLATFORM_FP8", "").strip().lower()
    if not v:
        return None
    if v not in ("ocp", "fnuz"):
        raise ValueError(f"DSV4_PLATFORM_FP8 must be 'ocp' or 'fnuz', found {v!r}")
    return v


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def api_key() -> str | None:
    """``DSV4_API_KEY``: the server's API key, or None."""
    return os.environ.get("DSV4_API_KEY") or None


def openai_api_key() -> str | None:
    """``OPENAI_API_KEY``: the key the load generator sends, or None."""
    return os.environ.get("OPENAI_API_KEY") or None
