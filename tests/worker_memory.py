"""A pytest worker's memory: its current RSS and handing its freed heap back to the OS (``tests/conftest.py``'s
guard holds each worker's peak RSS under DSV4_TEST_MAX_RSS_GIB)."""

from __future__ import annotations

import os

settled_mib = 1024.0  # RSS after the last clean-up (collect only when a test left the worker this much larger)


def current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux
        return 0.0


def return_freed_memory() -> None:
    """Collect cycles and hand glibc's freed heap back to the OS (the worker's RSS then counts what lives)."""
    global settled_mib
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    settled_mib = max(1024.0, current_rss_mib())
