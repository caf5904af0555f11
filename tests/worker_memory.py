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


HEAP_BLOCK_MIB = int(os.environ.get("DSV4_TEST_HEAP_BLOCK_MIB", "64"))  # 0: glibc's defaults


def keep_large_blocks_in_heap(mib: int = HEAP_BLOCK_MIB) -> None:
    """Serve allocations up to ``mib`` MiB from glibc's heap and keep up to that much freed at its top, instead
    of mapping each from the OS and unmapping it when freed: the reference attention gathers a [64, L, 512]
    fp32 key block per query block (32 MiB at L = 256), above glibc's 32 MiB mmap ceiling, so every gather
    faulted in fresh pages (26 ms against 11 for the same copy; the engine and canary tests ran 12-25 %
    faster). What the heap keeps still goes back through ``return_freed_memory`` (the RSS guard's clean-up)."""
    import ctypes

    if mib <= 0:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, mib << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, mib << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass
