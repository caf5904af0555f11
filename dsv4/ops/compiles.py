"""Triton kernel specializations built in this process, counted (a build in a request's path is a stall).

Triton builds a kernel the first time it is launched with a new specialization (constexpr values,
argument dtypes, an integer's divisibility by 16): compiled from source, or loaded from its on-disk
cache. ``install()`` chains a counter onto Triton's post-compile hook; the engine installs it at
start, warms up, and reports the count (``dsv4:kernel_compiles``); after start-up the count must
not move. Under ``TRITON_INTERPRET=1`` nothing is built and the count stays 0.

The on-disk cache is ``dsv4.env.kernel_cache_dir()`` (``TRITON_CACHE_DIR``, else
``$DSV4_CACHE_ROOT/triton``); ``install()`` points Triton at it, so a restart loads what the last start
built instead of compiling it.
"""

from __future__ import annotations

import threading
from collections import deque

from .. import env

_lock = threading.Lock()
_count = 0
_recent: deque = deque(maxlen=16)
_installed = False

def _record(name: str) -> None:
    global _count
    with _lock:
        _count += 1
        _recent.append(name)


def install() -> bool:
    """Count every specialization Triton builds from now on; False where Triton is not importable."""
    global _installed
    if _installed:
        return True
    env.use_kernel_cache_dir()
    try:
        import triton  # noqa: F401
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton (or too old for knobs): nothing is built either
        return False
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        _record(getattr(fn, "name", None) or "kernel")
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    _installed = True
    return True


def count() -> int:
    """Specializations built since ``install()``."""
    return _count


def recent() -> list[str]:
    """The names of the last kernels built (newest last)."""
    with _lock:
        return list(_recent)
