"""Measuring candidates on the real ranks: compiled, warmed up, timed step by step.

Collective: every rank measures the same candidates in the same order. For each one:

1. compile it (``coconet.compile`` on the communicator of its transport and algorithms) and
   build its inputs; the ranks vote on whether that worked before any step runs, so one rank's
   compile error never leaves the others waiting in a step;
2. warm up (the first call compiles the fused kernels), until a step no longer page-faults
   (``_SETTLED_FAULTS``: the heap has settled); a candidate whose warm-up took longer than its
   ``budget_s`` is not timed further ("timed out");
3. time ``reps`` steps, each started at one instant on every rank (``aligned_start``), each
   the slowest rank's time (MAX over the world), and keep the median;
4. vote again: a candidate that failed on any rank scores as infinitely slow, with the first
   failing rank's error, and the tuning goes on. A communicator a failed step broke is replaced
   by a fresh one over the same ranks.

``rematch`` times two candidates again, their steps interleaved: the tuner's deciding round
between the two best when they are close.

The votes go through the job's default process group (``torch.distributed``), which a broken
coconet communicator does not affect.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import resource
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from coconet.accounting import Counter
from coconet.ir.program import Program
from coconet.options import CommOptions, CompileOptions, TransportKind, TransportPolicy
from coconet.runtime.allocator import trim_heap
from coconet.runtime.comm import Communicator
from coconet.tune.candidates import Candidate
from coconet.tune.cost import collective_inputs

__all__ = ["Communicators", "Measurement", "Rematch", "communicator_options", "measure", "rematch"]


@dataclass
class Measurement:
    """What measuring one candidate gave: its median step (None: failed or timed out)."""

    candidate: Candidate
    ms: float | None
    steps_ms: list[float] = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False

    @property
    def score(self) -> float:
        return self.ms if self.ms is not None else math.inf

    def to_json(self) -> dict[str, Any]:
        return {
            "ms": self.ms,
            "steps_ms": self.steps_ms,
            "error": self.error,
            "timed_out": self.timed_out,
        }


class Communicators:
    """One communicator per (transport, fixed algorithms) over the ranks of ``base``, made on
    first use (collective: every rank asks for the same ones in the same order).

    The candidates never run on ``base`` itself: a candidate that fails mid-step breaks its
    communicator, and the caller's must stay usable whatever the tuning met."""

    def __init__(self, base: Communicator) -> None:
        self.base = base
        self._made: dict[tuple, Communicator] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}

    def transports(self) -> list[TransportKind]:
        """The transports the ranks can use: shared memory where they share a host, two levels
        where they span hosts that allow it, and torch.distributed (flat) either way."""
        own = self.base.transport_of(None)
        if own in (TransportKind.SHARED_MEMORY, TransportKind.HIERARCHICAL):
            return [own, TransportKind.TORCH_DISTRIBUTED]
        return [own]

    def get(self, transport: TransportKind, algorithms: tuple = ()) -> Communicator:
        key = (transport, algorithms)
        if key not in self._made:
            options = communicator_options(transport, algorithms, self.base.options)
            self._made[key] = self.base.variant(options)
        return self._made[key]

    def buffer(self, comm: Communicator, step, name: str, shape: tuple) -> torch.Tensor:
        """``step.input_buffer(name, shape)``, made once per communicator, input and shape and
        reused by every candidate (a shared-memory group keeps each registered buffer for its
        lifetime: one per candidate would add up to gigabytes at 64M parameters). Collective:
        every rank measures the same candidates in the same order."""
        from coconet.ir.opspec import Prop, spec

        readers = [
            u for u in step.program.users()[name] if spec(u.op).has(Prop.COMMUNICATES)
        ]
        axis = readers[0].attr("axis") if readers else None
        key = (id(comm), name, shape, axis)
        if key not in self._buffers:
            self._buffers[key] = step.input_buffer(name, shape)
        return self._buffers[key]

    def replica(self, comm: Communicator, step, name: str, shape: tuple):
        """``step.host_replica(name, shape)``, made once per communicator, input and shape and
        reused by every candidate (as ``buffer``). Collective."""
        key = (id(comm), "replica", name, shape)
        if key not in self._buffers:
            self._buffers[key] = step.host_replica(name, shape)
        return self._buffers[key]

    def discard(self, transport: TransportKind, algorithms: tuple = ()) -> None:
        """Forget a communicator a failed step may have broken (collective: every rank does,
        so that the next ``get`` makes a fresh one everywhere)."""
        gone = self._made.pop((transport, algorithms), None)
        self._buffers = {k: v for k, v in self._buffers.items() if k[0] != id(gone)}

    def by_transport(self) -> dict[TransportKind, Communicator]:
        return {t: self.get(t) for t in self.transports()}


def program_inputs(
    program: Program,
    sizes: Mapping[str, int],
    comm: Communicator,
    scalars: Mapping[str, float],
    seed: int,
) -> dict[str, Any]:
    """This rank's inputs of ``program`` (scheduled: its inputs' layouts as the schedule left
    them) at ``sizes``: random tensors (Replicated ones the same on every rank), the given
    scalars (any finite value times alike: 0.5 for a float scalar not given, 1 for an integer
    one)."""
    counter = Counter(comm.mesh, sizes)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for node in program.inputs:
        if node.type.rank == 0:
            if node.type.dtype.torch.is_floating_point:
                out[node.name] = float(scalars.get(node.name, 0.5))
            else:  # a seed or a step count: an integer the step refuses to truncate
                out[node.name] = int(scalars.get(node.name, 1))
            continue
        shape = counter.local_shape(node.type, comm.rank)
        local = node.type.layout.is_local
        g = torch.Generator().manual_seed(seed + 7919 * (comm.rank + 1)) if local else gen
        t = torch.rand(shape, generator=g, dtype=torch.float32).to(node.type.dtype.torch)
        out[node.name] = t.to(comm.device)
    return out


def _vote_failed(comm: Communicator, failed: bool, error: str | None) -> str | None:
    """The first failing rank's error, the same on every rank of ``comm`` (None: every rank
    succeeded). Over torch.distributed's group of ``comm``'s world, never its own channels: a
    candidate that failed may have broken them."""
    if comm.world == 1:
        return error if failed else None
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.process_group)
    if not flag.item():
        return None
    errors: list[Any] = [None] * comm.world
    dist.all_gather_object(errors, (comm.members[comm.rank], error) if failed else None,
                           group=comm.process_group)  # fmt: skip
    rank, text = next(e for e in errors if e is not None)
    return f"rank {rank}: {text}"


def _max_over_world(comm: Communicator, values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    if comm.world > 1 and len(values):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.process_group)
    return t.tolist()


@dataclass
class _Ready:
    """A candidate compiled on its communicator, with this rank's inputs in place."""

    candidate: Candidate
    comm: Communicator
    fn: Any
    inputs: dict[str, Any]
    originals: dict[str, torch.Tensor]  # the donated inputs' values, restored before each step

    def step(self) -> None:
        _refill(self.inputs, self.originals)
        self.fn(**self.inputs)


def _prepare(
    candidate: Candidate,
    comms: Communicators,
    sizes: Mapping[str, int],
    options: CompileOptions,
    scalars: Mapping[str, float],
    replicas: Sequence[str] = (),
) -> _Ready | Measurement:
    """Compile ``candidate`` and build its inputs; a failed ``Measurement`` if any rank could
    not (the same on every rank: the ranks vote). An input named in ``replicas`` is passed as
    a host replica where the compiled step can flip it (as ``coconet.optim`` passes its
    parameters with ``param_storage="host-shared"``)."""
    from coconet.compiler import compile as coconet_compile

    comm = comms.get(candidate.transport, candidate.algorithms)
    error: str | None = None
    fn = inputs = None
    try:  # local work only: a rank that fails here must not leave the others in a collective
        fn = coconet_compile(candidate.target, comm=comm, options=options)
        inputs = program_inputs(candidate.scheduled, sizes, comm, scalars, seed=1234)
    except Exception as e:  # noqa: BLE001 - any failure scores the candidate, never the tuning
        error = f"{type(e).__name__}: {e}"
    error = _vote_failed(comms.base, error is not None, error)
    if error is None:
        try:
            # An input a collective reads lives where the collective reads it (symmetric
            # memory over shared memory), as coconet.optim's gradient buckets do. Collective:
            # only once every rank has compiled.
            for name in collective_inputs(candidate.scheduled):
                t = inputs.get(name)
                if isinstance(t, torch.Tensor) and t.dim():
                    buf = comms.buffer(comm, fn, name, tuple(t.shape))
                    buf.copy_(t)
                    inputs[name] = buf
            flips = getattr(fn.module, "REPLICA_INPUTS", ())
            for name in (n for n in replicas if n in flips):
                t = inputs[name]
                live = comms.replica(comm, fn, name, tuple(t.shape)).live()
                if comm.rank == 0:  # one copy per host: one writer
                    live.copy_(t)
                comm.barrier("tuning")
                inputs[name] = live
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        error = _vote_failed(comms.base, error is not None, error)
    if error is not None:
        return Measurement(candidate, None, error=error)
    originals = {
        k: v.clone()
        for k, v in inputs.items()
        if k in options.donate and isinstance(v, torch.Tensor)
    }
    return _Ready(candidate, comm, fn, inputs, originals)


def _one(
    candidate: Candidate,
    comms: Communicators,
    sizes: Mapping[str, int],
    options: CompileOptions,
    scalars: Mapping[str, float],
    warmup: int,
    reps: int,
    budget_s: float,
    replicas: Sequence[str] = (),
) -> Measurement:
    ready = _prepare(candidate, comms, sizes, options, scalars, replicas)
    if isinstance(ready, Measurement):
        return ready
    error: str | None = None
    times: list[float] = []
    timed_out = False
    try:
        warmed, warm_s = _warm_up(ready.step, comms.base, warmup, budget_s)
        timed_out = warm_s > budget_s
        if not timed_out:
            per_step = warm_s / warmed
            n = max(3, min(reps, int(budget_s / max(per_step, 1e-6))))
            n = _max_over_world(comms.base, [n])[0]  # every rank times the same number of steps
            for _ in range(int(n)):
                times.append(_timed_step(ready, comms.base))
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    error = _vote_failed(comms.base, error is not None, error)
    if error is not None:
        comms.discard(candidate.transport, candidate.algorithms)  # a step failed: maybe broken
        return Measurement(candidate, None, error=error)
    if timed_out:
        return Measurement(
            candidate,
            None,
            error=f"timed out: warm-up took more than {budget_s:g} s",
            timed_out=True,
        )
    slowest = _max_over_world(comms.base, times)
    ms = [1e3 * t for t in slowest]
    return Measurement(candidate, statistics.median(ms), ms)


# The warm-up goes on past ``warmup`` steps until a step page-faults at most this many pages on
# every rank, for at most ``_MAX_WARMUP`` steps. A large step's heap takes a few steps to settle
# (glibc keeps small remainders of aligned allocations in a per-thread cache, which keeps freed
# buffers from merging until it is full: ``tests/unit/test_allocator.py``); the steps it grows
# in fault their temporaries in (64M-parameter Adam, ``split``: 0.7 s settled, 1.4-2.3 s in the
# steps that faulted 0.25-0.5 GiB), and timing them would put that one-time growth in the
# median of a handful of steps, where a training loop pays it once.
_SETTLED_FAULTS = 256
_MAX_WARMUP = 12


