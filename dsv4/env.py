"""Every environment variable dsv4 reads, parsed in one place.

Each is read when asked (not at import), so a test or a launcher may set it first; a value that
cannot be parsed is an error naming the variable.

| variable | meaning |
| --- | --- |
| ``DSV4_OPS`` | force op backends: ``"fp8_linear=torch,moe=triton"``, ``"all=torch"`` (``dsv4.ops.registry``) |
| ``DSV4_BATCH_INVARIANT`` | ``0`` turns the batch-invariant kernel tiles off (``dsv4.ops.invariance``; default on) |
| ``DSV4_PLATFORM_FP8`` | ``ocp`` / ``fnuz``: the FP8 encoding of this machine, whatever it is (``dsv4.ops.platform``) |
| ``TRITON_INTERPRET`` | ``1``: Triton kernels run in its CPU interpreter (Triton's own switch, read here for dsv4) |
| ``DSV4_CACHE_ROOT`` | dsv4's cache directory (default ``~/.cache/dsv4``): compiled kernels in ``triton/`` |
| ``TRITON_CACHE_DIR`` | where Triton keeps compiled kernels (default here: ``$DSV4_CACHE_ROOT/triton``) |
| ``DSV4_API_KEY`` | the server's API key when ``--api-key`` is not given |
| ``OPENAI_API_KEY`` | the key ``dsv4 bench serve`` sends when ``--api-key`` is not given |
"""

from __future__ import annotations

import os
from pathlib import Path

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


def cache_root() -> Path:
    """``DSV4_CACHE_ROOT``, default ``~/.cache/dsv4``."""
    v = os.environ.get("DSV4_CACHE_ROOT")
    return Path(v).expanduser() if v else Path.home() / ".cache" / "dsv4"


def kernel_cache_dir() -> Path:
    """Where compiled Triton kernels are kept: ``TRITON_CACHE_DIR`` if set, else ``$DSV4_CACHE_ROOT/triton``."""
    v = os.environ.get("TRITON_CACHE_DIR")
    return Path(v).expanduser() if v else cache_root() / "triton"


def use_kernel_cache_dir() -> Path:
    """Point Triton at ``kernel_cache_dir()`` (it reads ``TRITON_CACHE_DIR`` when it first compiles)."""
    path = kernel_cache_dir()
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


def api_key() -> str | None:
    """``DSV4_API_KEY``: the server's API key, or None."""
    return os.environ.get("DSV4_API_KEY") or None


def openai_api_key() -> str | None:
    """``OPENAI_API_KEY``: the key the load generator sends, or None."""
    return os.environ.get("OPENAI_API_KEY") or None
