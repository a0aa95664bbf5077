"""Handing freed memory back to the operating system between large steps."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int]:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return lambda _pad: 0


_trim = _malloc_trim()


def trim_heap() -> None:
    """malloc_trim only: cheap enough to call after every tensor."""
    _trim(0)


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc keeps it per thread arena otherwise).

    Worker threads free their chunk buffers into per-thread arenas; without this, resident
    memory tracks the high-water mark of every arena instead of what is live.
    """
    gc.collect()
    _trim(0)
