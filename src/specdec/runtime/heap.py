"""Giving freed memory back to the operating system while a model is packed (runtime/weights.py).

Packing reads a layer's float weights, packs them and frees them, layer after layer. glibc's malloc raises its
threshold for serving large blocks from fresh mappings each time such a block is freed, so the later, smaller
blocks come from its heap, and a heap freed in the middle stays counted in the process's resident memory: loading
Qwen2.5-1.5B's shape in int8 ended 0.9 GB above its packed weights (benchmarks/load_memory.py). `malloc_trim(0)`
returns every whole free page of the heap. Elsewhere (another C library, macOS, Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS (glibc); False where this C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
