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

A group over hosts that hold different numbers of its ranks (host A 2, host B 1: a torchrun job
whose nodes run different ``--nproc-per-node``) has no local index every host shares; it goes
**through one leader per host** (``CrossHost.THROUGH_LEADERS``; each host's leader is its first
member in group order, ``HostLayout.leaders``):

- ``all_reduce``: the host's sum to its leader over shared memory (the leader reduces its
  members' inputs in local order), an all_reduce among the leaders (two: gloo's, on their own
  process group; three or more: the same ``exchange`` as above, each leader reducing one block
  of the tensor over every host in host order and sending it back: ``_leaders_across``), then
  the result from the leader to its members over shared memory (a broadcast). Each host's
  link carries ``(H - 1) / H`` of the tensor twice, whatever its rank count, where a flat ring
  over all the ranks carries ``(W - 1) / W`` of it twice (2 + 1 ranks: 4/3 against 1).
- ``reduce_scatter``: the host's sum to its leader, the rows each host's members own (the flat
  split's blocks, as above) from every leader to that host's leader, reduced there in host
  order, then the host's rows to its members, each keeping its own block.
- ``all_gather``: the host's blocks to its leader over shared memory, every leader's to every
  leader, the whole from the leader to its members.

The shared-memory steps inside a host are a small part of the time across a link (a 64 MiB
copy takes a few ms; the link takes hundreds), so they are the simplest ones: the leader alone
reduces (one ``reduce_rows`` call) and a broadcast brings the result back.

Summation order (stated, not assumed): on either plan a result is the sum **over hosts, in host
order, of each host's sum in local rank order** (hosts ordered by their first member in the
group; 16-bit floats accumulated in float32 and rounded once per level), the same bits on every
rank (each element is reduced once, by one owner, then copied). That is not the simulator's
rank order ``((x0 + x1) + x2) + x3`` when a host holds 2+ ranks of 3+ (it is when each host's
ranks follow the previous host's, in 32-bit types: host A 0, 1 and host B 2 adds
``(x0 + x1) + x2``): equal within rounding (``coconet.sim.exactness``). So
``CommOptions(algorithms="exact")`` never runs here: routing keeps such a group flat on
torch.distributed's rank-ordered forms, and a communicator whose policy is switched to exact
afterwards runs the group's collectives flat too (``rank_ordered``). ``reduce_order``
computes the order, for tests and users.

The rooted and point-to-point ops (broadcast, reduce, send) run flat on the group's
torch.distributed process group: they move one tensor between two places, which a second
level would not shorten.

A leader that fails across hosts (another host died) aborts its host's shared-memory group
before it raises, so its members, who wait for it there and not across, fail at once instead of
at their deadline.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from coconet.errors import RuntimeFault
from coconet.ir.ops import ReduceOp
from coconet.ir.semantics import reduce_values
from coconet.ir.types import slice_bounds
from coconet.options import Algorithm, TransportKind
from coconet.runtime import algorithms as algos
from coconet.runtime.shmem import SharedMemoryTransport, ShmGroup
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import (
    Group,
    Pending,
    Transport,
    WholeWait,
    into,
    ready,
    wait_work,
)

__all__ = ["CrossHost", "HierGroup", "HierarchicalTransport", "HostLayout", "reduce_order"]


