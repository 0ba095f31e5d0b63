"""The Communicator: collectives over torch.distributed process groups built from a Mesh.

One process group per group of every mesh axis (every rank creates every group, in the same order,
as torch.distributed requires); the whole world uses the default group. Collectives are methods in
start/wait form: ``work = comm.all_reduce_start(x, ...)`` returns at once with the operation in
flight, ``comm.wait(work)`` returns the result. all_reduce, reduce_scatter and all_gather pick
their algorithm per size class (``tuning``), the same on every rank.

Failures: a torch.distributed error (a peer that died closes its connections; a peer that stalls
trips the process group's timeout) becomes a ``RuntimeFault`` naming the collective, the value it
computed and the likely cause. After one, the communicator is marked broken and refuses further
work: a process group that failed mid-collective cannot be trusted to line up again.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from coconet.cache import keyed_cache_dir
from coconet.errors import ConfigError, RuntimeFault
from coconet.ir.mesh import Mesh
from coconet.ir.ops import ReduceOp
from coconet.ir.types import slice_bounds
from coconet.runtime import algorithms as algos
from coconet.runtime.tuning import (
    SIZE_CLASSES,
    AlgorithmTable,
    class_bytes,
    measure_choice,
    reps_for,
    size_class,
)

__all__ = ["AlgorithmPolicy", "CommOptions", "Communicator", "Work"]

_TUNED = {
    "all_reduce": algos.ALL_REDUCE,
    "reduce": algos.REDUCE,
    "reduce_scatter": algos.REDUCE_SCATTER,
    "all_gather": algos.ALL_GATHER,
}


class AlgorithmPolicy(str, enum.Enum):
    """How the communicator picks a collective's algorithm (``CommOptions.algorithms``).

    A ``str`` enum: ``"auto"`` and ``AlgorithmPolicy.AUTO`` are the same policy.
    """

    AUTO = "auto"  # measure once per size class, cache the choice
    NATIVE = "native"  # torch's own collective always
    EXACT = "exact"  # the all_to_all forms: reductions in rank order, as the simulator


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class CommOptions:
    """How the communicator runs.

    - ``timeout``: seconds a collective may wait for a peer before failing with ``RuntimeFault``;
    - ``algorithms``: an ``AlgorithmPolicy`` (or its string): ``"auto"`` (measure once per size
      class, cache the choice), ``"native"`` (torch's own collective always), ``"exact"`` (the
      all_to_all forms, which reduce in rank order: results bitwise equal to the simulator's), or
      a mapping such as ``{"reduce_scatter": "all_to_all"}`` that fixes an algorithm per op
      (others stay native);
    - ``cache_dir``: the base of coconet's caches; the measured choices are kept under its
      build-keyed subdirectory (``coconet.cache.keyed_cache_dir``);
    - ``measure_reps``: timed repetitions per candidate when measuring (2-3x that for the small
      size classes, whose timings are noisier);
    - ``keep_buffers_mapped``: ``init()`` tunes glibc's malloc so that the large buffers a step
      allocates stay mapped between steps instead of page-faulting every step (process-wide;
      see ``coconet.runtime.allocator``). False leaves the allocator alone.

    Every field is checked when the options are made: a bad one is a ``ConfigError`` there, not
    a failure at the job's first collective.
    """

    timeout: float = 60.0
    algorithms: str | Mapping[str, str] = "auto"
    cache_dir: str | Path | None = None
    measure_reps: int = 5
    keep_buffers_mapped: bool = True

    def __post_init__(self) -> None:
        # Checked here, where the options are written, not at the first collective of a job.
        if not _is_number(self.timeout) or not self.timeout > 0:
            raise ConfigError(
                f"timeout must be a positive number of seconds, got {self.timeout!r}",
                op="CommOptions",
                hint="CommOptions(timeout=60.0)",
            )
        if isinstance(self.algorithms, Mapping):
            self._check_algorithm_table(self.algorithms)
        else:
            try:
                AlgorithmPolicy(self.algorithms)
            except (ValueError, TypeError):
                raise ConfigError(
                    f"unknown algorithm policy {self.algorithms!r}",
                    op="CommOptions",
                    hint='use "auto", "native", "exact" or a mapping {op: algorithm}',
                ) from None
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ConfigError(
                f"cache_dir must be a path or None, got {self.cache_dir!r}",
                op="CommOptions",
                hint="CommOptions(cache_dir='~/.cache/coconet'); None is the default place",
            )
        reps = self.measure_reps
        if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
            raise ConfigError(
                f"measure_reps must be an int >= 1, got {reps!r}",
                op="CommOptions",
                hint="CommOptions(measure_reps=5): timed repetitions per candidate algorithm",
            )
        if not isinstance(self.keep_buffers_mapped, bool):
            raise ConfigError(
                f"keep_buffers_mapped must be True or False, got {self.keep_buffers_mapped!r}",
                op="CommOptions",
                hint="CommOptions(keep_buffers_mapped=False) leaves malloc alone",
            )

    @staticmethod
    def _check_algorithm_table(table: Mapping[Any, Any]) -> None:
        for op, algorithm in table.items():
            if op not in _TUNED:
                raise ConfigError(
                    f"algorithms names {op!r}, which is not a collective with algorithms",
                    op="CommOptions",
                    hint=f"fix the algorithm of any of {sorted(_TUNED)}",
                )
            if algorithm not in _TUNED[op]:
                raise ConfigError(
                    f"unknown {op} algorithm {algorithm!r}",
                    op="CommOptions",
                    hint=f"choose one of {sorted(_TUNED[op])}",
                )

    @property
    def policy(self) -> AlgorithmPolicy | None:
        """The policy, or None for a mapping {op: algorithm}."""
        if isinstance(self.algorithms, Mapping):
            return None
        return AlgorithmPolicy(self.algorithms)

    def fixed_algorithm(self, op: str) -> str | None:
        """The algorithm ``op`` always runs, or None when it is measured (``"auto"``)."""
        policy = self.policy
        if policy is None:
            return self.algorithms.get(op, "native")
        if policy is AlgorithmPolicy.AUTO:
            return None
        return "native" if policy is AlgorithmPolicy.NATIVE else "all_to_all"


@dataclass
class Work:
    """A collective in flight, as ``*_start`` returns it; ``Communicator.wait`` completes it."""

    op: str
    label: str
    axis: str | None
    pending: algos.Pending


class Communicator:
    """Collectives among the ranks of ``mesh`` (the default process group must exist)."""

    def __init__(self, mesh: Mesh | None = None, options: CommOptions | None = None) -> None:
        if not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialized",
                op="Communicator",
                hint="call coconet.runtime.init() first (it reads torchrun's environment)",
            )
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ConfigError(
                f"a Communicator takes a coconet.Mesh, got {mesh!r}",
                op="Communicator",
                hint="Communicator(coconet.Mesh(dp=2, tp=2)), or None for the whole world",
            )
        if options is not None and not isinstance(options, CommOptions):
            raise ConfigError(
                f"options must be CommOptions, got {options!r}",
                op="Communicator",
                hint="coconet.runtime.CommOptions(timeout=60.0)",
            )
        self.options = options or CommOptions()
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.mesh = mesh or Mesh.world(self.world)
        if self.mesh.size != self.world:
            raise ConfigError(
                f"{self.mesh} has {self.mesh.size} ranks but the job has {self.world}",
                op="Communicator",
                hint="launch as many ranks as the mesh has, or pass a mesh that fits the job",
            )
        self.backend = str(dist.get_backend())
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.broken: str | None = None
        self._groups: dict[str | None, tuple[Any, list[int]]] = {
            None: (dist.group.WORLD, list(range(self.world)))
        }
        for axis in self.mesh.names:
            for ranks in self.mesh.groups(axis):
                # every rank must create every group, in the same order
                pg = None if len(ranks) == self.world else dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[axis] = (pg or dist.group.WORLD, ranks)
        cache = self.options.cache_dir
        self.table = AlgorithmTable.load(keyed_cache_dir(cache))
        self._share_table()

    # -- groups ---------------------------------------------------------------------------------

    def group(self, axis: str | None) -> tuple[Any, list[int]]:
        """(process group, its ranks in axis order) of this rank's group along ``axis``."""
        if axis not in self._groups:
            raise ConfigError(
                f"{self.mesh} has no axis {axis!r}",
                op="Communicator",
                hint="build the communicator with the mesh the program uses (init(mesh=...))",
            )
        return self._groups[axis]

    def _share_table(self) -> None:
        """Every rank uses rank 0's algorithm table, so that they all choose alike."""
        if self.world == 1:
            return
        box = [self.table.entries if self.rank == 0 else None]
        self._guard("setup", "algorithm table", None, dist.broadcast_object_list, box, src=0)
        self.table.entries = dict(box[0])

    # -- faults ---------------------------------------------------------------------------------

    def _guard(self, op: str, label: str, axis: str | None, fn, /, *args, **kwargs):
        if self.broken is not None:
            raise RuntimeFault(
                f"the communicator is unusable after an earlier failure ({self.broken})",
                op=op,
                details=[f"value: {label}", f"rank {self.rank} of {self.world}"],
                hint="end this job (coconet.runtime.shutdown) and start it again",
            )
        try:
            return fn(*args, **kwargs)
        except RuntimeFault:
            raise
        except (RuntimeError, ValueError, OSError) as exc:
            raise self._fault(op, label, axis, exc) from exc

    def _fault(self, op: str, label: str, axis: str | None, exc: BaseException) -> RuntimeFault:
        text = str(exc)
        low = text.lower()
        if "timed out" in low or "timeout" in low:
            cause = f"no answer within {self.options.timeout:g} s: a peer rank stalled or died"
        elif any(s in low for s in ("closed by peer", "reset by peer", "broken pipe", "eof")):
            cause = "a peer rank died: its connection closed"
        else:
            cause = "communication failed"
        self.broken = cause
        ranks = self._groups.get(axis, (None, []))[1]
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return RuntimeFault(
            cause,
            op=op,
            details=[
                f"value: {label}",
                f"on rank {self.rank} of {self.world}, group along axis {axis!r}: ranks {ranks}",
                f"backend ({self.backend}) said: {first[:300]}",
            ],
            hint="look at the other ranks' output for the first failure; this job cannot "
            "continue: end it (coconet.runtime.shutdown) and restart it",
        )

    # -- collectives: start / wait --------------------------------------------------------------

    def wait(self, work: Work) -> torch.Tensor:
        """The result of a started collective, once it has completed on this rank."""

        def complete():
            for w in work.pending.works:
                w.wait()
            return work.pending.finish()

        return self._guard(work.op, work.label, work.axis, complete)

    def _start(self, op: str, label: str, axis: str | None, fn, *args) -> Work:
        pending = self._guard(op, label, axis, fn, *args)
        return Work(op, label, axis, pending)

    def all_reduce_start(
        self, x: torch.Tensor, op: ReduceOp, *, axis: str | None, donate: bool, label: str
    ) -> Work:
        pg, ranks = self.group(axis)
        if len(ranks) == 1:
            return Work("all_reduce", label, axis, _ready(x if donate else x.clone()))
        x0, owned, parts = self._flat(x, donate, len(ranks))
        fn = algos.ALL_REDUCE[self._algorithm("all_reduce", x.numel() * x.element_size(), axis)]

        def start():
            p = fn(x0, op, pg, parts, ranks.index(self.rank), owned)
            return algos.Pending(p.works, lambda: p.finish().view(x.shape))

        return self._start("all_reduce", label, axis, start)

    def reduce_scatter_start(
        self,
        x: torch.Tensor,
        op: ReduceOp,
        *,
        dim: int,
        axis: str | None,
        donate: bool,
        label: str,
    ) -> Work:
        pg, ranks = self.group(axis)
        index = ranks.index(self.rank)
        total = x.shape[dim]
        n = len(ranks)
        parts = [hi - lo for lo, hi in (slice_bounds(total, n, i) for i in range(n))]
        if len(ranks) == 1:
            return Work("reduce_scatter", label, axis, _ready(x if donate else x.clone()))
        x0 = x.movedim(dim, 0).contiguous()
        owned = donate or x0.data_ptr() != x.data_ptr()
        algo = self._algorithm("reduce_scatter", x.numel() * x.element_size(), axis)
        fn = algos.REDUCE_SCATTER[algo]

        def start():
            p = fn(x0, op, pg, parts, index, owned)
            return algos.Pending(p.works, lambda: p.finish().movedim(0, dim))

        return self._start("reduce_scatter", label, axis, start)

    def all_gather_start(
        self,
        x: torch.Tensor,
        *,
        dim: int,
        parts: Sequence[int],
        axis: str | None,
        label: str,
    ) -> Work:
        pg, ranks = self.group(axis)
        if len(ranks) == 1:
            return Work("all_gather", label, axis, _ready(x))
        index = ranks.index(self.rank)
        x0 = x.movedim(dim, 0).contiguous()
        nbytes = sum(parts) * (x.numel() // max(x.shape[dim], 1)) * x.element_size()
        algo = self._algorithm("all_gather", nbytes, axis)
        fn = algos.ALL_GATHER[algo]

        def start():
            p = fn(x0, pg, list(parts), index)
            return algos.Pending(p.works, lambda: p.finish().movedim(0, dim))

        return self._start("all_gather", label, axis, start)

    def broadcast_start(
        self, x: torch.Tensor, *, root: int, axis: str | None, donate: bool, label: str
    ) -> Work:
        pg, ranks = self.group(axis)
        if len(ranks) == 1:
            return Work("broadcast", label, axis, _ready(x))
        src = ranks[root]

        def start():
            if self.rank == src:
                buf = x.contiguous()  # the root's value is only read
            else:
                fmt = torch.contiguous_format
                buf = x.contiguous() if donate else torch.empty_like(x, memory_format=fmt)
            w = dist.broadcast(buf, src=src, group=pg, async_op=True)
            return algos.Pending([w], lambda: buf)

        return self._start("broadcast", label, axis, start)

    def reduce_start(
        self,
        x: torch.Tensor,
        op: ReduceOp,
        *,
        root: int,
        axis: str | None,
        donate: bool,
        label: str,
    ) -> Work:
        """The group's ``root``-th rank gets the reduction; the others get zeros (the program's
        meaning; gloo itself leaves them undefined)."""
        pg, ranks = self.group(axis)
        if len(ranks) == 1:
            return Work("reduce", label, axis, _ready(x if donate else x.clone()))
        x0, owned, parts = self._flat(x, donate, len(ranks))
        fn = algos.REDUCE[self._algorithm("reduce", x.numel() * x.element_size(), axis)]
        index = ranks.index(self.rank)

        def start():
            p = fn(x0, op, pg, parts, index, owned, root)
            return algos.Pending(p.works, lambda: p.finish().view(x.shape))

        return self._start("reduce", label, axis, start)

    def _flat(self, x: torch.Tensor, donate: bool, n: int):
        """x as a flat contiguous tensor, whether we may overwrite it, and its n parts' sizes."""
        x0 = x.reshape(-1)
        owned = donate or x0.data_ptr() != x.data_ptr()
        if not x0.is_contiguous():
            x0, owned = x0.contiguous(), True
        parts = [hi - lo for lo, hi in (slice_bounds(x0.numel(), n, i) for i in range(n))]
        return x0, owned, parts

    def send_start(self, x: torch.Tensor, *, axis: str | None, label: str) -> Work:
        """Rank i of ``axis`` receives rank i-1's ``x``; the first rank of the axis gets zeros."""
        _, ranks = self.group(axis)
        i = ranks.index(self.rank)

        def start():
            works = []
            src = x.contiguous()
            if i + 1 < len(ranks):
                works.append(dist.isend(src, dst=ranks[i + 1]))
            if i > 0:
                buf = torch.empty_like(src)
                works.append(dist.irecv(buf, src=ranks[i - 1]))
            else:
                buf = torch.zeros_like(src)
            return algos.Pending(works, lambda: buf)

        return self._start("send", label, axis, start)

    # -- algorithm choice -----------------------------------------------------------------------

    def _algorithm(self, op: str, nbytes: int, axis: str | None) -> str:
        fixed = self.options.fixed_algorithm(op)
        if fixed is not None:
            return fixed  # CommOptions checked it against _TUNED[op]
        _, ranks = self.group(axis)
        cls = size_class(nbytes)
        choice = self.table.get(op, cls, self.backend, len(ranks))
        if choice is None:
            choice = self.measure(op, cls, axis)
        return choice.algorithm

    def measure(self, op: str, cls: str, axis: str | None = None):
        """Measure every algorithm of ``op`` at size class ``cls`` on ``axis``'s group, choose the
        fastest (the same on every rank), record it in the table and return the ``Choice``.

        Collective: every rank of the world must call it at the same point (generated code does:
        every rank runs the same collectives in the same order)."""
        if op not in _TUNED or cls not in (label for _, label, _ in SIZE_CLASSES):
            raise ConfigError(
                f"cannot measure {op!r} at size class {cls!r}",
                op="Communicator.measure",
                hint=f"op is one of {sorted(_TUNED)}, cls one of "
                f"{[label for _, label, _ in SIZE_CLASSES]}",
            )
        pg, ranks = self.group(axis)
        n = len(ranks)
        numel = max(n, class_bytes(cls) // 4)
        numel -= numel % n
        index = ranks.index(self.rank)
        parts = [numel // n] * n
        full = torch.ones(numel, device=self.device)
        part = torch.ones(numel // n, device=self.device)

        def run_once(name: str) -> None:
            if op == "reduce":
                p = algos.REDUCE[name](full, ReduceOp.SUM, pg, parts, index, False, 0)
            elif op in ("all_reduce", "reduce_scatter"):
                p = _TUNED[op][name](full, ReduceOp.SUM, pg, parts, index, False)
            else:
                p = algos.ALL_GATHER[name](part, pg, parts, index)
            for w in p.works:
                w.wait()
            p.finish()

        def agree(times: list[float]) -> list[float]:
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the whole world: everyone must agree
            return t.tolist()

        choice = self._guard(
            op,
            f"measuring algorithms ({cls})",
            axis,
            measure_choice,
            sorted(_TUNED[op]),
            run_once,
            agree,
            reps_for(cls, self.options.measure_reps),
        )
        self.table.put(op, cls, self.backend, n, choice)
        if self.rank == 0:
            try:
                self.table.save()
            except OSError:
                pass  # an unwritable cache costs a re-measurement next time, nothing more
        return choice

    # -- control: handshake, vote, barrier ------------------------------------------------------

    def agree_max(self, values: Sequence[int], label: str, op: str = "handshake") -> list[int]:
        """Element-wise MAX over the world of a short int vector (the same length on every rank)."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        if self.world > 1:
            self._guard(op, label, None, dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def max_over_world(self, values: Sequence[float], label: str) -> list[float]:
        """Element-wise MAX over the world of a short float vector (same length everywhere)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world > 1 and len(values):
            self._guard("all_reduce", label, None, dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def exchange(self, obj: Any, label: str) -> list[Any]:
        """Every rank's ``obj`` (any picklable value, of any size), in rank order."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._guard("handshake", label, None, dist.all_gather_object, out, obj)
        return out

    def barrier(self, label: str = "barrier") -> None:
        if self.world > 1:
            self._guard("barrier", label, None, dist.barrier)

    def __repr__(self) -> str:
        state = f", broken: {self.broken}" if self.broken else ""
        return f"Communicator(rank {self.rank} of {self.mesh}, {self.backend}{state})"


def _ready(value: torch.Tensor) -> algos.Pending:
    return algos.Pending([], lambda: value)
