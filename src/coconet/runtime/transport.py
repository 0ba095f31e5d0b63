"""The transport seam: what runs a collective over a group of ranks.

A ``Transport`` runs each communication op of a program over a ``Group`` and returns a
``Pending``: the work in flight and how to finish it. It does nothing else: the ``Communicator``
beside it routes each group to its transport, chooses algorithms, enforces deadlines, translates
failures into ``RuntimeFault`` and carries the control messages (handshake, commit vote). Two
transports exist: torch.distributed (``coconet.runtime.torchdist``: gloo on CPU, NCCL on GPU,
across hosts) and shared memory among the ranks of one host (``coconet.runtime.shmem``).

Every transport implements ``Transport``: one method per communication op, with one signature
(the communicator calls them by name, typed; the op spec's ``transport`` names them), and what
it can do beside them, which the communicator asks of a group's transport instead of naming its
class: the algorithms it has for an op, where its groups run when sums must be in rank order,
whether it runs forms of its own (shared memory's one pass, reached through
``coconet.runtime.channels``), memory every peer maps, the groups a peer's abort must end, and
what a group holds to hand back. ``Transport``'s own bodies are the defaults (it cannot: a
transport subclasses it and overrides what it can). What only torch.distributed has — the
measurement of its algorithms, process groups — is the second protocol, ``TunableTransport``.

Results must equal the op's group meaning (``coconet.ir.semantics.COLLECTIVES``): bitwise with
an ``exact`` algorithm (reductions in rank order), within rounding otherwise.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from coconet.ir.ops import Op, ReduceOp
from coconet.options import Algorithm, AlgorithmPolicy, TransportKind, TransportPolicy
from coconet.runtime.replica import HostReplica

__all__ = [
    "Algorithm",
    "AlgorithmPolicy",
    "Group",
    "Pending",
    "Published",
    "Transport",
    "TransportKind",
    "TransportPolicy",
    "TunableTransport",
    "WholeWait",
]


@dataclass(frozen=True)
class Group:
    """This rank's group along one mesh axis: its ranks in axis order and this rank's place."""

    axis: str | None
    ranks: tuple[int, ...]
    index: int  # this rank's position in ``ranks``
    handle: Any = None  # the transport's own group object (a torch ProcessGroup)

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class Pending:
    """A collective in flight: its work handles and what builds the result when they are done."""

    works: list = field(default_factory=list)
    finish: Callable[[], torch.Tensor] = lambda: torch.empty(0)

    def wait(self, waiter: Callable[[Any], None] | None = None) -> torch.Tensor:
        """The result. ``waiter(work)`` waits for each torch work handle, those of a second
        phase that ``finish`` starts included (default: ``work.wait()``); the communicator's
        waits in slices, looking between them whether a peer aborted."""
        previous = getattr(_WAITER, "fn", None)
        _WAITER.fn = waiter
        try:
            for w in self.works:
                wait_work(w)
            return self.finish()
        finally:
            _WAITER.fn = previous


@dataclass(frozen=True)
class WholeWait:
    """A torch work handle that must be waited for in one call, never in slices.

    gloo fails the connection of a point-to-point send or recv whose ``wait(timeout)`` ends
    before the transfer does ("Application timeout caused pair closure": the peer then sees
    "connection closed"), and such a handle's ``is_completed()`` never turns true, so it cannot
    be polled either. Collectives' handles are futures: a slice that ends leaves them running."""

    work: Any

    def wait(self, timeout: datetime.timedelta | None = None) -> Any:
        return self.work.wait() if timeout is None else self.work.wait(timeout)


def into(whole: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A gather's result ``whole`` in ``out`` (copied, unless it was written there already),
    or ``whole`` when no ``out`` was given (``Communicator.all_gather_start(out=)``)."""
    if out is None:
        return whole
    if whole.data_ptr() != out.data_ptr():
        out.copy_(whole)
    return out


# The waiter of the Pending being waited for on this thread (see Pending.wait).
_WAITER = threading.local()


def wait_work(work: Any) -> None:
    """Wait for a torch work handle the way the current ``Pending.wait`` asks."""
    waiter = getattr(_WAITER, "fn", None)
    if waiter is None:
        work.wait()
    else:
        waiter(work)


class Published:
    """A gathered result that stays where the peers published it until the step commits: the
    commit copies it straight into the caller's tensor (``copy_into``), so the gather costs no
    pass of its own. ``release`` tells the peers this rank is done reading.

    With ``replica`` (a ``HostReplica`` whose spare buffer the pieces are), the commit into the
    replica's live buffer copies nothing: it flips the replica (every rank of the host wrote its
    slice of the spare buffer) and re-points the caller's tensor at it."""

    def __init__(
        self,
        pieces: list[torch.Tensor],
        release: Callable[[], None],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        replica: HostReplica | None = None,
    ) -> None:
        self.pieces, self._release = pieces, release  # row blocks, in order, along dim 0
        self.shape, self.dtype, self.replica = shape, dtype, replica
        self._flipped = False

    def copy_into(self, target: torch.Tensor) -> None:
        if self.replica is not None and (self._flipped or self.replica.holds(target)):
            # repeatable (the commit writes again after an interruption): flip exactly once,
            # then point the target at the live buffer
            if not self._flipped:
                self.replica.flip()
                self._flipped = True
            target.set_(self.replica.live())
            self.release()
            return
        start = 0
        for piece in self.pieces:
            target[start : start + piece.shape[0]].copy_(piece)
            start += piece.shape[0]
        self.release()

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class ReadyPending(Pending):
    """A collective whose result is already there (``value``): waiting for it is returning it."""

    def __init__(self, value: torch.Tensor) -> None:
        self.works, self.value = [], value

    def finish(self) -> torch.Tensor:
        return self.value

    def wait(self, waiter: Callable[[Any], None] | None = None) -> torch.Tensor:
        return self.value


