"""The transport seam: what runs a collective over a group of ranks.

A ``Transport`` starts each communication op of a program (``coconet.ir.opspec`` names the op's
transport operation and arguments) over a ``Group`` and returns a ``Pending``: the work in flight
and how to finish it. It does nothing else: the ``Communicator`` beside it builds the groups,
chooses algorithms, enforces deadlines, translates failures into ``RuntimeFault`` and carries the
control messages (handshake, commit vote). Today's transport is torch.distributed
(``coconet.runtime.torchdist``: gloo on CPU, NCCL on GPU); an intra-node shared-memory transport
goes behind the same protocol.

A transport implements, for each communication op it supports, one method named by the op's
spec (``transport`` + ``"_start"`` is what generated code calls on the communicator)::

    all_reduce(x, group, *, reduce_op, algorithm, donate) -> Pending
    reduce_scatter(x, group, *, reduce_op, dim, algorithm, donate) -> Pending
    all_gather(x, group, *, dim, parts, algorithm) -> Pending
    broadcast(x, group, *, root, donate) -> Pending
    reduce(x, group, *, reduce_op, root, algorithm, donate) -> Pending
    send(x, group) -> Pending

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

from coconet.ir.ops import Op
from coconet.options import Algorithm, AlgorithmPolicy, TransportKind, TransportPolicy

__all__ = [
    "Algorithm",
    "AlgorithmPolicy",
    "Group",
    "Pending",
    "Published",
    "Transport",
    "TransportKind",
    "TransportPolicy",
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
    pass of its own. ``release`` tells the peers this rank is done reading."""

    def __init__(
        self,
        pieces: list[torch.Tensor],
        release: Callable[[], None],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        self.pieces, self._release = pieces, release  # row blocks, in order, along dim 0
        self.shape, self.dtype = shape, dtype

    def copy_into(self, target: torch.Tensor) -> None:
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


def ready(value: torch.Tensor) -> Pending:
    """A collective that needed no communication (a group of one)."""
    return Pending([], lambda: value)


class Transport(Protocol):
    """Runs communication ops over groups of ranks (see the module docstring)."""

    kind: TransportKind

    def algorithms(self, op: Op) -> tuple[Algorithm, ...]:
        """The algorithms this transport has for ``op`` (empty: it has just one way)."""
        ...

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
