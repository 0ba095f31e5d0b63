"""Keep large CPU buffers mapped between steps (glibc's malloc), instead of re-faulting them.

glibc serves allocations above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
returns them with ``munmap`` when freed, and it trims freed heap memory back to the system. A
training step allocates the same large buffers every step (a reduced gradient, new parameters and
state), so each step page-faults all of them again. Measured on the 2-core development VM: one
``x * 2`` over 16M float32 takes 33 ms with glibc's defaults and 11 ms with large buffers kept
mapped; in the data-parallel Adam benchmark the same settings took coconet's AR_C step at 16M
parameters from 284 to 180 ms.

``keep_large_buffers_mapped()`` raises glibc's mmap threshold to 1 GiB and turns its trimming
off with ``mallopt`` (what the MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ environment
variables do at start-up), so freed buffers stay in the heap and are reused.
``malloc_trim(0)`` still hands the free heap back when asked (the tuner does between
candidates). The cost is memory: the process keeps what it freed (about one step's
temporaries). It affects the whole process, which is why ``coconet.runtime.init`` does it only
when ``CommOptions.keep_buffers_mapped`` is true (the default) and says so in its docstring.
Elsewhere than glibc it does nothing.

That is not enough on its own: torch allocates with ``posix_memalign``, which carves a small
remainder off each large chunk, and glibc's per-thread cache (tcache, 7 chunks per size) keeps
that remainder, so the large chunk freed next to it cannot merge back into the heap's top and
the next allocation of the same size grows the heap instead. Measured on the development VM: a
loop that allocates and frees one 64 MiB tensor page-faulted all of it again in 7-10 of its
first 12 rounds (16,384 faults each); a 64M-parameter unfused Adam step (the tuner's
``unscheduled`` and ``split``) went on faulting 0.25-0.5 GiB in about one timed step in three,
those steps taking 1.3-2.0 s where the others took 0.55-0.9 s. With the cache off the loop
faults only its first round, and those steps ran at 0.56-0.83 s from their third (one fault in
the eighteen after). The cache is a tunable read when the process starts (``GLIBC_TUNABLES``),
so ``init`` cannot turn it off: the processes coconet starts (``coconet run``,
``coconet.runtime.spawn``) get ``rank_environment``'s variable, and a job launched otherwise
can set ``GLIBC_TUNABLES=glibc.malloc.tcache_count=0`` itself. Small steps do not notice
(``benchmarks/optim_small_step.py``, a 1000-parameter Adam step: medians within 2% either way).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Mapping

__all__ = ["TCACHE_OFF", "keep_large_buffers_mapped", "rank_environment", "trim_heap"]

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
    # -1: never trim (mallopt(3)), which is what keeping freed buffers means. The largest int,
    # 2 GiB, is less than a 64M-parameter unfused Adam step frees at the heap's top: with it,
    # one such step was seen faulting 2.25 GiB in again after the heap had settled.
    trimmed = mallopt(_M_TRIM_THRESHOLD, -1)
    return bool(mapped and trimmed)


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: return the freed heap to the system (nothing elsewhere).
    For a one-off release of much memory (the tuner between candidates; a model just sharded,
    ``coconet.fsdp``, whose whole parameters were freed)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# glibc's tunable that turns the per-thread cache of small chunks off (see the module docstring)
TCACHE_OFF = "glibc.malloc.tcache_count=0"


def rank_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a rank process coconet starts: with ``TCACHE_OFF`` added to
    ``GLIBC_TUNABLES``, unless that already names a tcache setting (the user's choice stands)."""
    out = dict(env)
    tunables = out.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count" not in tunables:
        out["GLIBC_TUNABLES"] = f"{tunables}:{TCACHE_OFF}" if tunables else TCACHE_OFF
    return out
