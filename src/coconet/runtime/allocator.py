"""Keep large CPU buffers mapped between steps (glibc's malloc), instead of re-faulting them.

glibc serves allocations above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
returns them with ``munmap`` when freed, and it trims freed heap memory back to the system. A
training step allocates the same large buffers every step (a reduced gradient, new parameters and
state), so each step page-faults all of them again. Measured on the 2-core development VM: one
``x * 2`` over 16M float32 takes 33 ms with glibc's defaults and 11 ms with large buffers kept
mapped; in the data-parallel Adam benchmark the same settings took coconet's AR_C step at 16M
parameters from 284 to 180 ms.

``keep_large_buffers_mapped()`` raises glibc's mmap threshold and trim threshold with
``mallopt`` (what the MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment variables do
at start-up), so freed buffers stay in the heap and are reused. The cost is memory: the process
keeps what it freed (about one step's temporaries). It affects the whole process, which is why
``coconet.runtime.init`` does it only when ``CommOptions.keep_buffers_mapped`` is true (the
default) and says so in its docstring. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_large_buffers_mapped"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers_mapped() -> bool:
    """Tune glibc's malloc as above; returns whether it applied (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mapped = mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    trimmed = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    return bool(mapped and trimmed)