def _minor_faults() -> int:
    """This process's minor page faults so far (a fresh page touched: zeroed and mapped)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _warm_up(step: Callable[[], None], base: Communicator, warmup: int, budget_s: float
             ) -> tuple[int, float]:  # fmt: skip
    """Run ``step`` at least ``warmup`` times, then until one faults at most
    ``_SETTLED_FAULTS`` pages on every rank, ``_MAX_WARMUP`` steps were run or ``budget_s`` is
    spent: (steps run, seconds spent, the slowest rank's). Collective: each decision after the
    first ``warmup`` steps is agreed (MAX over the world), so every rank runs as many."""
    start = time.perf_counter()
    warmed = 0
    while True:
        faults = _minor_faults()
        step()
        warmed += 1
        if warmed < warmup:
            continue
        spent, faulted = _max_over_world(
            base, [time.perf_counter() - start, float(_minor_faults() - faults)]
        )
        if faulted <= _SETTLED_FAULTS or warmed >= _MAX_WARMUP or spent > budget_s:
            return warmed, spent


def _timed_step(ready: _Ready, align: Communicator) -> float:
    """Seconds of one step on this rank, started at the same instant on every rank
    (``align.aligned_start``: the tuner's base communicator, whose start releases the ranks
    together where they share memory, whatever transport the candidate runs on)."""
    _refill(ready.inputs, ready.originals)
    align.aligned_start("tuning")
    t0 = time.perf_counter()
    ready.fn(**ready.inputs)
    return time.perf_counter() - t0


@dataclass
class Rematch:
    """The two best measured candidates timed again, step for step in turn (A B B A A B ...),
    so that a slow spell of the machine falls on both alike: on a shared host the first round,
    which times one candidate after the other, can rank two close ones by when each ran."""

    first: Candidate  # the first round's winner
    second: Candidate  # its runner-up
    first_ms: list[float]  # each step, the slowest rank's
    second_ms: list[float]

    @property
    def medians(self) -> tuple[float, float]:
        return statistics.median(self.first_ms), statistics.median(self.second_ms)

    @property
    def overturned(self) -> bool:
        """Whether the runner-up was the faster in the rematch."""
        a, b = self.medians
        return b < a

    @property
    def winner(self) -> Candidate:
        return self.second if self.overturned else self.first

    def to_json(self) -> dict[str, Any]:
        return {"first_ms": self.first_ms, "second_ms": self.second_ms}


def rematch(
    first: Candidate,
    second: Candidate,
    comms: Communicators,
    sizes: Mapping[str, int],
    *,
    options: CompileOptions | None = None,
    scalars: Mapping[str, float] | None = None,
    steps: int = 7,
    replicas: Sequence[str] = (),
) -> Rematch | None:
    """Time ``first`` and ``second`` again, ``steps`` steps each, interleaved (see ``Rematch``).
    Collective. None if either failed on any rank (the first round's ranking then stands)."""
    options = options or CompileOptions()
    ready = []
    for c in (first, second):
        r = _prepare(c, comms, sizes, options, scalars or {}, replicas)
        if isinstance(r, Measurement):
            return None
        ready.append(r)
    times: tuple[list[float], list[float]] = ([], [])
    error = None
    try:
        for r in ready:
            r.step()  # warm: its kernels compiled in the first round, its buffers not yet hot
        for i in range(steps):
            # A B, then B A: neither always runs right after the other's step
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for j in order:
                times[j].append(_timed_step(ready[j], comms.base))
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    if _vote_failed(comms.base, error is not None, error) is not None:
        for c in (first, second):
            comms.discard(c.transport, c.algorithms)
        return None
    slowest = _max_over_world(comms.base, times[0] + times[1])
    ms = [1e3 * t for t in slowest]
    return Rematch(first, second, ms[:steps], ms[steps:])


def _refill(inputs: dict, originals: dict) -> None:
    for k, v in originals.items():
        inputs[k].copy_(v)  # a donated input is overwritten by each step


def measure(
    candidates: Sequence[Candidate],
    comms: Communicators,
    sizes: Mapping[str, int],
    *,
    options: CompileOptions | None = None,
    scalars: Mapping[str, float] | None = None,
    warmup: int = 2,
    reps: int = 7,
    budget_s: float = 60.0,
    progress: Callable[[Candidate, Measurement], None] | None = None,
    replicas: Sequence[str] = (),
) -> list[Measurement]:
    """Measure each candidate (see the module's docstring; ``replicas`` as ``_prepare``'s).
    Collective."""
    options = options or CompileOptions()
    out = []
    for c in candidates:
        m = _one(c, comms, sizes, options, scalars or {}, warmup, reps, budget_s, replicas)
        out.append(m)
        # Each candidate's buffers are garbage now; hand the heap back (the runtime keeps large
        # freed buffers mapped for the next step, which across 20 candidates adds up).
        gc.collect()
        trim_heap()
        if progress is not None:
            progress(c, m)
    return out


def communicator_options(
    transport: TransportKind, algorithms: tuple, base: CommOptions
) -> CommOptions:
    """``base`` with ``transport`` forced and ``algorithms`` (``((op, algorithm), ...)``; empty:
    ``base``'s) fixed: how to run a candidate outside the tuner."""
    policy = {
        TransportKind.SHARED_MEMORY: TransportPolicy.SHARED_MEMORY,
        TransportKind.HIERARCHICAL: TransportPolicy.HIERARCHICAL,
    }.get(transport, TransportPolicy.TORCH_DISTRIBUTED)
    chosen = dict(algorithms) if algorithms else base.algorithms
    return dataclasses.replace(base, transport=policy, algorithms=chosen)
