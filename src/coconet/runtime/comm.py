"""The Communicator: collectives over the groups of a Mesh, each run by a transport beside it.

One group per group of every mesh axis (every rank creates every group, in the same order, as
torch.distributed requires); the whole world uses the default group. Each group's transport
(``coconet.runtime.transport``) moves the data: shared memory when every rank of the group is on
one host (``coconet.runtime.shmem``), torch.distributed otherwise (``CommOptions.transport`` can
force either). The communicator chooses algorithms, enforces deadlines, translates failures and
carries the control messages (handshake, commit vote, barrier) over torch.distributed.

Collectives are in start/wait form: ``work = comm.all_reduce_start(x, ...)`` (one entry point per
communication op, named by its spec, all going through ``Communicator.start``) returns with the
operation in flight, ``comm.wait(work)`` returns the result. On torch.distributed, all_reduce,
reduce_scatter and all_gather pick their algorithm per size class (``tuning``), the same on every
rank.

Failures: a transport error (a peer that died closes its connections or leaves its signals
unposted; a peer that stalls trips the deadline) becomes a ``RuntimeFault`` naming the
collective, the value it computed and the likely cause. After one, the communicator is marked
broken and refuses further work: a group that failed mid-collective cannot line up again.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from coconet.cache import keyed_cache_dir
from coconet.errors import ConfigError, RuntimeFault
from coconet.ir.mesh import Mesh
from coconet.ir.ops import Op, ReduceOp
from coconet.options import Algorithm, CommOptions, TransportKind, TransportPolicy
from coconet.runtime.channels import OnePassChannel
from coconet.runtime.shmem import SharedMemoryTransport, ShmGroup, torch_gather
from coconet.runtime.symmem import host_identity
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import (
    Group,
    Pending,
    Transport,
    WholeWait,
)
from coconet.runtime.tuning import (
    SIZE_CLASSES,
    AlgorithmTable,
    Choice,
    TuningKey,
    class_bytes,
    measure_choice,
    reps_for,
    size_class,
)

__all__ = ["CommOptions", "Communicator", "Work"]


@dataclass
class Work:
    """A collective in flight, as ``*_start`` returns it; ``Communicator.wait`` completes it."""

    op: str
    label: str
    axis: str | None
    pending: Pending


class Communicator:
    """Collectives among the ranks of ``mesh`` (the default process group must exist)."""

    _made = 0  # communicators made in this process (names each one's abort key)

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
        # Where a rank whose step failed or was interrupted says so (``abort``), so that peers
        # blocked in a torch.distributed collective with it learn at once: they wait in slices
        # and look here between them (shared memory has an abort word of its own). Every rank
        # makes its communicators in the same order, so the key names the same one everywhere.
        Communicator._made += 1
        self._abort_key = f"coconet/aborted/{Communicator._made}"
        self._store = dist.distributed_c10d._get_default_store() if self.world > 1 else None
        self._ready_calls = 0
        # torch.distributed: every group's process group (the control channel of the handshake,
        # the commit vote and the shared-memory rendezvous), and the transport of groups that
        # span hosts; shared memory for groups within one host (``routes``).
        self.torch = TorchDistributedTransport()
        self.shm = SharedMemoryTransport()
        self._channels: dict[str | None, OnePassChannel] = {}  # comm.one_pass(axis), made once
        everyone = tuple(range(self.world))
        self._groups: dict[str | None, Group] = {
            None: Group(None, everyone, self.rank, self.torch.new_group(everyone, self.world))
        }
        for axis in self.mesh.names:
            for ranks in self.mesh.groups(axis):
                # every rank must create every group, in the same order
                handle = self.torch.new_group(ranks, self.world)
                if self.rank in ranks:
                    self._groups[axis] = Group(axis, tuple(ranks), ranks.index(self.rank), handle)
        self._check_fixed_algorithms()
        self.routes = self._route_groups()
        # The per-step control messages (handshake check, commit vote) over shared memory get a
        # channel of their own: a vote must not wait behind a step's open epoch (a published
        # gather stays open until the commit that the vote allows).
        transport, world = self.routes[None]
        self._control: Group | None = None
        if transport is self.shm:
            state = ShmGroup(
                world.index,
                world.size,
                world.handle.gather,
                self.options.timeout,
                world.handle.cache_dir,
            )
            self._control = Group(None, world.ranks, world.index, state)
        cache = self.options.cache_dir
        self.table = AlgorithmTable.load(keyed_cache_dir(cache))
        self._share_table()

    def _check_fixed_algorithms(self) -> None:
        """An ``{op: algorithm}`` mapping names only algorithms this transport has."""
        if not isinstance(self.options.algorithms, Mapping):
            return
        for op, algorithm in self.options.algorithms.items():
            have = self.torch.algorithms(op)
            if algorithm not in have:
                raise ConfigError(
                    f"CommOptions(algorithms=...) fixes {op} to {algorithm.value}, which the "
                    f"{self.torch.kind.value} transport does not have",
                    op="CommOptions",
                    hint=f"{op} has {[a.value for a in have]}"
                    if have
                    else f"{op} has one way only: leave it out of the mapping",
                )

    def _route_groups(self) -> dict[str | None, tuple[Transport, Group]]:
        """The transport of each of this rank's groups, from evidence every rank contributes.

        Collective (one exchange over the world). Every member of a group sees the same hosts, so
        they all choose alike; ``CommOptions.transport`` can force either transport."""
        policy = self.options.transport
        hosts = self.exchange(host_identity(), "host identity")
        cpu = self.device.type == "cpu" and hasattr(os, "memfd_create")
        routes: dict[str | None, tuple[Transport, Group]] = {}
        for axis, group in self._groups.items():
            one_host = len({hosts[r] for r in group.ranks}) == 1
            if policy is TransportPolicy.SHARED_MEMORY and not (one_host and cpu):
                spread = sorted({hosts[r] for r in group.ranks})
                raise ConfigError(
                    f"CommOptions(transport='shared memory'), but the group along axis {axis!r} "
                    + (f"spans {len(spread)} hosts" if not one_host else "is not on CPU"),
                    op="CommOptions",
                    details=[f"hosts: {spread}"],
                    hint="use transport='auto' (shared memory where it can, torch.distributed "
                    "elsewhere)",
                )
            use_shm = (
                group.size > 1
                and one_host
                and cpu
                and policy is not TransportPolicy.TORCH_DISTRIBUTED
            )
            if use_shm:
                state = ShmGroup(
                    group.index,
                    group.size,
                    torch_gather(group.handle),
                    self.options.timeout,
                    None if self.options.cache_dir is None else str(self.options.cache_dir),
                )
                routes[axis] = (self.shm, Group(axis, group.ranks, group.index, state))
            else:
                routes[axis] = (self.torch, group)
        return routes

    def transport_of(self, axis: str | None) -> TransportKind:
        """What runs the collectives of this rank's group along ``axis``."""
        return self.route(axis)[0].kind

    def route(self, axis: str | None) -> tuple[Transport, Group]:
        """(transport, group) of this rank's group along ``axis``."""
        self.group(axis)  # a clear error for an axis the mesh does not have
        return self.routes[axis]

    # -- groups ---------------------------------------------------------------------------------

    def group(self, axis: str | None) -> Group:
        """This rank's group along ``axis`` (None: the whole world)."""
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
        group = self._groups.get(axis)
        ranks = list(group.ranks) if group is not None else []
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

    # -- collectives: start / wait (the generated code's calls; the transport does the work) ---

    def wait(self, work: Work) -> torch.Tensor:
        """The result of a started collective, once it has completed on this rank."""
        return self._guard(work.op, work.label, work.axis, work.pending.wait, self._wait_work)

    def _wait_work(self, work) -> None:
        """``work.wait()`` in slices, looking between them whether a peer aborted its step (a
        peer blocked in this collective with a rank that was interrupted would otherwise learn
        only at the timeout). A slice that ends leaves the collective running (gloo).

        A point-to-point handle (``WholeWait``) is waited for in one call of the timeout: a gloo
        send or recv fails its connection when a slice ends first. A peer that aborts is then
        seen when its process exits (the connection closes) or at the timeout."""
        if self._store is None:
            work.wait()
            return
        if isinstance(work, WholeWait):
            self._check_peers()
            work.wait(datetime.timedelta(seconds=self.options.timeout))
            return
        deadline = time.monotonic() + self.options.timeout
        wait_s = 0.01
        while True:
            try:
                work.wait(datetime.timedelta(seconds=wait_s))
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
            self._check_peers()
            wait_s = min(2 * wait_s, 0.2)

    def _check_peers(self) -> None:
        """A ``RuntimeFault`` if a peer aborted (see ``abort``)."""
        try:
            aborted = self._store.check([self._abort_key])
            reason = self._store.get(self._abort_key).decode() if aborted else None
        except (RuntimeError, OSError) as exc:
            reason = f"the job's store is unreachable (rank 0 died?): {exc}"
        if reason is not None:
            self.broken = f"a peer aborted: {reason}"
            raise RuntimeFault(
                "a peer rank aborted its step (it failed or was interrupted)",
                op="communicator",
                details=[f"on rank {self.rank} of {self.world}", f"the peer said: {reason}"],
                hint="look at that rank's output for its failure; this job cannot continue: "
                "end it (coconet.runtime.shutdown) and restart it",
            )

    def start(
        self, op: Op, x: torch.Tensor, *, label: str, axis: str | None, **arguments: Any
    ) -> Work:
        """Start communication op ``op`` on ``x`` over ``axis``'s group and return at once: the
        typed entry point of ``op`` (``all_reduce_start`` ...) with the op spec's ``arguments``
        (``coconet.ir.opspec``: ``reduce_op``, ``dim``, ``parts``, ``root``, ``donate``)."""
        return _STARTS[op](self, x, label=label, axis=axis, **arguments)

    # -- one typed entry point per communication op: what generated code calls ------------------

    def all_reduce_start(
        self, x: torch.Tensor, reduce_op: ReduceOp, *, axis: str | None, donate: bool, label: str
    ) -> Work:
        return self._start(
            Op.ALL_REDUCE, label, axis, _nbytes(x),
            lambda t, g, a: t.all_reduce(x, g, reduce_op=reduce_op, algorithm=a, donate=donate),
        )

    def reduce_scatter_start(
        self,
        x: torch.Tensor,
        reduce_op: ReduceOp,
        *,
        dim: int,
        axis: str | None,
        donate: bool,
        label: str,
    ) -> Work:
        return self._start(
            Op.REDUCE_SCATTER, label, axis, _nbytes(x),
            lambda t, g, a: t.reduce_scatter(
                x, g, reduce_op=reduce_op, dim=dim, algorithm=a, donate=donate
            ),
        )

    def all_gather_start(
        self, x: torch.Tensor, *, dim: int, parts: Sequence[int], axis: str | None, label: str
    ) -> Work:
        # tuned by the size of what it gathers
        nbytes = sum(parts) * (x.numel() // max(x.shape[dim], 1)) * x.element_size()
        return self._start(
            Op.ALL_GATHER, label, axis, nbytes,
            lambda t, g, a: t.all_gather(x, g, dim=dim, parts=parts, algorithm=a),
        )

    def broadcast_start(
        self, x: torch.Tensor, *, root: int, axis: str | None, donate: bool, label: str
    ) -> Work:
        return self._start(
            Op.BROADCAST, label, axis, _nbytes(x),
            lambda t, g, a: t.broadcast(x, g, root=root, donate=donate),
        )

    def reduce_start(
        self,
        x: torch.Tensor,
        reduce_op: ReduceOp,
        *,
        root: int,
        axis: str | None,
        donate: bool,
        label: str,
    ) -> Work:
        return self._start(
            Op.REDUCE, label, axis, _nbytes(x),
            lambda t, g, a: t.reduce(
                x, g, reduce_op=reduce_op, root=root, algorithm=a, donate=donate
            ),
        )

    def send_start(self, x: torch.Tensor, *, axis: str | None, label: str) -> Work:
        return self._start(Op.SEND, label, axis, _nbytes(x), lambda t, g, a: t.send(x, g))

    def _start(
        self,
        op: Op,
        label: str,
        axis: str | None,
        nbytes: int,
        run: Callable[[Transport, Group, Algorithm | None], Pending],
    ) -> Work:
        """Run ``run(transport, group, algorithm)`` under the fault guard: the algorithm is
        chosen here when the group's transport has several for ``op`` (None otherwise)."""
        transport, _ = self.route(axis)

        def begin() -> Pending:
            group = self.route(axis)[1]
            algorithm = None
            if transport is self.torch and self.torch.algorithms(op):
                # a group of one has nothing to choose: its collectives move no data
                tuned = group.size > 1
                algorithm = self._algorithm(op, nbytes, group) if tuned else Algorithm.NATIVE
            return run(transport, group, algorithm)

        return Work(op.value, label, axis, self._guard(op.value, label, axis, begin))

    # -- shared memory's own forms (coconet.codegen.forms): one channel per axis ---------------

    def one_pass(self, axis: str | None) -> OnePassChannel:
        """The shared-memory channel of ``axis``'s group: what generated code calls to run a
        fused collective as one pass, or an all_reduce read in place (see ``OnePassChannel``).
        A ``ConfigError`` when that group does not run on shared memory."""
        channel = self._channels.get(axis)
        if channel is None:
            transport, group = self.route(axis)
            if transport is not self.shm:
                raise ConfigError(
                    f"the step was compiled for shared memory along axis {axis!r}, but this "
                    f"communicator runs it on {transport.kind.value}",
                    op="fused collective",
                    hint="compile the step with the communicator that runs it (comm=...)",
                )
            channel = OnePassChannel(self.shm, group, self._guard)
            self._channels[axis] = channel
        return channel

    def symmetric_tensor(
        self, shape: Sequence[int], dtype: torch.dtype, *, axis: str | None = None
    ) -> torch.Tensor:
        """A tensor for a collective's input along ``axis`` that every peer maps, so the
        collective reads it in place instead of copying it in (as DDP's gradient buckets are
        views into what its all_reduce reads). Collective over the group: every rank calls it
        at the same point, with the same shape. Off shared memory it is an ordinary tensor.

        Its content is the caller's: a collective that reads it may return before a peer has
        finished reading it only when the step's own structure guarantees the peer is done
        (shared memory waits for that)."""
        transport, group = self.route(axis)
        if transport is not self.shm:
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        return self._guard(
            "symmetric memory",
            f"a {tuple(shape)} {dtype} buffer",
            axis,
            lambda: self.shm.symmetric_tensor(group, shape, dtype),
        )

    # -- algorithm choice -----------------------------------------------------------------------

    def _algorithm(self, op: Op, nbytes: int, group: Group) -> Algorithm:
        fixed = self.options.fixed_algorithm(op, self.torch)
        if fixed is not None:
            return fixed  # the communicator checked it against its transport at construction
        key = TuningKey(op, size_class(nbytes), self.backend, group.size)
        choice = self.table.get(key)
        if choice is None:
            choice = self.measure(op, key.size_class, group.axis)
        return choice.algorithm

    def measure(self, op: Op, cls: str, axis: str | None = None) -> Choice:
        """Measure every algorithm of ``op`` at size class ``cls`` on ``axis``'s group, choose the
        fastest (the same on every rank), record it in the table and return the ``Choice``.

        Collective: every rank of the world must call it at the same point (generated code does:
        every rank runs the same collectives in the same order)."""
        if not self.torch.algorithms(op) or cls not in (label for _, label, _ in SIZE_CLASSES):
            raise ConfigError(
                f"cannot measure {op} at size class {cls!r}",
                op="Communicator.measure",
                hint=f"op is one of {[str(o) for o in Op if self.torch.algorithms(o)]}, "
                f"cls one of {[label for _, label, _ in SIZE_CLASSES]}",
            )
        group = self.group(axis)
        n = group.size
        numel = max(n, class_bytes(cls) // 4)
        numel -= numel % n

        def run_once(algorithm: Algorithm) -> None:
            self.torch.run_for_measurement(op, algorithm, group, numel, self.device)

        def agree(times: list[float]) -> list[float]:
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the whole world: everyone must agree
            return t.tolist()

        choice = self._guard(
            op.value,
            f"measuring algorithms ({cls})",
            axis,
            measure_choice,
            self.torch.algorithms(op),
            run_once,
            agree,
            reps_for(cls, self.options.measure_reps),
        )
        self.table.put(TuningKey(op, cls, self.backend, n), choice)
        if self.rank == 0:
            try:
                self.table.save()
            except OSError:
                pass  # an unwritable cache costs a re-measurement next time, nothing more
        return choice

    # -- control: handshake, vote, barrier ------------------------------------------------------

    def agree_max(self, values: Sequence[int], label: str, op: str = "handshake") -> list[int]:
        """Element-wise MAX over the world of a short int vector (the same length on every rank).

        The per-step control messages (the handshake's check, the commit vote) go over the
        world's transport: on one host, shared memory answers in microseconds where a gloo
        round trip costs milliseconds."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        if self.world == 1:
            return t.tolist()
        if self._control is not None:
            control = self._control
            work = self._guard(
                op,
                label,
                None,
                lambda: self.shm.all_reduce(t, control, reduce_op=ReduceOp.MAX, donate=True),
            )
            return self._guard(op, label, None, work.wait).tolist()
        work = self._guard(op, label, None, dist.all_reduce, t, op=dist.ReduceOp.MAX, async_op=True)
        self._guard(op, label, None, self._wait_work, work)
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

    def agree_ready(self, label: str, deadline_s: float) -> None:
        """Wait until every rank has called ``agree_ready`` with the same label, for up to
        ``deadline_s`` seconds (not the communicator's timeout: it is for work that may take
        long, such as compiling a step's kernels, done outside any collective). Through the
        job's store, watching for a peer that aborted and, on one host, for one that died."""
        if self._store is None:
            return
        self._ready_calls += 1
        key = f"{self._abort_key}/ready/{self._ready_calls}"
        everyone = [f"{key}/{r}" for r in range(self.world)]
        pids = self._peer_pids()
        give_up = time.monotonic() + deadline_s
        pause = 0.001

        def all_ready() -> bool:
            try:
                return self._store.check(everyone)
            except (RuntimeError, OSError):
                self._check_peers()  # the store is gone: a RuntimeFault that says so
                raise

        self._guard("readiness", label, None, self._store.set, f"{key}/{self.rank}", label)
        while not all_ready():
            self._check_peers()
            dead = [r for r, pid in pids.items() if not _alive(pid)]
            if dead or time.monotonic() > give_up:
                self.broken = f"ranks not ready: {label}"
                late = f"not every rank was ready in {deadline_s:g} s"
                cause = f"rank(s) {dead} died" if dead else late
                raise RuntimeFault(
                    f"{cause}: {label}",
                    op="readiness",
                    details=[f"on rank {self.rank} of {self.world}"],
                    hint="look at the other ranks' output; this job cannot continue: end it "
                    "(coconet.runtime.shutdown) and restart it",
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _peer_pids(self) -> dict[int, int]:
        """The peers' process ids, where shared memory told them (one host), by rank."""
        handle = self._control.handle if self._control is not None else None
        mem = getattr(handle, "mem", None)
        if mem is None:
            return {}
        return {r: pid for r, pid in enumerate(mem.pids) if r != self.rank}

    def abort(self, reason: str) -> None:
        """Mark the communicator broken and tell every peer at once, not at their timeout: a
        step failed or was interrupted here mid-way (peers may be inside a collective this rank
        will never finish). Over shared memory the peers' waits see this rank's abort word; on
        torch.distributed they look at the job's store between slices of their waits."""
        if self.broken is None:
            self.broken = reason
        for transport, group in self.routes.values():
            if transport is self.shm:
                group.handle.abort()
        if self._control is not None:
            self._control.handle.abort()
        if self._store is not None:
            try:
                self._store.set(self._abort_key, f"rank {self.rank}: {reason}")
            except (RuntimeError, OSError):
                pass  # the store is gone (its host died): the peers learn from that

    def __repr__(self) -> str:
        state = f", broken: {self.broken}" if self.broken else ""
        return f"Communicator(rank {self.rank} of {self.mesh}, {self.backend}{state})"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) is running: not gone, not a zombie."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except ProcessLookupError:
        return False
    except OSError:
        return True  # no procfs or not ours to signal: no evidence that it died


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# The typed entry point of each communication op (``Communicator.start`` dispatches on it).
_STARTS: dict[Op, Callable[..., Work]] = {
    Op.ALL_REDUCE: Communicator.all_reduce_start,
    Op.REDUCE_SCATTER: Communicator.reduce_scatter_start,
    Op.ALL_GATHER: Communicator.all_gather_start,
    Op.BROADCAST: Communicator.broadcast_start,
    Op.REDUCE: Communicator.reduce_start,
    Op.SEND: Communicator.send_start,
}
