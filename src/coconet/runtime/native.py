"""The small C library of cross-process signals (``shm_sync.c``), built once and loaded with ctypes.

Python has no memory model for memory shared between processes, so the release stores and
acquire loads that order data and signals live in C (``__atomic`` builtins, correct on x86-64
and aarch64 alike). It is compiled by the system C compiler (the same one Inductor needs on CPU)
in well under a second, into the build-keyed cache (``coconet.cache``), atomically so that ranks
building it at once do not collide, and reused afterwards.

The same library reduces small all_reduces (``cn_one_shot``), and its arithmetic is hand-written C,
which ``ATEN_CPU_CAPABILITY`` would not reach by itself: the library is built without ``-march``
(a cached build must load on any CPU of its architecture), with the reduction compiled once per
vector width (baseline, AVX2, AVX-512) and picked when the library loads: the width torch's own
kernels use (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` caps),
never wider than the CPU has (``vector_width``). Every width computes the same bits: each element
is one IEEE operation on two operands in rank order, whatever the number of lanes
(tests/unit/test_native_widths.py checks them against each other).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from coconet.cache import keyed_cache_dir
from coconet.errors import ConfigError

__all__ = ["WIDTHS", "OneShotArgs", "sync_library", "vector_width"]


class OneShotArgs(ctypes.Structure):
    """``cn_one_shot_args`` (shm_sync.c): what every call of one kind passes, made once."""

    _u64pp = ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64))
    _fields_ = [
        ("inputs", ctypes.POINTER(ctypes.c_void_p)),
        ("count", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("op", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("me", ctypes.c_int32),
        ("registered", ctypes.c_int32),
        ("ready", _u64pp),
        ("consumed", _u64pp),
        ("pids", ctypes.POINTER(ctypes.c_int32)),
        ("aborts", _u64pp),
        ("timeout_s", ctypes.c_double),
        ("spin_s", ctypes.c_double),
        ("yield_s", ctypes.c_double),
        ("why", ctypes.c_int32),
        ("stage", ctypes.c_int32),
        ("heads", ctypes.POINTER(ctypes.c_void_p)),
        ("head_words", ctypes.c_int32),
    ]

_SOURCE = Path(__file__).with_name("shm_sync.c")

# cn_set_width's codes, by name (torch's capability names for x86-64; "default" is the baseline)
WIDTHS = {"default": 0, "avx2": 1, "avx512": 2}


def _torch_width() -> int:
    """The vector width torch's CPU kernels use here (``ATEN_CPU_CAPABILITY`` caps it): the
    baseline for anything but AVX2 and AVX-512 (on aarch64 the library has only its baseline)."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return WIDTHS.get(capability, 0)


def vector_width(cache_dir: str | None = None) -> str:
    """The vector width of the shared-memory transport's C reductions in this process
    ("default", "avx2" or "avx512"): torch's (see the module) capped by what the CPU has."""
    in_use = sync_library(cache_dir).cn_set_width(_torch_width())
    return {v: k for k, v in WIDTHS.items()}[in_use]


@functools.cache
def sync_library(cache_dir: str | None = None) -> ctypes.CDLL:
    """The loaded library (built on first use), with its functions' signatures declared."""
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    target = keyed_cache_dir(cache_dir) / "native" / f"coconet_shm_sync_{digest}.so"
    if not target.exists():
        _build(source, target)
    lib = ctypes.CDLL(str(target))
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.cn_store_release.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.cn_store_release.restype = None
    lib.cn_load_acquire.argtypes = [ctypes.c_void_p]
    lib.cn_load_acquire.restype = ctypes.c_uint64
    lib.cn_alive.argtypes = [ctypes.c_int32]
    lib.cn_alive.restype = ctypes.c_int
    lib.cn_wait_all.argtypes = [
        ctypes.POINTER(u64p),
        ctypes.POINTER(ctypes.c_int32),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_double,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(u64p),
        ctypes.c_double,
        ctypes.c_double,
    ]
    lib.cn_wait_all.restype = ctypes.c_int
    vp = ctypes.c_void_p
    # (cn_one_shot_args *args, src, out, dst, epoch, previous, words in, words out): see
    # OneShotArgs
    lib.cn_one_shot.argtypes = [vp, vp, vp, vp, ctypes.c_uint64, ctypes.c_int, vp, vp]
    lib.cn_one_shot.restype = ctypes.c_int
    lib.cn_set_width.argtypes = [ctypes.c_int]
    lib.cn_set_width.restype = ctypes.c_int
    # (inputs, out, count, dtype, op, n, width): the reduction alone, for the width checks
    lib.cn_reduce.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), vp, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int,
    ]
    lib.cn_reduce.restype = ctypes.c_int
    lib.cn_set_width(_torch_width())
    return lib


def _build(source: bytes, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise ConfigError(
            "the shared-memory transport needs a C compiler to build its signals, and none "
            "was found (cc, gcc or $CC)",
            op="shared memory",
            hint="install gcc (apt-get install gcc), or run with "
            "CommOptions(transport='torch.distributed')",
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "shm_sync.c"
        src.write_bytes(source)
        out = Path(tmp) / target.name
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ConfigError(
                f"building the shared-memory signals failed: {' '.join(cmd)}",
                op="shared memory",
                details=done.stderr.strip().splitlines()[-10:],
                hint="check the C compiler, or run with CommOptions(transport='torch.distributed')",
            )
        os.replace(out, target)  # atomic: a rank building at the same time sees one or the other