class CrossHost(enum.Enum):
    """How a group over hosts runs its reductions and gathers (``HierGroup.plan``)."""

    # homogeneous hosts: shared memory inside each host, then one exchange across hosts per
    # local index, each carrying 1/L of the tensor (every rank works; the module docstring)
    BY_LOCAL_INDEX = "two levels, by local index"
    # any other layout: to each host's leader over shared memory, across hosts among the
    # leaders only, back from the leader over shared memory (``_leaders_*``)
    THROUGH_LEADERS = "through one leader per host"


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
        """The most members any host holds (on homogeneous hosts: what each holds)."""
        return max(self.local_of) + 1

    def position(self, host: int, local: int) -> int:
        """The group position of the member at ``(host, local)``."""
        for p, (h, l) in enumerate(zip(self.host_of, self.local_of, strict=True)):
            if h == host and l == local:
                return p
        raise KeyError((host, local))

    def counterparts(self, local: int) -> list[int]:
        """The positions with local index ``local``, one per host, in host order (homogeneous
        hosts: on others some hosts have no member at ``local``)."""
        return [self.position(h, local) for h in range(self.hosts)]

    def members(self, host: int) -> list[int]:
        """The positions on ``host``, in local order (group order)."""
        return [p for p, h in enumerate(self.host_of) if h == host]

    @property
    def leaders(self) -> list[int]:
        """Each host's leader, in host order: its first member in group order (local index 0),
        the one that speaks for its host across hosts on ``CrossHost.THROUGH_LEADERS``."""
        return [self.position(h, 0) for h in range(self.hosts)]

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
    def plan(self) -> CrossHost | None:
        """How the group runs over its hosts (None: one host, nothing crosses). Two levels by
        local index on homogeneous hosts (one member per host too: there the inside level is
        nothing and the exchange alone replaces gloo's reduce_scatter and all_gather, which on
        a link run well below its rate); through one leader per host otherwise. Routing may
        still run a group another way (``coconet.runtime.routing``: how torch numbers the
        members of the process groups each level needs)."""
        if self.hosts < 2:
            return None
        return CrossHost.BY_LOCAL_INDEX if self.homogeneous else CrossHost.THROUGH_LEADERS


def reduce_order(op: ReduceOp, values: Sequence[torch.Tensor], layout: HostLayout) -> torch.Tensor:
    """What the hierarchical transport computes from the members' ``values`` (by group
    position), on either plan (``CrossHost``) and any layout: each host's values reduced in
    local order, then those reduced in host order (as the simulator's ``reduce_values`` reduces
    one level: 16-bit floats accumulate in float32 and round once per level)."""
    per_host = [reduce_values(op, [values[p] for p in layout.members(h)])
                for h in range(layout.hosts)]  # fmt: skip
    return reduce_values(op, per_host)


@dataclass
class HierGroup:
    """The hierarchical state of one group (``Group.handle``): its layout and plan, this rank's
    host group over shared memory, the members it exchanges with across hosts over
    torch.distributed, and the flat group (torch.distributed) for the rooted and point-to-point
    ops."""

    layout: HostLayout
    plan: CrossHost
    local: Group  # this rank's host's members, handle a ShmGroup (None: this rank alone)
    # across hosts, index = this rank's host: BY_LOCAL_INDEX, the members with this rank's
    # local index (point to point: no handle); THROUGH_LEADERS, the leaders (used by them only;
    # two leaders: their process group, for the all_reduce, ``_leaders_across``)
    cross: Group
    flat: Group  # the whole group over torch.distributed

    @property
    def leader(self) -> bool:
        """This rank speaks for its host (``HostLayout.leaders``)."""
        return self.local.index == 0

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


