"""Memory for packed weights (runtime/weights.py): giving freed memory back to the operating system while a model is
packed, and asking for huge pages for the packed weights themselves.

Packing reads a layer's float weights, packs them and frees them, layer after layer. glibc's malloc raises its
threshold for serving large blocks from fresh mappings each time such a block is freed, so the later, smaller
blocks come from its heap, and a heap freed in the middle stays counted in the process's resident memory: loading
Qwen2.5-1.5B's shape in int8 ended 0.9 GB above its packed weights (benchmarks/load_memory.py). `malloc_trim(0)`
returns every whole free page of the heap. Elsewhere (another C library, macOS, Windows) this does nothing.

A one-row pass streams every weight from memory once, in order. On 4 KB pages that stream crosses a page every
4 KB, each a TLB entry to walk and a boundary the hardware prefetcher stops at; on 2 MB pages it crosses 512 times
fewer. `empty_on_huge_pages` gives a packed weight a private anonymous mapping of its own, advised MADV_HUGEPAGE, so
Linux backs it with transparent huge pages where its setting is `madvise` (the common default) or `always`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch

#: A huge page: a tensor smaller than one gets no mapping of its own.
HUGE_PAGE = 2 << 20


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


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on a mapping of its own advised MADV_HUGEPAGE (Linux; the mapping lives as long as
    the tensor's storage). Under HUGE_PAGE bytes, or elsewhere than Linux: torch.empty."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (the default, shared, is shmem)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
