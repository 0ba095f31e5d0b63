"""Choosing a collective's algorithm by measuring it: once per (op, size class, backend, world).

The table of choices lives in a JSON file under the build-keyed cache directory
(``coconet.cache.keyed_cache_dir``: timings of one machine and torch are never reused by another)
so that later runs, and ``coconet show``, see what was measured. Rank 0's table is the one every
rank uses (the communicator broadcasts it at start), and a measurement's timings are reduced over
the whole world before choosing, so every rank always makes the same choice: ranks choosing
differently would run mismatched collectives.

``AlgorithmChoice`` is a communicator's part that does it for the transport with several
algorithms per op (torch.distributed's, a ``TunableTransport``): the communicator asks it only
where a group's transport has algorithms to choose among (``Transport.algorithms``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from coconet.cache import default_cache_dir, keyed_cache_dir
from coconet.errors import ConfigError
from coconet.ir.ops import Op
from coconet.options import Algorithm, CommOptions
from coconet.runtime.transport import Group, TunableTransport

__all__ = [
    "SIZE_CLASSES",
    "AlgorithmChoice",
    "AlgorithmTable",
    "Choice",
    "TuningKey",
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

    algorithm: Algorithm
    ms: dict[Algorithm, float] = field(default_factory=dict)
    measured_at: str = ""

    def to_json(self) -> dict:
        return {
            "algorithm": self.algorithm.value,
            "ms": {a.value: t for a, t in self.ms.items()},
            "measured_at": self.measured_at,
        }

    @classmethod
    def from_json(cls, raw: Mapping) -> Choice:
        ms = {Algorithm(a): float(t) for a, t in raw.get("ms", {}).items()}
        return cls(Algorithm(raw["algorithm"]), ms, str(raw.get("measured_at", "")))


@dataclass(frozen=True)
class TuningKey:
    """What a measured choice is valid for: one op, size class, backend, group size and the
    number of hosts the group spans (a choice measured over one host's loopback says nothing
    about a link between hosts, and the cache is shared by every job of the machine)."""

    op: Op
    size_class: str
    backend: str
    world: int
    hosts: int = 1

    def text(self) -> str:
        """The key as the JSON file spells it: ``op|size class|backend|world``, and
        ``|hosts=H`` for a group across H > 1 hosts (older files: one host)."""
        base = f"{self.op.value}|{self.size_class}|{self.backend}|{self.world}"
        return base if self.hosts == 1 else f"{base}|hosts={self.hosts}"

    @classmethod
    def parse(cls, text: str) -> TuningKey:
        op, size, backend, world, *rest = text.split("|")
        hosts = 1
        if rest:
            (extra,) = rest  # a key with more parts is foreign: ValueError, ignored by load
            name, _, value = extra.partition("=")
            if name != "hosts":
                raise ValueError(f"unknown part {extra!r} of tuning key {text!r}")
            hosts = int(value)
        return cls(Op(op), size, backend, int(world), hosts)


class AlgorithmTable:
    """TuningKey -> Choice, backed by ``<cache_dir>/algorithms.json``."""

    FILENAME = "algorithms.json"

    def __init__(
        self, path: Path | None, entries: Mapping[TuningKey, Choice] | None = None
    ) -> None:
        self.path = path
        self.entries: dict[TuningKey, Choice] = dict(entries or {})

    @classmethod
    def load(cls, cache_dir: Path | None) -> AlgorithmTable:
        path = None if cache_dir is None else Path(cache_dir) / cls.FILENAME
        table = cls(path)
        if path is not None and path.exists():
            # A corrupt or foreign file costs a re-measurement, never a failure.
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
                raw = json.loads(path.read_text())
                table.entries = {
                    TuningKey.parse(k): Choice.from_json(v)
                    for k, v in raw.get("choices", {}).items()
                }
        return table

    def get(self, key: TuningKey) -> Choice | None:
        return self.entries.get(key)

    def put(self, key: TuningKey, choice: Choice) -> None:
        self.entries[key] = choice

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
            doc = {"choices": {k.text(): v.to_json() for k, v in _sorted(merged)}}
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(tmp, self.path)

    def format(self, backend: str | None = None, world: int | None = None) -> str:
        """The table as text (what ``coconet show`` prints), optionally for one backend/world."""
        rows = []
        for key, c in _sorted(self.entries):
            if (backend is not None and key.backend != backend) or (
                world is not None and key.world != world
            ):
                continue
            times = ", ".join(f"{a} {ms:.2f} ms" for a, ms in sorted(c.ms.items(), key=_value))
            rows.append(
                f"{key.op.value:<15} {key.size_class:<8} {key.backend:<5} world={key.world:<3} "
                + (f"hosts={key.hosts} " if key.hosts > 1 else "")
                + f"-> {c.algorithm.value:<10} ({times})"
            )
        where = f" ({self.path})" if self.path is not None else ""
        if not rows:
            return f"collective algorithms{where}: nothing measured yet"
        return "\n".join([f"collective algorithms{where}:", *rows])


def _sorted(entries: Mapping[TuningKey, Choice]) -> list[tuple[TuningKey, Choice]]:
    return sorted(entries.items(), key=lambda kv: kv[0].text())


def _value(item: tuple[Algorithm, float]) -> str:
    return item[0].value


def measure_choice(
    candidates: Iterable[Algorithm],
    run_once: Callable[[Algorithm], None],
    agree: Callable[[list[float]], list[float]],
    reps: int = 5,
    prefer: Algorithm = Algorithm.NATIVE,
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
    times: dict[Algorithm, list[float]] = {name: [] for name in names}
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


class AlgorithmChoice:
    """A communicator's choice of algorithm among ``transport``'s (see the module docstring):
    the one its options fix, else the table's, else measured once (``measure``), the same on
    every rank. The options are the communicator's at each call (a caller may replace them)."""

    def __init__(
        self,
        transport: TunableTransport,
        options: CommOptions,
        *,
        rank: int,
        backend: str,
        device: torch.device,
        guard: Callable[..., Any],
        process_group: Any = None,
    ) -> None:
        self.transport, self.rank, self.backend, self.device = transport, rank, backend, device
        self._guard = guard  # (op, label, axis, fn, *args): the communicator's fault guard
        self._process_group = process_group  # the communicator's world (None: the job's)
        self.check(options)
        self.table = AlgorithmTable.load(keyed_cache_dir(options.cache_dir))
        # how many hosts each of the communicator's groups spans, by axis (set once routing
        # knows the hosts): part of what a measured choice is valid for
        self.hosts: dict[str | None, int] = {}

    def check(self, options: CommOptions) -> None:
        """An ``{op: algorithm}`` mapping names only algorithms the transport has."""
        if not isinstance(options.algorithms, Mapping):
            return
        for op, algorithm in options.algorithms.items():
            have = self.transport.algorithms(op)
            if algorithm not in have:
                raise ConfigError(
                    f"CommOptions(algorithms=...) fixes {op} to {algorithm.value}, which the "
                    f"{self.transport.kind.value} transport does not have",
                    op="CommOptions",
                    hint=f"{op} has {[a.value for a in have]}"
                    if have
                    else f"{op} has one way only: leave it out of the mapping",
                )

    def share(self, broadcast: Callable[[Any, str], Any]) -> None:
        """Take rank 0's table, so that every rank chooses alike (``broadcast(obj, label)``:
        rank 0's ``obj`` on every rank; collective over the communicator's world)."""
        entries = self.table.entries if self.rank == 0 else None
        self.table.entries = dict(broadcast(entries, "algorithm table"))

    def choose(self, op: Op, nbytes: int, group: Group, options: CommOptions) -> Algorithm:
        """The algorithm of ``op`` on ``nbytes`` over ``group`` (measured on first use of its
        size class: then collective over the world)."""
        fixed = options.fixed_algorithm(op, self.transport)
        if fixed is not None:
            return fixed  # checked against the transport when the communicator was made
        key = self.key(op, size_class(nbytes), group)
        choice = self.table.get(key)
        if choice is None:
            choice = self.measure(op, key.size_class, group, options)
        return choice.algorithm

    def key(self, op: Op, cls: str, group: Group) -> TuningKey:
        """What a choice of ``op``'s algorithm at size class ``cls`` on ``group`` is measured
        for and looked up by."""
        return TuningKey(op, cls, self.backend, group.size, self.hosts.get(group.axis, 1))

    def measure(self, op: Op, cls: str, group: Group, options: CommOptions) -> Choice:
        """Measure every algorithm of ``op`` at size class ``cls`` on ``group``, choose the
        fastest (the same on every rank), record it in the table and return the ``Choice``.
        Collective over the communicator's world."""
        have = self.transport.algorithms(op)
        if not have or cls not in (label for _, label, _ in SIZE_CLASSES):
            raise ConfigError(
                f"cannot measure {op} at size class {cls!r}",
                op="Communicator.measure",
                hint=f"op is one of {[str(o) for o in Op if self.transport.algorithms(o)]}, "
                f"cls one of {[label for _, label, _ in SIZE_CLASSES]}",
            )
        n = group.size
        numel = max(n, class_bytes(cls) // 4)
        numel -= numel % n

        def run_once(algorithm: Algorithm) -> None:
            self.transport.run_for_measurement(op, algorithm, group, numel, self.device)

        def agree(times: list[float]) -> list[float]:
            t = torch.tensor(times, dtype=torch.float64)
            # the communicator's whole world: everyone must agree
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._process_group)
            return t.tolist()

        choice = self._guard(
            op.value,
            f"measuring algorithms ({cls})",
            group.axis,
            measure_choice,
            have,
            run_once,
            agree,
            reps_for(cls, options.measure_reps),
        )
        self.table.put(self.key(op, cls, group), choice)
        if self.rank == 0:
            try:
                self.table.save()
            except OSError:
                pass  # an unwritable cache costs a re-measurement next time, nothing more
        return choice
