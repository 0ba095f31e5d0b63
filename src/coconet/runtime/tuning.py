"""Choosing a collective's algorithm by measuring it: once per (op, size class, backend, world).

The table of choices lives in a JSON file under the build-keyed cache directory
(``coconet.cache.keyed_cache_dir``: timings of one machine and torch are never reused by another)
so that later runs, and ``coconet show``, see what was measured. Rank 0's table is the one every
rank uses (the communicator broadcasts it at start), and a measurement's timings are reduced over
the whole world before choosing, so every rank always makes the same choice: ranks choosing
differently would run mismatched collectives.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from coconet.cache import default_cache_dir

__all__ = [
    "SIZE_CLASSES",
    "AlgorithmTable",
    "Choice",
    "default_cache_dir",
    "measure_choice",
    "reps_for",
    "size_class",
]

KiB, MiB = 1 << 10, 1 << 20
# (upper bound in bytes, label, bytes measured for the class); the last class is open-ended.
SIZE_CLASSES: tuple[tuple[int | None, str, int], ...] = (
    (64 * KiB, "<=64KiB", 64 * KiB),
    (1 * MiB, "<=1MiB", 1 * MiB),
    (16 * MiB, "<=16MiB", 16 * MiB),
    (None, ">16MiB", 64 * MiB),
)


def size_class(nbytes: int) -> str:
    for bound, label, _ in SIZE_CLASSES:
        if bound is None or nbytes <= bound:
            return label
    raise AssertionError("unreachable: the last class is open-ended")  # pragma: no cover


def class_bytes(label: str) -> int:
    for _, name, nbytes in SIZE_CLASSES:
        if name == label:
            return nbytes
    raise KeyError(label)


@dataclass(frozen=True)
class Choice:
    """The algorithm chosen for one key, and the median milliseconds each candidate took."""

    algorithm: str
    ms: dict[str, float] = field(default_factory=dict)
    measured_at: str = ""


def _key(op: str, cls: str, backend: str, world: int) -> str:
    return f"{op}|{cls}|{backend}|{world}"


class AlgorithmTable:
    """(op, size class, backend, world) -> Choice, backed by ``<cache_dir>/algorithms.json``."""

    FILENAME = "algorithms.json"

    def __init__(self, path: Path | None, entries: Mapping[str, Choice] | None = None) -> None:
        self.path = path
        self.entries: dict[str, Choice] = dict(entries or {})

    @classmethod
    def load(cls, cache_dir: Path | None) -> AlgorithmTable:
        path = None if cache_dir is None else Path(cache_dir) / cls.FILENAME
        table = cls(path)
        if path is not None and path.exists():
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                raw = json.loads(path.read_text())
                table.entries = {k: Choice(**v) for k, v in raw.get("choices", {}).items()}
        return table

    def get(self, op: str, cls: str, backend: str, world: int) -> Choice | None:
        return self.entries.get(_key(op, cls, backend, world))

    def put(self, op: str, cls: str, backend: str, world: int, choice: Choice) -> None:
        self.entries[_key(op, cls, backend, world)] = choice

    def save(self) -> None:
        """Merge into the file under a lock (other jobs may write it too), atomically."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_suffix(".lock")
        with open(lock, "w") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            merged = AlgorithmTable.load(self.path.parent).entries
            merged.update(self.entries)
            doc = {"choices": {k: asdict(v) for k, v in sorted(merged.items())}}
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(tmp, self.path)

    def format(self, backend: str | None = None, world: int | None = None) -> str:
        """The table as text (what ``coconet show`` prints), optionally for one backend/world."""
        rows = []
        for key, c in sorted(self.entries.items()):
            op, cls, be, w = key.split("|")
            if (backend is not None and be != backend) or (world is not None and int(w) != world):
                continue
            times = ", ".join(f"{a} {ms:.2f} ms" for a, ms in sorted(c.ms.items()))
            rows.append(f"{op:<15} {cls:<8} {be:<5} world={w:<3} -> {c.algorithm:<10} ({times})")
        where = f" ({self.path})" if self.path is not None else ""
        if not rows:
            return f"collective algorithms{where}: nothing measured yet"
        return "\n".join([f"collective algorithms{where}:", *rows])


def measure_choice(
    candidates: Iterable[str],
    run_once: Callable[[str], None],
    agree: Callable[[list[float]], list[float]],
    reps: int = 5,
    prefer: str = "native",
    margin: float = 0.1,
) -> Choice:
    """Time ``run_once(algorithm)`` for each candidate and choose the fastest by the slowest
    rank's median (``agree`` reduces the times with MAX over the world, so every rank chooses the
    same).

    Candidates run in alternation (A B C A B C ...) after one warm-up each, so that a drift in the
    machine's load during the measurement hits them all alike. ``reps`` must be the same on every
    rank: each run is a collective. ``prefer`` is kept unless another candidate is faster by more
    than ``margin`` (a fraction of its time).
    """
    names = list(candidates)
    for name in names:
        run_once(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            t0 = time.perf_counter()
            run_once(name)
            times[name].append((time.perf_counter() - t0) * 1e3)
    worst = agree([statistics.median(times[name]) for name in names])
    best = min(range(len(names)), key=lambda i: worst[i])
    # Timings on a shared machine are noisy: leave torch's own collective only for a clear win,
    # so that the choice does not flip from run to run on a difference within the noise.
    if prefer in names and worst[best] > (1.0 - margin) * worst[names.index(prefer)]:
        best = names.index(prefer)
    return Choice(
        names[best],
        {n: round(t, 3) for n, t in zip(names, worst, strict=True)},
        time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def reps_for(label: str, base: int) -> int:
    """Timed repetitions for a size class: small collectives are noisy and cheap, so more."""
    nbytes = class_bytes(label)
    return base * 3 if nbytes <= 64 * KiB else base * 2 if nbytes <= MiB else base
