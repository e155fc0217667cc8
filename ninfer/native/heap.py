"""The C heap under a CPU forward: freed blocks kept for the next call, not handed back.

A CPU forward allocates and frees the same large temporaries on every call (a 2,048-token
chunk's activations are megabytes each). With glibc's defaults a block over the mmap threshold
(128 KiB, raised only as far as the largest block freed so far) is mapped for the call and
unmapped when freed, and the heap's top is trimmed back to the system past 128 KiB; the next call
maps the memory again and takes a page fault on every 4 KiB it touches. Measured on 2 cores,
the tiny model, a 2,000-token chunk in fp32: 130-140 ms a forward with the defaults, 110-113 ms
with these settings (the GDN layers 60 -> 43 ms: their temporaries are the largest), outputs bit
for bit the same (only where the memory comes from changes).

``keep_freed_memory`` raises the mmap threshold to glibc's ceiling (32 MiB on 64-bit: a larger
block is still mapped) and the trim threshold to ``TRIM_BYTES``: freed memory stays in the
process for the next forward, up to that much at a heap's top. vLLM's CPU backend asks its users
to preload tcmalloc for the same reason; this needs no preload and no library. Only glibc has
``mallopt``; elsewhere, or with ``NINFER_HEAP=default``, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20          # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_BYTES = 512 << 20

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Tune this process's glibc heap once (idempotent); True if the settings are in force."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("NINFER_HEAP", "") == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):     # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    return _done
