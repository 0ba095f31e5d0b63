"""The torch.distributed transport: collectives over process groups (gloo on CPU, NCCL on GPU).

Each method runs one communication op over a ``Group`` with the algorithm the communicator
chose (``coconet.runtime.algorithms`` implements them, registered per (op, algorithm) below) and
returns a ``Pending``. It brings tensors into the form the algorithms take (the collective's dim
first, contiguous) and back; it raises whatever torch.distributed raises: the communicator turns
that into a ``RuntimeFault``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from coconet.ir.ops import Op, ReduceOp
from coconet.ir.opspec import Arg, CurveBytes, spec
from coconet.ir.types import slice_bounds
from coconet.options import Algorithm, TransportKind
from coconet.runtime import algorithms as algos
from coconet.runtime.transport import (
    Group,
    Pending,
    Transport,
    WholeWait,
    into,
    ready,
)

__all__ = ["ALGORITHMS", "TorchDistributedTransport"]

A = Algorithm
# The algorithms of each tuned op, by enum (the communicator measures them per size class).
ALGORITHMS: dict[Op, dict[Algorithm, Callable[..., Pending]]] = {
    Op.ALL_REDUCE: {A.NATIVE: algos.ar_native, A.ALL_TO_ALL: algos.ar_all_to_all},
    Op.REDUCE_SCATTER: {
        A.NATIVE: algos.rs_native,
        A.ALL_REDUCE: algos.rs_all_reduce,
        A.ALL_TO_ALL: algos.rs_all_to_all,
    },
    Op.ALL_GATHER: {
        A.NATIVE: algos.ag_native,
        A.ALL_REDUCE: algos.ag_all_reduce,
        A.ALL_TO_ALL: algos.ag_all_to_all,
    },
    Op.REDUCE: {A.NATIVE: algos.rd_native, A.ALL_TO_ALL: algos.rd_all_to_all},
}


_SIXTEEN = (torch.float16, torch.bfloat16)


def _reducing(x: torch.Tensor, group: Group, reduce_op: ReduceOp,
              algorithm: Algorithm | None) -> Algorithm:  # fmt: skip
    """The algorithm a reduction runs: ``algorithm`` (None: gloo's own), except a 16-bit sum
    or product over more than 2 ranks, which runs the all_to_all form: gloo reduces 16-bit
    values in 16 bits, a running sum rounded at every rank, where coconet's reductions
    accumulate in float32 in rank order and round once (``semantics.reduce_values``). With 2
    ranks there is one addition, rounded once either way; max and min round nothing."""
    exact = reduce_op in (ReduceOp.SUM, ReduceOp.PROD) and group.size > 2
    if exact and x.dtype in _SIXTEEN:
        return Algorithm.ALL_TO_ALL
    return algorithm or Algorithm.NATIVE


def _parts(total: int, n: int) -> list[int]:
    return [hi - lo for lo, hi in (slice_bounds(total, n, i) for i in range(n))]


def _flat(x: torch.Tensor, donate: bool, n: int):
    """x as a flat contiguous tensor, whether we may overwrite it, and its n parts' sizes."""
    x0 = x.reshape(-1)
    owned = donate or x0.data_ptr() != x.data_ptr()
    if not x0.is_contiguous():
        x0, owned = x0.contiguous(), True
    return x0, owned, _parts(x0.numel(), n)


class TorchDistributedTransport(Transport):
    """Collectives over torch.distributed process groups (the default group must exist): the
    one transport with several algorithms per op (``TunableTransport``)."""

    kind = TransportKind.TORCH_DISTRIBUTED

    def algorithms(self, op: Op) -> tuple[Algorithm, ...]:
        return tuple(ALGORITHMS.get(op, {}))

    def exact_algorithm(self, op: Op) -> Algorithm | None:
        return Algorithm.ALL_TO_ALL if Algorithm.ALL_TO_ALL in ALGORITHMS.get(op, {}) else None

    def new_group(self, ranks: Sequence[int], world: int):
        """The process group of ``ranks`` (every rank must create every group, in order)."""
        return dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks))

    # -- the communication ops (``Transport``; ``algorithm`` None: the library's own) ----------

    def all_reduce(
        self,
        x,
        group: Group,
        *,
        reduce_op: ReduceOp,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending:
        if group.size == 1:
            return ready(x if donate else x.clone())
        x0, owned, parts = _flat(x, donate, group.size)
        p = ALGORITHMS[Op.ALL_REDUCE][_reducing(x, group, reduce_op, algorithm)](
            x0, reduce_op, group.handle, parts, group.index, owned
        )
        return Pending(p.works, lambda: p.finish().view(x.shape))

    def reduce_scatter(
        self,
        x,
        group: Group,
        *,
        reduce_op: ReduceOp,
        dim: int,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending:
        if group.size == 1:
            return ready(x if donate else x.clone())
        parts = _parts(x.shape[dim], group.size)
        x0 = x.movedim(dim, 0).contiguous()
        owned = donate or x0.data_ptr() != x.data_ptr()
        fn = ALGORITHMS[Op.REDUCE_SCATTER][_reducing(x, group, reduce_op, algorithm)]
        p = fn(x0, reduce_op, group.handle, parts, group.index, owned)
        return Pending(p.works, lambda: p.finish().movedim(0, dim))

    def all_gather(
        self,
        x,
        group: Group,
        *,
        dim: int,
        parts: Sequence[int],
        algorithm: Algorithm | None = None,
        out: torch.Tensor | None = None,
    ) -> Pending:
        if group.size == 1:
            return ready(into(x, out))
        x0 = x.movedim(dim, 0).contiguous()
        fn = ALGORITHMS[Op.ALL_GATHER][algorithm or Algorithm.NATIVE]
        p = fn(x0, group.handle, list(parts), group.index)
        return Pending(p.works, lambda: into(p.finish().movedim(0, dim), out))

    def broadcast(self, x, group: Group, *, root: int, donate: bool) -> Pending:
        if group.size == 1:
            return ready(x)
        src = group.ranks[root]
        if group.index == root:
            buf = x.contiguous()  # the root's value is only read
        else:
            fmt = torch.contiguous_format
            buf = x.contiguous() if donate else torch.empty_like(x, memory_format=fmt)
        w = dist.broadcast(buf, src=src, group=group.handle, async_op=True)
        return Pending([w], lambda: buf)

    def reduce(
        self,
        x,
        group: Group,
        *,
        reduce_op: ReduceOp,
        root: int,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending:
        """The group's ``root``-th rank gets the reduction; the others get zeros (the program's
        meaning; gloo itself leaves them undefined)."""
        if group.size == 1:
            return ready(x if donate else x.clone())
        x0, owned, parts = _flat(x, donate, group.size)
        fn = ALGORITHMS[Op.REDUCE][_reducing(x, group, reduce_op, algorithm)]
        p = fn(x0, reduce_op, group.handle, parts, group.index, owned, root)
        return Pending(p.works, lambda: p.finish().view(x.shape))

    def send(self, x, group: Group, reverse: bool = False) -> Pending:
        """Rank i of the group receives rank i-1's ``x``; the first rank gets zeros.
        ``reverse``: rank i receives rank i+1's, the last gets zeros."""
        works = []
        src = x.contiguous()
        i = group.index
        step = -1 if reverse else 1
        to, frm = i + step, i - step
        if 0 <= to < group.size:
            works.append(WholeWait(dist.isend(src, dst=group.ranks[to])))
        if 0 <= frm < group.size:
            buf = torch.empty_like(src)
            works.append(WholeWait(dist.irecv(buf, src=group.ranks[frm])))
        else:
            buf = torch.zeros_like(src)
        return Pending(works, lambda: buf)

    # -- point to point: one message to or from one member (``coconet.runtime.p2p.PeerLinks``) --

    def send_to(self, x, group: Group, peer: int) -> Pending:
        """Send contiguous ``x`` to the group's ``peer``-th member over the job's default process
        group: gloo's and NCCL's untagged pair channel (FIFO per pair of ranks, what
        ``coconet.pipeline.check`` proves schedules against)."""
        return Pending([WholeWait(dist.isend(x, dst=group.ranks[peer]))], lambda: x)

    def recv_from(self, out, group: Group, peer: int) -> Pending:
        """Receive the next message from the group's ``peer``-th member into contiguous ``out``
        (``send_to``'s channel)."""
        return Pending([WholeWait(dist.irecv(out, src=group.ranks[peer]))], lambda: out)

    # -- measuring the algorithms of one op ------------------------------------------------------

    def run_for_measurement(
        self, op: Op, algorithm: Algorithm, group: Group, numel: int, device
    ) -> None:
        """One run of ``op`` with ``algorithm`` on ``numel`` float32 elements (a timing probe)."""
        n = group.size
        parts = [numel // n] * n
        form = spec(op)
        if form.comm_cost.curve_bytes is CurveBytes.OUTPUT:  # a gather: its input is a slice
            part = torch.ones(numel // n, device=device)
            p = ALGORITHMS[op][algorithm](part, group.handle, parts, group.index)
        else:
            full = torch.ones(numel, device=device)
            extra = (0,) if Arg.ROOT in form.arguments else ()  # the first rank as the root
            fn = ALGORITHMS[op][algorithm]
            p = fn(full, ReduceOp.SUM, group.handle, parts, group.index, False, *extra)
        p.wait()
