"""Keeps freed activation memory in the process instead of returning it to the OS.

Every step allocates and frees tens of MB of activations. With glibc's defaults the freed top of the
heap is trimmed back to the OS and large buffers are mmapped anew, so each step page-faults its
buffers in again (measured: 1-3 M minor faults and 5-8 s of system time per 100 requests of the
benchmark). Raising the trim threshold and top pad, and the mmap threshold to its maximum, removes
most of that. glibc-only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX_BYTES = 32 * 1024 * 1024  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
_tuned: list[bool] = []


def keep_freed_memory(top_pad_bytes: int = 1 << 30) -> bool:
    """Tune the allocator once per process; returns whether glibc accepted every setting."""
    if _tuned:
        return _tuned[0]
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        _tuned.append(False)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    accepted = [
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES),
        mallopt(M_TRIM_THRESHOLD, 2**31 - 1),
        mallopt(M_TOP_PAD, top_pad_bytes),
    ]
    _tuned.append(all(accepted))
    return _tuned[0]
