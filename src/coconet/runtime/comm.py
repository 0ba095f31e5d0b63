"""The Communicator: collectives over the groups of a Mesh, each run by a transport beside it.

A communicator is three small parts and the calls that use them:

- **routes** (``coconet.runtime.routing``): one group per group of every mesh axis, and the
  transport that runs it: shared memory when every rank of the group is on one host
  (``coconet.runtime.shmem``), torch.distributed otherwise (``CommOptions.transport`` can force
  either);
- **the fault guard** (``coconet.runtime.faults``): every call runs under it; a failure of the
  job (a peer that died closes its connections or leaves its signals unposted; a peer that
  stalls trips the deadline) becomes a ``RuntimeFault`` naming the collective, the value it
  computed and the likely cause, and breaks the communicator (a group that failed
  mid-collective cannot line up again); a bug raises as itself;
- **the control channel** (``coconet.runtime.control``): the per-step agreement, exchanges,
  readiness after a compile, and the abort a failing rank sends its peers.

Collectives are in start/wait form: ``work = comm.all_reduce_start(x, ...)`` (one typed entry
point per communication op, named by its spec's ``transport``) returns with the operation in
flight, ``comm.wait(work)`` returns the result. Where a group's transport has several
algorithms for an op (torch.distributed's all_reduce, reduce_scatter, all_gather and reduce),
the communicator's ``AlgorithmChoice`` picks one per size class (``tuning``), the same on every
rank. A transport's own forms (shared memory's one pass) go through ``comm.one_pass(axis)``
(``coconet.runtime.channels``).

The transports are named in construction only (``_build``); after it the communicator asks a
group's transport what it can do (``coconet.runtime.transport.Transport``), never which it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from coconet import tracing
from coconet.errors import ConfigError
from coconet.ir.mesh import Mesh
from coconet.ir.ops import Op, ReduceOp
from coconet.options import Algorithm, AlgorithmPolicy, CommOptions, TransportKind
from coconet.runtime import handshake
from coconet.runtime.channels import OnePassChannel
from coconet.runtime.control import ControlChannel
from coconet.runtime.faults import FaultGuard
from coconet.runtime.flight import FlightRecorder
from coconet.runtime.handshake import Deferred, LocalSteps
from coconet.runtime.hierarchy import HierarchicalTransport
from coconet.runtime.p2p import PeerLinks
from coconet.runtime.replica import HostReplica
from coconet.runtime.routing import (
    control_group,
    host_levels,
    mesh_groups,
    peer_plan,
    route_groups,
    wants_levels,
)
from coconet.runtime.shmem import SharedMemoryTransport
from coconet.runtime.symmem import host_identity
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import Group, Pending, ReadyPending, Transport, ready
from coconet.runtime.tuning import AlgorithmChoice, AlgorithmTable, Choice, TuningKey

__all__ = ["CommOptions", "Communicator", "Work"]


# read on every collective: an enum member's attribute access costs ~0.3 us on Python 3.11
_EXACT = AlgorithmPolicy.EXACT


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
        world = dist.get_world_size()
        mesh = mesh or Mesh.world(world)
        if mesh.size != world:
            raise ConfigError(
                f"{mesh} has {mesh.size} ranks but the job has {world}",
                op="Communicator",
                hint="launch as many ranks as the mesh has, or pass a mesh that fits the job",
            )
        Communicator._made += 1  # every rank makes its communicators in the same order
        self._build(
            mesh,
            options or CommOptions(),
            rank=dist.get_rank(),
            members=tuple(range(world)),
            abort_key=f"coconet/aborted/{Communicator._made}",
            groups=None,
        )
        recorder = tracing.recording()
        if recorder is not None:
            # a clock mark for the trace's merge: every rank leaves this at about one instant
            self.aligned_start("coconet trace: clock")
            recorder.mark(f"communicator {Communicator._made}")

    def _build(
        self,
        mesh: Mesh,
        options: CommOptions,
        *,
        rank: int,
        members: tuple[int, ...],
        abort_key: str,
        groups: dict[str | None, Group] | None,
        process_group: Any = None,
        parent: tuple[Communicator, str] | None = None,
    ) -> None:
        """Make the communicator of ``members`` (global ranks; this process is ``rank`` among
        them) over ``mesh``: its groups (``groups``, or every group of the mesh, made here), its
        fault guard, control channel and routes. Collective over ``members`` only."""
        self.options = options
        self.rank, self.world, self.mesh = rank, len(members), mesh
        self.members = members  # the job's global ranks of this communicator's world, in order
        self.process_group = process_group  # torch.distributed's group of that world (None: all)
        self._parent = parent  # (communicator, axis) for one made by ``along``
        self._subs: dict[str, Communicator] = {}  # along(axis), made once
        self._made_along = 0  # sub-communicators made from this one (names their abort keys)
        self.backend = str(dist.get_backend())
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        # the three parts a communicator is made of: the fault guard every call runs under,
        # the control channel (agreement, exchange, readiness, abort), and the routes (which
        # transport runs each group)
        self.guard = FaultGuard(
            self.rank, self.world, self.backend, self.options.timeout, self._ranks_of
        )
        self.control = ControlChannel(
            self.rank,
            self.world,
            self.device,
            self.options.timeout,
            self.guard,
            abort_key,
            process_group,
            members[0],
            job_rank=members[rank],
        )
        self.guard.explain = self.control.peer_reason
        if self.options.flight_recorder:
            # named by its abort key (the same on each of its ranks), less the common prefix
            name = abort_key.removeprefix("coconet/aborted/")
            self.guard.recorder = FlightRecorder(name, rank, members, self.options.flight_recorder)
            self.guard.positions = self.control.positions
        # The calls this rank made, by kind (an optimizer's steps, each compiled program's
        # calls): what a rank that leaves tells the peers (``depart``), so that one that made a
        # call more learns which rank stopped where
        self.progress: dict[str, int] = {}
        # The transports, named here only. torch.distributed's makes every group and runs those
        # that span hosts flat; it is also the one with algorithms to choose among (``choice``,
        # and the tuner's calibration: ``torch``). After construction a group's transport is
        # asked what it can do (``Transport``), never which it is.
        self.torch = TorchDistributedTransport()
        shm = SharedMemoryTransport()
        hier = HierarchicalTransport(shm, self.torch)
        # the algorithm of each collective where its transport has several (an ``{op:
        # algorithm}`` mapping in the options is checked here, before any group is made)
        self.choice = AlgorithmChoice(
            self.torch, self.options, rank=rank, backend=self.backend, device=self.device,
            guard=self.guard, process_group=process_group,
        )
        self._channels: dict[str | None, OnePassChannel] = {}  # comm.one_pass(axis), made once
        # the agreement of the step now running, put off until its first all_reduce rides with
        # it (``defer_agreement``), and the calls of steps that communicate nothing since the
        # last agreement round (``handshake``: both are settled by the next round)
        self._deferred: Deferred | None = None
        self.local_steps = LocalSteps()
        # the verdicts of input shapes every rank has, by program (``handshake.Verdicts``):
        # shared by the compiled steps of one program, the same layer in every block
        self.alike_verdicts: dict[tuple, tuple | None] = {}
        self._groups = (
            groups if groups is not None else mesh_groups(mesh, rank, self.world, self.torch)
        )
        # Every rank's host identity (routing) and process id (its peers on the same host
        # watch it while they wait outside any collective: ControlChannel.run_watched).
        evidence = self.exchange((host_identity(), os.getpid()), "host identity")
        mine = evidence[self.rank][0]
        self.control.set_peer_pids(
            {r: pid for r, (host, pid) in enumerate(evidence) if host == mine and r != self.rank}
        )
        # by the job's global rank, as groups name their ranks
        hosts = {g: host for g, (host, _) in zip(members, evidence, strict=True)}
        # groups over hosts in two levels: their level groups are made over the whole job, so
        # only a communicator of the whole job (not one ``along`` an axis) makes them
        levels = (
            host_levels(mesh, rank, self.world, hosts, self.torch)
            if groups is None and wants_levels(self.options, self.device)
            else {}
        )
        self.routes = route_groups(
            self._groups, hosts, self.device, self.options, self.torch, shm, hier, levels
        )
        # how many hosts each group spans: part of what a measured algorithm is valid for
        self.choice.hosts = {
            axis: len({hosts[r] for r in g.ranks}) for axis, g in self._groups.items()
        }
        self.control.abort_groups(
            [g for r in self.routes.values() for g in r.transport.signal_groups(r.group)]
        )
        control = control_group(self.routes[None], self.options.timeout)
        if control is not None:
            self.control.use_shared_memory(shm, control)
        self.choice.share(self.control.broadcast_object)  # rank 0's table, on every rank

    # -- sub-communicators --------------------------------------------------------------------

    def along(self, axis: str) -> Communicator:
        """The communicator of this rank's group along ``axis`` alone: its world is that group
        (``rank`` its place in it), its mesh the one axis, and every step compiled with it
        agrees, votes and waits with those ranks only. What a stage of a pipeline (or a dp
        replica) uses for its tensor-parallel layers, so that a step along ``tp`` never waits
        for ranks that do not run it (``coconet.nn`` layers given ``axis`` do this themselves).

        Made once per axis and kept. Collective over the group only (its ranks call it at the
        same point of their program; the other groups need not), because the torch.distributed
        group it runs on was made with this communicator."""
        sub = self._subs.get(axis)
        if sub is None:
            sub = self._subs[axis] = self._sub(axis, self.options)
        return sub

    @property
    def root(self) -> Communicator:
        """The communicator of the whole job this one was made from (``along``, repeatedly);
        itself for one made whole."""
        comm = self
        while comm._parent is not None:
            comm = comm._parent[0]
        return comm

    def variant(self, options: CommOptions) -> Communicator:
        """A new communicator of the same ranks and mesh with ``options`` (the tuner's way to
        try another transport). Collective over this communicator's world."""
        if self._parent is None:
            return Communicator(self.mesh, options)
        parent, axis = self._parent
        return parent._sub(axis, options)

    def _sub(self, axis: str, options: CommOptions) -> Communicator:
        if axis is None or axis not in self.mesh.names:
            raise ConfigError(
                f"Communicator.along: {self.mesh} has no axis {axis!r}",
                op="Communicator.along",
                hint=f"one of {list(self.mesh.names)}",
            )
        self.guard.check("Communicator.along", axis)
        group = self._groups[axis]  # its ranks are the job's global ranks
        self._made_along += 1
        members = tuple(group.ranks)
        sub = Communicator.__new__(Communicator)
        sub._build(
            Mesh(**{axis: group.size}),
            options,
            rank=group.index,
            members=members,
            abort_key=f"{self.control.abort_key}/{axis}{list(members)}/{self._made_along}",
            groups={
                None: Group(None, group.ranks, group.index, group.handle),
                axis: Group(axis, group.ranks, group.index, group.handle),
            },
            process_group=group.handle,
            parent=(self, axis),
        )
        return sub

    @property
    def broken(self) -> str | None:
        """Why the communicator refuses further work (None: it works)."""
        return self.guard.broken

    @broken.setter
    def broken(self, reason: str | None) -> None:
        self.guard.broken = reason

    def _ranks_of(self, axis: str | None) -> tuple[int, ...]:
        group = self._groups.get(axis)
        return group.ranks if group is not None else ()

    def transport_of(self, axis: str | None) -> TransportKind:
        """What runs the collectives of this rank's group along ``axis``."""
        return self.route(axis)[0].kind

    def route(self, axis: str | None) -> tuple[Transport, Group]:
        """(transport, group) of this rank's group along ``axis``."""
        found = self.routes.get(axis)
        if found is None:
            self.group(axis)  # a clear error for an axis the mesh does not have
            return self.routes[axis]
        return found

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

    @property
    def table(self) -> AlgorithmTable:
        """The measured algorithm choices (rank 0's, on every rank): ``AlgorithmChoice.table``."""
        return self.choice.table

    # -- collectives: start / wait (the generated code's calls; the transport does the work) ---

    def wait(self, work: Work) -> torch.Tensor:
        """The result of a started collective, once it has completed on this rank (waits on
        torch.distributed work look for a peer's abort between slices: ``ControlChannel``)."""
        pending = work.pending
        if type(pending) is ReadyPending:  # done when it started (shared memory): nothing to fail
            return pending.value
        return self.guard.wait(work.op, work.label, work.axis, work.pending.wait,
                               self.control.wait_work)  # fmt: skip

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
        deferred = self._deferred
        if deferred is not None and deferred.label == label and self._whole_world(axis):
            # the step's agreement rides with its first all_reduce: one round for both
            self._deferred = None
            done = self.guard(Op.ALL_REDUCE.value, label, axis, handshake.settle_carrying, self,
                              deferred, x, reduce_op, donate)  # fmt: skip
            if done is not None:
                return Work(Op.ALL_REDUCE.value, label, axis, ready(done))
        return self._start(
            Op.ALL_REDUCE, label, axis, _nbytes(x),
            lambda t, g, a: t.all_reduce(x, g, reduce_op=reduce_op, algorithm=a, donate=donate),
        )

    def all_reduce_control_start(self, x: torch.Tensor, reduce_op: ReduceOp, *, label: str
                                 ) -> Work:
        """A scalar all_reduce of the whole world over the control channel (generated code's
        ``Form.CONTROL``: a published gather holds the data group's epoch until the commit).
        Every rank's value is gathered exactly (its bits, one word per rank) and reduced here
        in rank order, as the simulator reduces: the same bits on every rank."""
        if x.numel() != 1 or x.element_size() > 8:
            raise ValueError(f"all_reduce_control_start: {label} is not a scalar of <= 8 bytes")
        if self._deferred is not None:
            self.settle_deferred()
        reduced = self.guard(Op.ALL_REDUCE.value, label, None, self.control.all_reduce_scalar,
                             x, reduce_op, label)  # fmt: skip
        return Work(Op.ALL_REDUCE.value, label, None, ready(reduced))

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
        self, x: torch.Tensor, *, dim: int, parts: Sequence[int], axis: str | None, label: str,
        out: torch.Tensor | None = None,
    ) -> Work:
        """``out``: where the whole goes (the transport writes it there where it can, else
        copies it in; a fully sharded block's buffer), or None: a new tensor."""
        # tuned by the size of what it gathers
        nbytes = sum(parts) * (x.numel() // max(x.shape[dim], 1)) * x.element_size()
        extra = {} if out is None else {"out": out}
        return self._start(
            Op.ALL_GATHER, label, axis, nbytes,
            lambda t, g, a: t.all_gather(x, g, dim=dim, parts=parts, algorithm=a, **extra),
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

    def send_start(self, x: torch.Tensor, *, axis: str | None, label: str,
                   reverse: bool = False) -> Work:  # fmt: skip
        return self._start(Op.SEND, label, axis, _nbytes(x),
                           lambda t, g, a: t.send(x, g, reverse))  # fmt: skip

    # -- the step's agreement, when a step puts it off (coconet.runtime.handshake) -------------

    def defer_agreement(self, deferred: Deferred | None) -> None:
        """Put the running step's agreement off until its all_reduce ``deferred.label`` (the
        step's first communication), which it then rides with. Any other communication first
        settles it on its own (``settle_deferred``), so nothing moves before it. None: drop
        what is put off (the step ended)."""
        self._deferred = deferred

    def settle_deferred(self) -> None:
        """Settle a put-off agreement now, in a round of its own (nothing rode with it): a
        ``handshake.Disagreement`` out of the step when the ranks did not agree."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            reports = handshake.settle(self, deferred.report, False, deferred.identity)
            if reports is not None:
                raise handshake.Disagreement(reports)

    def _whole_world(self, axis: str | None) -> bool:
        return axis is None or self.mesh.axis_size(axis) == self.world

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
        if self._deferred is not None:
            self.settle_deferred()
        transport, group = self.route(axis)
        if self.options.algorithms is _EXACT:
            # rank-ordered sums were asked for after routing: where the group's transport does
            # not sum in rank order, its flat form does (``Transport.rank_ordered``)
            transport, group = transport.rank_ordered(group)
        if not transport.algorithms(op):
            # one way only: nothing to choose (the common small-step path: no closure)
            name = op.value
            return Work(name, label, axis, self.guard.collective(
                name, label, axis, nbytes, transport, run, transport, group, None))

        def begin() -> Pending:
            # a group of one has nothing to choose: its collectives move no data
            tuned = group.size > 1
            algorithm = (
                self.choice.choose(op, nbytes, group, self.options) if tuned else Algorithm.NATIVE
            )
            return run(transport, group, algorithm)

        return Work(op.value, label, axis,
                    self.guard.collective(op.value, label, axis, nbytes, transport, begin))

    # -- a transport's own forms (coconet.codegen.forms): one channel per axis ----------------

    def one_pass(self, axis: str | None) -> OnePassChannel:
        """The one-pass channel of ``axis``'s group: what generated code calls to run a fused
        collective as one pass, or an all_reduce read in place (see ``OnePassChannel``). A
        ``ConfigError`` when that group's transport has no such forms (``Transport.one_pass``:
        shared memory has them)."""
        if self._deferred is not None:
            self.settle_deferred()
        channel = self._channels.get(axis)
        if channel is None:
            transport, group = self.route(axis)
            if not transport.one_pass:
                raise ConfigError(
                    f"the step was compiled for shared memory along axis {axis!r}, but this "
                    f"communicator runs it on {transport.kind.value}",
                    op="fused collective",
                    hint="compile the step with the communicator that runs it (comm=...)",
                )
            channel = OnePassChannel(transport, group, self.guard)
            self._channels[axis] = channel
        return channel

    def symmetric_tensor(
        self, shape: Sequence[int], dtype: torch.dtype, *, axis: str | None = None
    ) -> torch.Tensor:
        """A tensor for a collective's input along ``axis`` that every peer maps, so the
        collective reads it in place instead of copying it in (as DDP's gradient buckets are
        views into what its all_reduce reads). Collective over the group: every rank calls it
        at the same point, with its own shape: where the shapes differ (a sequence's uneven
        slices) each rank still gets its tensor, and collectives copy it in as any other (a peer
        read in place would be taken at this rank's size). Off shared memory it is an ordinary
        tensor.

        Its content is the caller's: a collective that reads it may return before a peer has
        finished reading it only when the step's own structure guarantees the peer is done
        (shared memory waits for that)."""
        transport, group = self.route(axis)
        if not transport.symmetric_memory:
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)
        return self.guard(
            "symmetric memory",
            f"a {tuple(shape)} {dtype} buffer",
            axis,
            lambda: transport.symmetric_tensor(group, shape, dtype),
        )

    def host_replica(
        self, shape: Sequence[int], dtype: torch.dtype, *, axis: str | None = None
    ) -> HostReplica:
        """One physical copy per host of a Replicated tensor of ``shape`` along ``axis``,
        double-buffered (``coconet.runtime.replica``): a one-pass gather committed into its live
        buffer writes each rank's slice into the spare one and the commit flips them. Collective
        over the group. Needs the group on shared memory (a ``ConfigError`` otherwise)."""
        transport, group = self.route(axis)
        if not transport.symmetric_memory:
            raise ConfigError(
                f"a host replica of {tuple(shape)} {dtype} needs the group along {axis!r} on "
                f"shared memory; it runs on {transport.kind.value}",
                op="host replica",
                details=[f"world {self.world}, rank {self.rank}"],
                hint="it needs the group's ranks on one host, over shared memory: use "
                "per-rank storage otherwise",
            )
        return self.guard(
            "symmetric memory",
            f"a {tuple(shape)} {dtype} host replica",
            axis,
            lambda: transport.host_replica(group, shape, dtype),
        )

    # -- point to point (coconet.runtime.p2p): one message to or from one member --------------

    def p2p(
        self,
        axis: str | None,
        channels: Mapping[tuple[int, int], tuple[int, int]],
        *,
        identity: str,
        op: str = "point-to-point",
        member: str = "rank",
    ) -> PeerLinks:
        """The point-to-point channels of this rank's group along ``axis``: ``channels`` maps each
        (source, destination) pair of group indices that will carry messages to (messages, the
        largest one's bytes) per round (what a shared-memory ring is sized by). Routing decides
        what carries each (``routing.peer_plan``: shared memory between the ranks of one host,
        torch.distributed's pair messages otherwise); the returned ``PeerLinks`` sends and
        receives over them under this communicator's fault guard.

        Collective over the ranks of this rank's host in the group when any channel among them
        runs on shared memory (they map each other's rings, after comparing ``identity`` and
        their channels: every one of them calls it at the same point, with the same
        ``channels``). ``op`` names the caller in errors, ``member`` a member of the group in
        ``Link.why`` (a pipeline's "stage")."""
        if self._deferred is not None:
            self.settle_deferred()
        route = self.route(axis)
        plan = peer_plan(route, channels, self.options, self.device, member)
        return PeerLinks(plan, route.group, self.guard, timeout=self.options.timeout,
                         identity=identity, op=op)  # fmt: skip

    # -- algorithm choice (``AlgorithmChoice``) ------------------------------------------------

    def tuning_key(self, op: Op, cls: str, axis: str | None = None) -> TuningKey:
        """What a choice of ``op``'s algorithm at size class ``cls`` on ``axis``'s group is
        measured for and looked up by."""
        return self.choice.key(op, cls, self.group(axis))

    def measure(self, op: Op, cls: str, axis: str | None = None) -> Choice:
        """Measure every algorithm of ``op`` at size class ``cls`` on ``axis``'s group, choose the
        fastest (the same on every rank), record it in the table and return the ``Choice``.

        Collective: every rank of the world must call it at the same point (generated code does:
        every rank runs the same collectives in the same order)."""
        return self.choice.measure(op, cls, self.group(axis), self.options)

    # -- control messages (``ControlChannel``) ----------------------------------------------

    def agree_max(self, values: Sequence[int], label: str, op: str = "handshake") -> list[int]:
        """Element-wise MAX over the world of a short int vector (the per-step agreement)."""
        return self.control.agree_max(values, label, op)

    def votes_counted(self, label: str) -> None:
        """After a vote (``agree_max``): wait until every peer has counted every rank's vote
        (``ControlChannel.votes_counted``)."""
        self.control.votes_counted(label)

    def max_over_world(self, values: Sequence[float], label: str) -> list[float]:
        """Element-wise MAX over the world of a short float vector (same length everywhere)."""
        return self.control.max_over_world(values, label)

    def exchange(self, obj: Any, label: str) -> list[Any]:
        """Every rank's ``obj`` (any picklable value, of any size), in rank order."""
        return self.control.exchange(obj, label)

    def gather_floats(self, values: Sequence[float], label: str) -> list[list[float]]:
        """Every rank's ``values`` (float64, the same count on every rank), exactly, in rank
        order: one control-channel round (a few microseconds over shared memory), so a caller
        that reduces them in rank order gets the same bits on every rank
        (``ControlChannel.gather_floats``)."""
        return self.control.gather_floats(values, label)

    def barrier(self, label: str = "barrier") -> None:
        self.control.barrier(label)

    def aligned_start(self, label: str) -> None:
        """A barrier whose ranks leave within microseconds of each other where the world shares
        memory (``ControlChannel.aligned_start``): where a timing starts."""
        self.control.aligned_start(label)

    def agree_ready(self, label: str, deadline_s: float) -> None:
        """Wait until every rank has called ``agree_ready`` with the same label (see
        ``ControlChannel.agree_ready``)."""
        self.control.agree_ready(label, deadline_s)

    def abort(self, reason: str) -> None:
        """Mark the communicator broken and tell every peer at once (``ControlChannel.abort``)."""
        self.control.abort(reason)

    def depart(self) -> None:
        """This rank leaves the job (``coconet.runtime.shutdown``, spawn's end, interpreter
        exit): a peer still waiting for it fails at once, told the calls this rank made
        (``progress``), here and on every sub-communicator (``ControlChannel.depart``)."""
        if self.world == 1 or self.broken is not None:
            return
        for sub in self._subs.values():
            sub.depart()
        made = ", ".join(f"{n} x {what}" for what, n in self.progress.items()) or "no calls"
        self.control.depart(f"after {made}")

    def close(self) -> None:
        """Hand back this communicator's shared memory (every group's segments): when it is
        broken, or no longer used (a new one replaces it). Further calls are refused. The
        torch.distributed groups stay: they belong to the job (``coconet.runtime.shutdown``)."""
        if self.broken is None:
            self.broken = "closed"
        for sub in self._subs.values():
            sub.close()
        for route in self.routes.values():
            route.transport.close(route.group)
        self.control.close()

    def __repr__(self) -> str:
        state = f", broken: {self.broken}" if self.broken else ""
        where = "" if self._parent is None else f", the job's ranks {list(self.members)}"
        return f"Communicator(rank {self.rank} of {self.mesh}{where}, {self.backend}{state})"


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