def ready(value: torch.Tensor) -> Pending:
    """A collective that needed no communication (a group of one), or whose work is done when it
    starts (shared memory's: the copying is the work)."""
    return ReadyPending(value)


class Transport(Protocol):
    """Runs communication ops over groups of ranks (see the module docstring). ``algorithm``:
    the communicator's choice where the transport has several (``algorithms``), else None (the
    transport's one way).

    The methods after the ops say what the transport can do beside them; their bodies here
    are the defaults, for a transport that cannot (it subclasses ``Transport`` to take them)."""

    kind: TransportKind
    # runs forms of its own (``coconet.codegen.forms``: a fused collective as one pass, an
    # all_reduce read in place), which generated code reaches through the group's
    # ``coconet.runtime.channels.OnePassChannel`` (``Communicator.one_pass``)
    one_pass: bool = False
    # maps memory every peer of a group reads in place (``symmetric_tensor``, ``host_replica``)
    symmetric_memory: bool = False

    def all_reduce(
        self,
        x: torch.Tensor,
        group: Group,
        *,
        reduce_op: ReduceOp,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending: ...

    def reduce_scatter(
        self,
        x: torch.Tensor,
        group: Group,
        *,
        reduce_op: ReduceOp,
        dim: int,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending: ...

    def all_gather(
        self,
        x: torch.Tensor,
        group: Group,
        *,
        dim: int,
        parts: Sequence[int],
        algorithm: Algorithm | None = None,
        out: torch.Tensor | None = None,
    ) -> Pending: ...

    def broadcast(self, x: torch.Tensor, group: Group, *, root: int, donate: bool) -> Pending: ...

    def reduce(
        self,
        x: torch.Tensor,
        group: Group,
        *,
        reduce_op: ReduceOp,
        root: int,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending: ...

    def send(self, x: torch.Tensor, group: Group, reverse: bool = False) -> Pending:
        """Rank i of the group receives rank i-1's ``x``; the first rank gets zeros.
        ``reverse``: rank i receives rank i+1's, the last gets zeros (a gradient sent back)."""
        ...

    # -- what the transport can do beside the ops (the defaults: it cannot) ----------------------

    def algorithms(self, op: Op) -> tuple[Algorithm, ...]:
        """The algorithms this transport has for ``op``, which the communicator chooses among
        (``coconet.runtime.tuning.AlgorithmChoice``); empty: it has one way only."""
        return ()

    def rank_ordered(self, group: Group) -> tuple[Transport, Group]:
        """Where ``group``'s collectives run when their sums must be in rank order
        (``CommOptions(algorithms="exact")`` set after routing): this transport and ``group``
        where it reduces so, or the group's flat form on another (the hierarchical transport's
        sums are over hosts)."""
        return self, group

    def symmetric_tensor(self, group: Group, shape: Sequence[int], dtype: torch.dtype
                         ) -> torch.Tensor:  # fmt: skip
        """A tensor every peer of ``group`` maps, which a collective reads in place (collective
        over the group). Only where ``symmetric_memory``: elsewhere an ordinary tensor serves."""
        raise NotImplementedError(f"the {self.kind.value} transport maps no memory")

    def host_replica(self, group: Group, shape: Sequence[int], dtype: torch.dtype
                     ) -> HostReplica:  # fmt: skip
        """One physical copy per host of a replicated tensor (``coconet.runtime.replica``;
        collective over the group). Only where ``symmetric_memory``."""
        raise NotImplementedError(f"the {self.kind.value} transport maps no memory")

    def signal_groups(self, group: Group) -> list[Group]:
        """The groups of shared memory ``group`` holds whose waits a peer's abort word ends
        (``ControlChannel.abort``): a rank that fails sets its word in each."""
        return []

    def close(self, group: Group) -> None:
        """Hand back what ``group`` holds of this transport (its shared memory); the
        torch.distributed process groups stay, they belong to the job."""


class TunableTransport(Transport, Protocol):
    """A transport whose several algorithms per op (``algorithms``) the communicator measures
    and chooses among, with groups of its own (torch.distributed)."""

    def exact_algorithm(self, op: Op) -> Algorithm | None:
        """The algorithm that reduces in rank order (bitwise the simulator's), if any."""
        ...

    def new_group(self, ranks: Sequence[int], world: int) -> Any:
        """The transport's object for the group of ``ranks`` (``Group.handle``). Collective: every
        rank creates every group of the mesh, in the same order."""
        ...

    def run_for_measurement(
        self, op: Op, algorithm: Algorithm, group: Group, numel: int, device: torch.device
    ) -> None:
        """Run ``op`` once with ``algorithm`` on ``numel`` elements: what algorithm choice times."""
        ...
