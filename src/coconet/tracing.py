"""Where a step's time went: spans that torch.profiler shows, and coconet's own per-rank trace.

Every phase of coconet's work is a **span**: a compiled step's call and its parts (the agreement,
the rehearsal, the generated body, the commit vote, the commit), each collective and each wait
under the fault guard (with its value's label, bytes and axis), each fused kernel call, each
optimizer step, each tensor-parallel layer call and each pipeline action. A span is recorded

- as a ``torch.profiler.record_function`` range (named ``coconet: <what>``) while torch's
  profiler runs, so a user's existing profiler traces show coconet's phases with no new tool;
- as a complete event ("ph": "X") of the Chrome/Perfetto trace-event format while a
  ``Recorder`` is open in this process (``start`` / ``stop``; the public side is
  ``coconet.trace.record`` and ``COCONET_TRACE=dir``): one JSON file per rank, which
  ``coconet.trace.merge`` aligns into one timeline with a track per rank.

With neither, ``span`` returns one shared null context (~0.2 us with its ``with``); the hot
paths read ``active()`` once (two reads: the recorder, and the flag torch's profiler contexts
set) and skip their spans (``within``). A profiler started without those contexts (on-demand
Kineto tracing) does not set the flag: coconet's ranges are then missing from its trace. The
spans are coarse (a handful per step, not one per tensor op); what they cost with nothing
recording, and with a recorder open, is measured by ``benchmarks/observability.py``.

The recorder is per process, as torch's profiler is: what it records is every span of this
process from ``start`` to ``stop``, on every thread (a span's thread is its track).

Clocks: events are stamped with ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux: one clock
for every process of a host). A recorder also keeps the wall clock at its start, for ranks on
different hosts, and **clock marks**: the instant each rank left one ``aligned_start`` (every
rank leaves it at about the same instant: ``ControlChannel.aligned_start``), taken when a
communicator is built while recording, or when ``coconet.trace.record`` is given one. The merge
lines the hosts up on those marks.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Category",
    "Recorder",
    "active",
    "category_of",
    "clock_domain",
    "recording",
    "span",
    "start",
    "start_from_environment",
    "stop",
    "stop_from_environment",
    "within",
]

# Whether torch's profiler is collecting: record_function ranges only then. The hot check reads
# the flag torch's own profiler contexts set (torch.profiler.profile, autograd's profile: a
# module attribute, ~20 ns); a span asks the profiler itself (a C call) before it opens a range.
_torch_profiler = torch.autograd.profiler
_profiler_on = torch._C._autograd._profiler_enabled


class Category(enum.Enum):
    """What a span is: its "cat" in the trace, its colour in the plot."""

    STEP = "step"  # one call of a compiled step, as the caller made it
    AGREEMENT = "agreement"  # the per-step agreement (and the local checks before it)
    REHEARSAL = "rehearsal"  # a first call's eager rehearsal and the kernels' builds
    BODY = "body"  # the generated step's body: its kernels and collectives in program order
    COLLECTIVE = "collective"  # a collective's start (shared memory's run wholly inside it)
    WAIT = "wait"  # waiting for a started collective to complete on this rank
    CONTROL = "control"  # a control-channel round: handshakes, votes, barriers, readiness
    KERNEL = "kernel"  # one fused kernel call
    COMMIT = "commit"  # writing the updates once every rank voted to commit
    OPTIMIZER = "optimizer"  # one coconet.optim step
    LAYER = "layer"  # one coconet.nn layer call (forward or backward)
    PIPELINE = "pipeline"  # one pipeline action (a micro-batch's forward, backward, message)


# The fault guard's op names that are control-channel rounds, not the program's collectives.
_CONTROL_OPS = frozenset(
    {"handshake", "barrier", "setup", "readiness", "commit vote", "symmetric memory"}
)


def category_of(op: str) -> Category:
    """The category of a fault-guarded call named ``op`` (``FaultGuard``'s first argument)."""
    return Category.CONTROL if op in _CONTROL_OPS else Category.COLLECTIVE


class Recorder:
    """The events of one process from ``start`` to ``stop``, written as one trace-event file.

    ``limit``: events kept at most (a long run's recorder stops adding, and counts what it
    dropped, rather than grow without bound)."""

    def __init__(self, directory: str | os.PathLike, limit: int = 1_000_000) -> None:
        self.directory = Path(directory)
        self.limit = limit
        self.events: list[tuple] = []  # (name, category, start_ns, end_ns, thread, args)
        self.dropped = 0
        self.marks: list[tuple[str, int]] = []  # clock marks: (label, perf_counter_ns)
        self.perf0_ns = time.perf_counter_ns()
        self.wall0_ns = time.time_ns()
        self._lock = threading.Lock()

    def add(self, name: str, category: Category, start_ns: int, end_ns: int,
            args: dict[str, Any] | None) -> None:  # fmt: skip
        if len(self.events) >= self.limit:
            self.dropped += 1
            return
        event = (name, category, start_ns, end_ns, threading.get_native_id(), args)
        with self._lock:  # (appends from a step's watcher thread and the main one)
            self.events.append(event)

    def mark(self, label: str) -> None:
        """A clock mark: this instant is the same instant on every rank that marks ``label``
        (called right after an ``aligned_start``)."""
        self.marks.append((label, time.perf_counter_ns()))

    def path_for(self, rank: int) -> Path:
        return self.directory / f"rank{rank}.trace.json"

    def write(self) -> Path:
        """Write this process's events (Chrome trace-event JSON, timestamps in microseconds of
        this host's monotonic clock) as ``<directory>/rank<r>.trace.json``; returns the path."""
        rank, world = _rank_and_world()
        pid = os.getpid()
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank} ({_host()}, pid {pid})"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
             "args": {"sort_index": rank}},
        ]  # fmt: skip
        with self._lock:
            events = list(self.events)
        main = threading.main_thread().native_id
        for tid in sorted({e[4] for e in events}):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": "main" if tid == main else f"thread {tid}"}})
        for name, category, t0, t1, tid, args in events:
            event = {"name": name, "cat": category.value, "ph": "X", "ts": t0 / 1e3,
                     "dur": (t1 - t0) / 1e3, "pid": rank, "tid": tid}  # fmt: skip
            if args:
                event["args"] = args
            out.append(event)
        document = {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {
                "coconet": {
                    "rank": rank,
                    "world": world,
                    "host": _host(),
                    "clock": clock_domain(),
                    "pid": pid,
                    "perf0_ns": self.perf0_ns,
                    "wall0_ns": self.wall0_ns,
                    "marks": [[label, ns] for label, ns in self.marks],
                    "dropped": self.dropped,
                }
            },
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(rank)
        tmp = path.with_suffix(f".{pid}.tmp")
        tmp.write_text(json.dumps(document))
        os.replace(tmp, path)  # a reader never sees half a file
        return path


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _host() -> str:
    # the host as the runtime names it (COCONET_HOST_ID lets tests pretend to be several)
    return os.environ.get("COCONET_HOST_ID") or socket.gethostname()


def clock_domain() -> str:
    """What ranks share when their monotonic clocks are one clock: the kernel's boot (every
    process, container and namespace of one boot reads the same CLOCK_MONOTONIC)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"host {socket.gethostname()}"


# The process's open recorder: like torch's profiler, recording is a property of the process
# (every thread's spans), opened and closed explicitly (``start``/``stop``).
_recorder: Recorder | None = None


def recording() -> Recorder | None:
    """The open recorder of this process, or None."""
    return _recorder


def start(directory: str | os.PathLike, limit: int = 1_000_000) -> Recorder:
    """Open a recorder writing to ``directory`` (one is open at a time in a process)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError(f"a coconet trace is already being recorded (to {_recorder.directory})")
    _recorder = Recorder(directory, limit)
    return _recorder


def stop() -> Path | None:
    """Close the open recorder and write its file; returns its path (None: none was open)."""
    global _recorder
    recorder, _recorder = _recorder, None
    return None if recorder is None else recorder.write()


# what ``start_from_environment`` opened (written by ``stop_from_environment`` or at exit)
_from_environment: list[Recorder] = []


def start_from_environment() -> Recorder | None:
    """Open a recorder into ``$COCONET_TRACE`` when it is set and none is open (what
    ``coconet.runtime.init`` calls): written at ``coconet.runtime.shutdown`` or at exit."""
    directory = os.environ.get("COCONET_TRACE")
    if not directory or _recorder is not None:
        return None
    recorder = start(directory)
    if not _from_environment:
        atexit.register(stop_from_environment)
    _from_environment[:] = [recorder]
    return recorder


def stop_from_environment() -> Path | None:
    """Write and close the recorder ``start_from_environment`` opened, if it is still open."""
    if not _from_environment or _recorder is not _from_environment[0]:
        return None
    _from_environment.clear()
    return stop()


class _Span:
    """One span while something records it (see ``span``)."""

    __slots__ = ("args", "category", "detail", "name", "_range", "_t0")

    def __init__(self, name: str, category: Category, detail: str | None,
                 args: dict[str, Any] | None) -> None:  # fmt: skip
        self.name, self.category, self.detail, self.args = name, category, detail, args

    def title(self) -> str:
        return self.name if self.detail is None else f"{self.name}: {self.detail}"

    def __enter__(self) -> _Span:
        self._range = None
        if _profiler_on():
            self._range = torch.autograd.profiler.record_function(f"coconet: {self.title()}")
            self._range.__enter__()
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        t1 = time.perf_counter_ns()
        recorder = _recorder
        if recorder is not None:
            args = self.args
            if kind is not None:
                args = {**(args or {}), "raised": kind.__name__}
            recorder.add(self.title(), self.category, self._t0, t1, args)
        if self._range is not None:
            self._range.__exit__(kind, exc, tb)
        return False


_NULL = contextlib.nullcontext()


def span(name: str, category: Category, detail: str | None = None,
         args: dict[str, Any] | None = None) -> contextlib.AbstractContextManager:  # fmt: skip
    """A context in which a phase runs: recorded as ``name: detail`` (``detail`` is formatted
    only when something records, so callers pass the parts, not the text) with ``args`` in the
    trace, while torch's profiler or a coconet recorder is on; else a shared null context."""
    if _recorder is None and not _torch_profiler._is_profiler_enabled:
        return _NULL
    return _Span(name, category, detail, args)


def within(traced: bool, name: str, category: Category, fn: Callable[..., Any], *args: Any,
           detail: str | None = None) -> Any:  # fmt: skip
    """``fn(*args)``, in a span when ``traced`` (the caller read ``active()`` once for several
    phases): when nothing records this costs one call, not a ``with`` on a null context."""
    if not traced:
        return fn(*args)
    with span(name, category, detail):
        return fn(*args)


def active() -> bool:
    """Whether spans are recorded now (a recorder is open or torch's profiler runs): callers
    compute what only a recorded span needs (a tensor's bytes) only then."""
    return _recorder is not None or _torch_profiler._is_profiler_enabled
