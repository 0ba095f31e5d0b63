"""The hierarchical transport: a group that spans hosts, shared memory inside each host and
torch.distributed (gloo) between them.

A group whose ranks span ``H`` hosts with ``L`` of its ranks on each (homogeneous hosts, the
usual torchrun layout) runs its reductions and gathers in two levels, as Horovod's hierarchical
all_reduce does, so that only what must cross a host's link crosses it (with ``L = 1`` the
inside level is nothing, and the exchange alone replaces gloo's reduce_scatter and all_gather,
which run well below the link's rate):

- ``all_reduce``: reduce_scatter inside the host over shared memory (each local rank reduces
  one slice of its host's ranks), a reduce_scatter and an all_gather of that slice across hosts
  among the ranks with the same local index (``L`` exchanges in parallel, each ``1/L`` of the
  tensor, point to point in pipelined chunks: ``exchange``), all_gather inside the host. Each
  host sends ``(H - 1) / H`` of the tensor twice, where a flat ring over all ``H x L`` ranks
  sends ``(H L - 1) / (H L)`` of it twice through the same link (1.5x more at 2 x 2) and moves
  the intra-host half over sockets too.
- ``reduce_scatter``: the member at position ``p`` of the group ends with block ``p`` of the
  flat split (``torch.tensor_split`` bounds over all ``H x L`` members), exactly as the flat
  reduce_scatter, so slices, ``sharded_state_dict`` offsets and checkpoints do not depend on
  the transport. Inside the host, the rank with local index ``l`` reduces the blocks its
  counterparts (local index ``l`` on every host) own, then they exchange those blocks across
  hosts (an all_to_all: each block goes to its owner) and each sums what it received.
- ``all_gather``: the reverse: the blocks of the ranks with one local index gathered across
  hosts, then every host's ranks gather each other's blocks over shared memory.

Summation order (stated, not assumed): a result is the sum **over hosts, in host order, of each
host's sum in local rank order** (hosts ordered by their first member in the group), the same
bits on every rank (each block is reduced once, by its owner, then copied). That is not the
simulator's rank order ``((x0 + x1) + x2) + x3`` when a host holds 2+ ranks of 3+: equal within
rounding (``coconet.sim.exactness``). So ``CommOptions(algorithms="exact")`` never runs here:
routing keeps such a group flat on torch.distributed's rank-ordered forms, and a communicator
whose policy is switched to exact afterwards runs the group's collectives flat too
(``Communicator._start``). ``reduce_order`` computes the order, for tests and users.

The rooted and point-to-point ops (broadcast, reduce, send) run flat on the group's
torch.distributed process group: they move one tensor between two places, which a second
level would not shorten. Hosts that are not homogeneous (a different number of the group's
ranks on each) keep the group flat: the leader-per-host fallback is not built.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from coconet.ir.ops import ReduceOp
from coconet.ir.semantics import reduce_values
from coconet.ir.types import slice_bounds
from coconet.options import Algorithm, TransportKind
from coconet.runtime import algorithms as algos
from coconet.runtime.shmem import SharedMemoryTransport, ShmGroup
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import Group, Pending, WholeWait, ready, wait_work

__all__ = ["HierGroup", "HierarchicalTransport", "HostLayout", "reduce_order"]


@dataclass(frozen=True)
class HostLayout:
    """Where the members of a group live: position ``p`` of the group is on host
    ``host_of[p]`` (hosts numbered by their first member, in group order) with local index
    ``local_of[p]`` (its place among its host's members, in group order)."""

    host_of: tuple[int, ...]
    local_of: tuple[int, ...]

    @property
    def hosts(self) -> int:
        return max(self.host_of) + 1

    @property
    def per_host(self) -> int:
        return max(self.local_of) + 1

    def position(self, host: int, local: int) -> int:
        """The group position of the member at ``(host, local)``."""
        for p, (h, l) in enumerate(zip(self.host_of, self.local_of, strict=True)):
            if h == host and l == local:
                return p
        raise KeyError((host, local))

    def counterparts(self, local: int) -> list[int]:
        """The positions with local index ``local``, one per host, in host order."""
        return [self.position(h, local) for h in range(self.hosts)]

    def members(self, host: int) -> list[int]:
        """The positions on ``host``, in local order."""
        return [self.position(host, l) for l in range(self.per_host)]

    @classmethod
    def of(cls, identities: Sequence[object]) -> HostLayout:
        """The layout of a group whose member at position ``p`` runs on host ``identities[p]``."""
        order: dict[object, int] = {}
        count: dict[object, int] = {}
        host_of, local_of = [], []
        for ident in identities:
            host_of.append(order.setdefault(ident, len(order)))
            local_of.append(count.get(ident, 0))
            count[ident] = local_of[-1] + 1
        return cls(tuple(host_of), tuple(local_of))

    @property
    def homogeneous(self) -> bool:
        """Every host holds the same number of the group's members."""
        counts = [self.host_of.count(h) for h in range(self.hosts)]
        return len(set(counts)) == 1

    @property
    def worthwhile(self) -> bool:
        """Two levels pay: 2+ hosts, the same number of members on each. One member per host
        too: there the inside level is nothing and the exchange across hosts alone replaces
        gloo's reduce_scatter and all_gather, which on a link run well below its rate."""
        return self.hosts >= 2 and self.homogeneous


def reduce_order(op: ReduceOp, values: Sequence[torch.Tensor], layout: HostLayout) -> torch.Tensor:
    """What the hierarchical transport computes from the members' ``values`` (by group
    position): each host's values reduced in local order, then those reduced in host order (as
    the simulator's ``reduce_values`` reduces one level)."""
    per_host = [reduce_values(op, [values[p] for p in layout.members(h)])
                for h in range(layout.hosts)]  # fmt: skip
    return reduce_values(op, per_host)


@dataclass
class HierGroup:
    """The hierarchical state of one group (``Group.handle``): its layout, this rank's host
    group over shared memory, its counterparts on the other hosts over torch.distributed, and
    the flat group (torch.distributed) for the rooted and point-to-point ops."""

    layout: HostLayout
    local: Group  # this rank's host's members, handle a ShmGroup (None: this rank alone)
    cross: Group  # the members with this rank's local index (point to point: no handle)
    flat: Group  # the whole group over torch.distributed

    def close(self) -> None:
        shm: ShmGroup | None = self.local.handle  # None: a host of one has no inside level
        if shm is not None:
            shm.close()


def _bounds(total: int, n: int) -> list[tuple[int, int]]:
    return [slice_bounds(total, n, p) for p in range(n)]


# The exchange across hosts moves each message in chunks of this many bytes, WINDOW of them in
# flight. Measured on namespace hosts over a 1 Gbit/s tbf link (2 x 1 rank, 16 MiB each way at
# once): one message each way 265 ms, gloo's all_to_all 261 ms (the two directions share the
# rate: each flow's acknowledgements queue behind the other's data), 64 chunks of 256 KiB with 2
# in flight 140 ms: the line rate both ways (134 ms), as gloo's pipelined ring all_reduce gets.
CHUNK_BYTES = 1 << 18
WINDOW = 2


def exchange(
    sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], ranks: Sequence[int], index: int
) -> None:
    """Send ``sends[j]`` to member ``j`` of ``ranks`` (the job's global ranks) and receive
    member ``j``'s into ``recvs[j]`` (contiguous; sizes agreed: what ``j`` sends this member is
    ``recvs[j]``'s size), for every ``j`` but ``index`` (this member): in rounds (round ``i``:
    to ``index + i``, from ``index - i``, both at once), each message in ``CHUNK_BYTES`` chunks
    with ``WINDOW`` in flight (see ``CHUNK_BYTES``)."""
    n = len(ranks)
    for step in range(1, n):
        to, frm = (index + step) % n, (index - step) % n
        out, into = sends[to].reshape(-1), recvs[frm].reshape(-1)
        chunk = max(1, CHUNK_BYTES // max(out.element_size(), 1))
        count = max(-(-out.numel() // chunk), -(-into.numel() // chunk))
        flight: deque[list] = deque()
        for c in range(count):
            lo = c * chunk
            ops = []
            if lo < out.numel():
                ops.append(dist.P2POp(dist.isend, out[lo : lo + chunk], ranks[to]))
            if lo < into.numel():
                ops.append(dist.P2POp(dist.irecv, into[lo : lo + chunk], ranks[frm]))
            flight.append(dist.batch_isend_irecv(ops))
            while len(flight) > WINDOW:
                _finish(flight.popleft())
        while flight:
            _finish(flight.popleft())


def _finish(works: list) -> None:
    # point-to-point handles are waited for whole (``WholeWait``: gloo closes a pair whose
    # wait times out mid-transfer)
    for w in works:
        wait_work(WholeWait(w))


def _in_order(rows: Sequence[tuple[int, int]], total: int) -> bool:
    """Whether the ranges tile ``[0, total)`` in order (side by side they are the whole)."""
    at = 0
    for a, b in rows:
        if a != at:
            return False
        at = b
    return at == total


class HierarchicalTransport:
    """Collectives of groups that span homogeneous hosts, in two levels (module docstring).
    Its work is done when a collective starts, as shared memory's: on a CPU the copying and
    the socket transfers take the cores there would be to overlap them with."""

    kind = TransportKind.HIERARCHICAL

    def __init__(self, shm: SharedMemoryTransport, flat: TorchDistributedTransport) -> None:
        self.shm, self.flat = shm, flat

    def all_reduce(
        self,
        x,
        group: Group,
        *,
        reduce_op: ReduceOp,
        donate: bool,
        algorithm: Algorithm | None = None,
    ) -> Pending:
        h: HierGroup = group.handle
        flat = x.reshape(-1)
        L, H = h.local.size, h.cross.size
        # inside the host: this rank reduces one of L slices of its host's sum
        mine = flat.contiguous()
        if L > 1:
            mine = self.shm.reduce_scatter(flat, h.local, reduce_op=reduce_op, dim=0,
                                           donate=False).wait()  # fmt: skip
            mine = mine.contiguous()  # (shared memory's work is done when it returns)
        # across hosts: each of H blocks of that slice to its owner, which reduces every host's
        # in host order, then the reduced blocks back to every counterpart
        blocks = _bounds(mine.shape[0], H)
        reduced = self._across_reduce(mine, blocks, reduce_op, h)
        whole = self._across_gather(reduced, [b - a for a, b in blocks], h)
        if L > 1:  # inside the host: every local rank's slice
            slices = [b - a for a, b in _bounds(flat.numel(), L)]
            whole = self.shm.all_gather(whole, h.local, dim=0, parts=slices).wait()
        return ready(whole.view(x.shape))

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
        h: HierGroup = group.handle
        x0 = x.movedim(dim, 0).contiguous()
        blocks = _bounds(x0.shape[0], group.size)
        ours = [blocks[p] for p in h.layout.counterparts(h.local.index)]  # by host
        # inside the host: the blocks this local index owns on every host, summed over this
        # host's ranks (side by side, in host order)
        host_sums = self._inside_reduce(x0, ours, reduce_op, h)
        at = algos.offsets([b - a for a, b in ours])
        local = [(o, o + b - a) for o, (a, b) in zip(at, ours, strict=True)]
        return ready(self._across_reduce(host_sums, local, reduce_op, h).movedim(0, dim))

    def all_gather(
        self,
        x,
        group: Group,
        *,
        dim: int,
        parts: Sequence[int],
        algorithm: Algorithm | None = None,
    ) -> Pending:
        h: HierGroup = group.handle
        x0 = x.movedim(dim, 0).contiguous()
        layout = h.layout
        starts = algos.offsets(parts)
        # across hosts: the blocks of this local index's members, side by side in host order
        mine = self._across_gather(x0, [parts[p] for p in layout.counterparts(h.local.index)], h)
        # inside the host: each local rank's blocks to their places in the whole
        rows = [
            [(starts[p], starts[p] + parts[p]) for p in layout.counterparts(local)]
            for local in range(h.local.size)
        ]
        return ready(self._inside_gather(mine, rows, h).movedim(0, dim))

    def _inside_reduce(
        self, x0: torch.Tensor, rows: Sequence[tuple[int, int]], op: ReduceOp, h: HierGroup
    ) -> torch.Tensor:
        """The row ranges ``rows`` of ``x0``, side by side, summed over this host's ranks (a
        host of one: the ranges themselves)."""
        if h.local.size > 1:
            return self.shm.reduce_rows(x0, h.local, reduce_op=op, rows=rows)
        if _in_order(rows, x0.shape[0]):
            return x0
        return torch.cat([x0[a:b] for a, b in rows])

    def _inside_gather(
        self, mine: torch.Tensor, rows: Sequence[Sequence[tuple[int, int]]], h: HierGroup
    ) -> torch.Tensor:
        """The whole of which each local rank's ``mine`` fills its ``rows`` (a host of one: its
        own pieces put in place)."""
        if h.local.size > 1:
            return self.shm.gather_rows(mine.contiguous(), h.local, rows=rows)
        (ranges,) = rows
        total = max((b for _, b in ranges), default=0)
        if _in_order(ranges, total):
            return mine
        out = mine.new_empty((total, *mine.shape[1:]))
        at = 0
        for a, b in ranges:
            out[a:b].copy_(mine[at : at + b - a])
            at += b - a
        return out

    @staticmethod
    def _across_reduce(
        x0: torch.Tensor, blocks: Sequence[tuple[int, int]], op: ReduceOp, h: HierGroup
    ) -> torch.Tensor:
        """Block ``blocks[k]`` of ``x0`` (rows) reduced over the counterparts, at counterpart
        ``k``: this one gets its own block (``blocks[h.cross.index]``), every host's copy of it
        reduced in host order."""
        me = h.cross.index
        lo, hi = blocks[me]
        sends = [x0[a:b] for a, b in blocks]
        recvs = [x0.new_empty((hi - lo, *x0.shape[1:])) for _ in blocks]
        recvs[me] = x0[lo:hi]
        exchange(sends, recvs, h.cross.ranks, me)
        return reduce_values(op, recvs)

    @staticmethod
    def _across_gather(x0: torch.Tensor, rows: Sequence[int], h: HierGroup) -> torch.Tensor:
        """Every counterpart's ``x0`` (counterpart ``k``'s has ``rows[k]`` rows), side by side in
        host order."""
        me = h.cross.index
        out = x0.new_empty((sum(rows), *x0.shape[1:]))
        at = algos.offsets(rows)
        recvs = [out[a : a + r] for a, r in zip(at, rows, strict=True)]
        recvs[me].copy_(x0)
        exchange([x0] * len(rows), recvs, h.cross.ranks, me)
        return out

    # -- one tensor between two places: the flat group ----------------------------------------

    def broadcast(self, x, group: Group, *, root: int, donate: bool) -> Pending:
        return self.flat.broadcast(x, group.handle.flat, root=root, donate=donate)

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
        return self.flat.reduce(
            x, group.handle.flat, reduce_op=reduce_op, root=root, donate=donate,
            algorithm=Algorithm.NATIVE,
        )

    def send(self, x, group: Group, reverse: bool = False) -> Pending:
        return self.flat.send(x, group.handle.flat, reverse)