def _rows(x0: torch.Tensor, rows: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The row ranges ``rows`` of ``x0`` side by side (a view where they are one range)."""
    if len(rows) == 1:
        a, b = rows[0]
        return x0[a:b]
    return torch.cat([x0[a:b] for a, b in rows]) if rows else x0[:0]


def _place(x0: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The whole whose row ranges ``ranges`` ``x0`` holds side by side (``x0`` itself where
    they tile it in order)."""
    total = max((b for _, b in ranges), default=0)
    if _in_order(ranges, total):
        return x0
    out = x0.new_empty((total, *x0.shape[1:]))
    at = 0
    for a, b in ranges:
        out[a:b].copy_(x0[at : at + b - a])
        at += b - a
    return out


def _in_order(rows: Sequence[tuple[int, int]], total: int) -> bool:
    """Whether the ranges tile ``[0, total)`` in order (side by side they are the whole)."""
    at = 0
    for a, b in rows:
        if a != at:
            return False
        at = b
    return at == total


class HierarchicalTransport(Transport):
    """Collectives of groups that span hosts: in two levels by local index on homogeneous
    hosts, through one leader per host on the others (``CrossHost``; module docstring). Its
    work is done when a collective starts, as shared memory's: on a CPU the copying and the
    socket transfers take the cores there would be to overlap them with."""

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
        if h.plan is CrossHost.THROUGH_LEADERS:
            return ready(self._leaders_all_reduce(x, reduce_op, h))
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
        if h.plan is CrossHost.THROUGH_LEADERS:
            return ready(self._leaders_reduce_scatter(x0, reduce_op, h).movedim(0, dim))
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
        out: torch.Tensor | None = None,
    ) -> Pending:
        h: HierGroup = group.handle
        x0 = x.movedim(dim, 0).contiguous()
        if out is not None:  # (written whole, then copied: the phases' layouts differ)
            p = self.all_gather(x, group, dim=dim, parts=parts, algorithm=algorithm)
            return ready(into(p.wait(), out))
        if h.plan is CrossHost.THROUGH_LEADERS:
            return ready(self._leaders_all_gather(x0, parts, h).movedim(0, dim))
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
        return _place(mine, ranges)

    @staticmethod
    def _across_reduce(
        x0: torch.Tensor, blocks: Sequence[tuple[int, int]], op: ReduceOp, h: HierGroup
    ) -> torch.Tensor:
        """Block ``blocks[k]`` of ``x0`` (rows) reduced over the counterparts, at counterpart
        ``k``: this one gets its own block (``blocks[h.cross.index]``), every host's copy of it
        reduced in host order."""
        return HierarchicalTransport._reduce_across([x0[a:b] for a, b in blocks], op, h)

    @staticmethod
    def _reduce_across(sends: Sequence[torch.Tensor], op: ReduceOp, h: HierGroup
                       ) -> torch.Tensor:
        """``sends[k]`` to counterpart ``k`` (each counterpart sends this one tensors shaped as
        ``sends[h.cross.index]``), and what every counterpart sent here reduced in host order,
        this one's own ``sends[h.cross.index]`` in its place."""
        me = h.cross.index
        own = sends[me]
        recvs = [own.new_empty(own.shape) for _ in sends]
        recvs[me] = own
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

    # -- through one leader per host (CrossHost.THROUGH_LEADERS) -----------------------------

    def _leaders_all_reduce(self, x: torch.Tensor, op: ReduceOp, h: HierGroup) -> torch.Tensor:
        """The host's sum to its leader over shared memory (in local order), an all_reduce
        among the leaders (``_leaders_across``), the result back from the leader over shared
        memory."""
        flat = x.reshape(-1).contiguous()
        total = self._inside_reduce(flat, [(0, flat.numel())] if h.leader else [], op, h)
        whole = self._as_leader(h, lambda: self._leaders_across(total, flat, op, h))
        return self._from_leader(whole, flat, h).view(x.shape)

    @staticmethod
    def _leaders_across(total: torch.Tensor, flat: torch.Tensor, op: ReduceOp, h: HierGroup
                        ) -> torch.Tensor:
        """The leaders' all_reduce of their hosts' sums (``total``; ``flat``: the caller's
        input, which ``total`` may be, on a host of one). Two leaders: gloo's all_reduce on
        their own process group (``h.cross.handle``): a reduction of two terms is the same in
        either order, so it is host order, and on the shaped link it ran 5-8% faster than the
        exchange (600 against 652 ms at 64 MiB, 154 against 162 ms at 16 MiB; 1 Gbit/s, 2 + 1
        ranks, medians of 5; an earlier run 602/634 and 152/160): its ring reduces each chunk
        as it arrives, where the exchange reduces between its two rounds. Three or more: the
        exchange, each of ``H`` blocks reduced by one leader over every host's copy in host
        order, then sent back to every leader (gloo's ring would add in its own order, not host
        order)."""
        if h.cross.handle is not None:
            out = total.clone() if total.data_ptr() == flat.data_ptr() else total
            wait_work(dist.all_reduce(out, op=algos.TORCH_REDUCE_OP[op], group=h.cross.handle,
                                      async_op=True))  # fmt: skip
            return out
        blocks = _bounds(total.numel(), h.cross.size)
        reduced = HierarchicalTransport._across_reduce(total, blocks, op, h)
        return HierarchicalTransport._across_gather(reduced, [b - a for a, b in blocks], h)

    def _leaders_reduce_scatter(self, x0: torch.Tensor, op: ReduceOp, h: HierGroup
                                ) -> torch.Tensor:
        """The flat split's block of this member (``_bounds`` over the whole group): the host's
        sum of all of ``x0`` to its leader, the rows each host's members own to that host's
        leader, reduced there over hosts in host order, then every member's block from its
        leader (over shared memory: the host's rows, of which it keeps its own)."""
        layout = h.layout
        blocks = _bounds(x0.shape[0], len(layout.host_of))
        owned = [[blocks[p] for p in layout.members(k)] for k in range(layout.hosts)]
        total = self._inside_reduce(x0, [(0, x0.shape[0])] if h.leader else [], op, h)
        ours = self._as_leader(
            h, lambda: self._reduce_across([_rows(total, rows) for rows in owned], op, h)
        )
        mine = owned[layout.host_of[h.flat.index]]
        like = x0.new_empty((sum(b - a for a, b in mine), *x0.shape[1:]))
        ours = self._from_leader(ours, like, h)
        at = algos.offsets([b - a for a, b in mine])[h.local.index]
        lo, hi = blocks[h.flat.index]
        if ours.shape[0] == hi - lo:
            return ours
        return ours[at : at + hi - lo].clone()  # (not a view that keeps the host's rows alive)

    def _leaders_all_gather(self, x0: torch.Tensor, parts: Sequence[int], h: HierGroup
                            ) -> torch.Tensor:
        """Every member's ``x0`` (``parts[p]`` rows at position ``p``) in group order: the
        host's blocks to its leader over shared memory, every host's to every leader, the whole
        from the leader over shared memory."""
        layout = h.layout
        starts = algos.offsets(parts)
        rows = [[(starts[p], starts[p] + parts[p]) for p in layout.members(k)]
                for k in range(layout.hosts)]  # fmt: skip
        k = layout.host_of[h.flat.index]
        # inside the host: its members' blocks side by side, in local order
        at = algos.offsets([b - a for a, b in rows[k]])
        side = [[(o, o + b - a)] for o, (a, b) in zip(at, rows[k], strict=True)]
        host = self._inside_gather(x0, side, h)

        def across() -> torch.Tensor:
            got = self._across_gather(host, [sum(b - a for a, b in r) for r in rows], h)
            return _place(got, [rng for r in rows for rng in r])

        whole = self._as_leader(h, across)
        return self._from_leader(whole, x0.new_empty((sum(parts), *x0.shape[1:])), h)

    @staticmethod
    def _as_leader(h: HierGroup, across: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """``across()`` on the leader (None elsewhere). Its host's other members wait for it
        over shared memory next (``_from_leader``), not across hosts: when it fails (a leader
        of another host died, the link closed), the leader aborts its host's shared-memory
        group so they fail at once, not at their deadline."""
        if not h.leader:
            return None
        try:
            return across()
        except BaseException:
            if h.local.handle is not None:
                h.local.handle.abort()
            raise

    def _from_leader(self, whole: torch.Tensor | None, like: torch.Tensor, h: HierGroup
                     ) -> torch.Tensor:
        """The leader's ``whole`` on every member of its host (``like``: its shape and dtype,
        where this member is not the leader), over shared memory."""
        if h.local.size == 1:
            return whole
        if h.leader:
            return self.shm.broadcast(whole, h.local, root=0, donate=False).wait()
        try:
            return self.shm.broadcast(like, h.local, root=0, donate=False).wait().view(like.shape)
        except RuntimeFault as e:  # say who that peer is, and why it may have failed
            others = [r for r in h.cross.ranks if r != h.local.ranks[0]]
            raise RuntimeFault(
                e.message,
                op=e.op,
                details=[
                    *e.details,
                    f"group rank 0 of this host is its leader (the job's rank "
                    f"{h.local.ranks[0]}), which runs the group's collectives across hosts "
                    f"with the other hosts' leaders (ranks {others}): one of them, or a link, "
                    "may have failed",
                ],
                hint=e.hint,
            ) from e

    # -- what it can do beside the ops (``Transport``) ------------------------------------------

    def rank_ordered(self, group: Group) -> tuple[Transport, Group]:
        """The group's flat form on torch.distributed: its sums here are over hosts of each
        host's sum, not in rank order (the module docstring), so a communicator switched to
        ``CommOptions(algorithms="exact")`` after routing runs the group flat."""
        h: HierGroup = group.handle
        return self.flat, h.flat

    def signal_groups(self, group: Group) -> list[Group]:
        """This rank's host group over shared memory (none for a host of one)."""
        h: HierGroup = group.handle
        return [h.local] if h.local.handle is not None else []

    def close(self, group: Group) -> None:
        """Hand back the host group's shared memory."""
        h: HierGroup = group.handle
        h.close()

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
