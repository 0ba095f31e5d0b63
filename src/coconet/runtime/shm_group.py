"""One shared-memory group's state (``ShmGroup``, a ``Group.handle`` of the shared-memory
transport, ``coconet.runtime.shmem``): its segments, its epoch, the tensors registered in symmetric
memory of their own, and the views and call arguments made once per segment, so that a small
collective does not rebuild them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from coconet.runtime import symmem
from coconet.runtime.native import OneShotArgs
from coconet.runtime.replica import HostReplica, replica_bytes
from coconet.runtime.symmem import ABORTED, Phase, SymmetricMemory

__all__ = ["CONTROL_WORDS", "ShmGroup", "head_bytes", "numel_of"]

_MIN_BYTES = 1 << 20  # the first segment's data area; it doubles as collectives need more



# Control words (``words_round``): at most this many per round (or one per rank, when more), plus
# the round's kind word, at the start of each rank's input area; a payload rides after them.
CONTROL_WORDS = 32




def head_bytes(size: int) -> int:
    """Bytes before the payload in a control round's area, for a group of ``size``: the kind word
    and up to ``max(CONTROL_WORDS, size)`` words, whole cache lines."""
    words = 1 + max(CONTROL_WORDS, size)
    return -(-8 * words // 64) * 64




class ShmGroup:
    """The shared-memory state of one group (``Group.handle``): its segments and its epoch."""

    def __init__(
        self,
        index: int,
        size: int,
        gather: Callable[[object], Sequence[object]],
        timeout: float,
        cache_dir: str | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.index, self.size, self.gather = index, size, gather
        self.timeout, self.cache_dir = timeout, cache_dir
        self.ranks = ranks  # the job's rank of each member (named in errors)
        self.epoch = 0
        self.mem: SymmetricMemory | None = None
        self.area = 0  # bytes of each of the input and output areas
        # tensors that live in symmetric memory of their own (a gradient bucket): data pointer ->
        # (their memory, numel, dtype); a collective reads the peers' copies in place
        self.registered: dict[int, tuple[SymmetricMemory, int, torch.dtype]] = {}
        self._uneven: list[SymmetricMemory] = []  # registered with sizes that differ by rank
        self.open_registered = False  # the open one-pass unit reads a registered input in place
        # host replicas (``HostReplica``), by the data pointer of each of their two buffers
        self.replicas: dict[int, HostReplica] = {}
        self.open_replica: HostReplica | None = None  # the open unit gathers into this one
        # Views of every rank's areas by (dtype, numel, offset), made once per segment: a small
        # collective's time went mostly into rebuilding them (``areas``)
        self._areas: dict[tuple[torch.dtype, int, int], list[torch.Tensor]] = {}
        # every rank's copy of each registered tensor (flat), by data pointer (``peer_copies``)
        self._copies: dict[int, list[torch.Tensor]] = {}
        # cn_one_shot's fixed arguments by kind of call (``one_shot_args``)
        self._pointers: dict[tuple, tuple] = {}
        # one kind of all_reduce in one round (shmem.OneShotPlan) by (data pointer, numel, dtype,
        # reduction, donated); dropped whenever what they point at may change: a new segment, a
        # new registered tensor (an address an unregistered tensor had may now be registered)
        self.one_shot_plans: dict[tuple, object] = {}
        self.words: dict[int, tuple] = {}  # words_round's ctypes arrays, by number of words
        # The one-pass units' views (every peer's rows of a published input, every rank's
        # slot of a gather): by what they view, with the memory they view (reused only while
        # that is the same object). A step builds the same ones every time, and rebuilding them
        # cost ~10 torch calls per peer, before and after the kernel.
        self._views: dict[tuple, tuple[object, list[torch.Tensor]]] = {}

    def _segment(self, nbytes: int) -> SymmetricMemory:
        """A new ``SymmetricMemory`` over the group with ``nbytes`` in this rank's segment
        (collective)."""
        return SymmetricMemory(
            nbytes, self.index, self.size, self.gather, timeout=self.timeout,
            cache_dir=self.cache_dir, ranks=self.ranks,
        )

    def register(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` in symmetric memory of its own, mapped by every peer.
        Collective: every rank of the group calls it at the same point."""
        numel = numel_of(shape)
        mem = self._segment(max(1, numel) * dtype.itemsize)
        t = mem.buffer(self.index, dtype, numel).view(tuple(shape))
        if len(set(mem.peer_bytes)) > 1:
            # The ranks asked for different sizes (an uneven slice of a sequence): a collective
            # that read the peers' copies in place would take this rank's size for theirs, so
            # it copies this tensor in as any other. Every rank sees every size: all decide alike.
            self._uneven.append(mem)  # kept mapped as long as the group
            return t
        self.registered[t.data_ptr()] = (mem, numel, dtype)
        self.one_shot_plans = {}
        self._copies[t.data_ptr()] = [mem.buffer(j, dtype, numel) for j in range(self.size)]
        return t

    def replica(self, shape: Sequence[int], dtype: torch.dtype) -> HostReplica:
        """A ``HostReplica`` of ``shape`` in the group's first rank's segment, mapped by every
        rank. Collective: every rank of the group calls it at the same point."""
        mem = self._segment(replica_bytes(shape, dtype) if self.index == 0 else 0)
        r = HostReplica(mem, shape, dtype, owner=0)
        for ptr in r.buffers():
            self.replicas[ptr] = r
        return r

    def replica_of(self, t: torch.Tensor) -> HostReplica | None:
        """The replica whose live buffer ``t`` is, if it is one."""
        r = self.replicas.get(t.data_ptr())
        return r if r is not None and r.holds(t) else None
    def peer_copies(self, flat: torch.Tensor) -> list[torch.Tensor] | None:
        """For a registered tensor's whole flat view: every rank's copy of it (flat, by rank),
        made once at ``register``; None for any other tensor."""
        copies = self._copies.get(flat.data_ptr())
        if copies is None or not flat.is_contiguous() or flat.numel() != copies[0].numel():
            return None
        return copies if flat.dtype == copies[0].dtype else None

    def reserve(self, nbytes: int) -> None:
        """Make each area at least ``nbytes`` now, so that no later collective of up to that size
        grows the segment (a control group: a round must pair with a peer's round of another
        size without either growing it, which is collective). Collective."""
        if self.mem is None or nbytes > self.area:
            if self.mem is not None:
                self.mem.wait(Phase.CONSUMED, self.epoch)
            self._grow(nbytes)

    def one_shot_args(
        self,
        registered: list[torch.Tensor] | None,
        dtype: torch.dtype,
        numel: int,
        code: tuple[int, int],
        head_words: int = 0,
    ) -> tuple[OneShotArgs, int]:
        """``cn_one_shot``'s fixed arguments for a call of this kind (every rank's copy of the
        input: ``registered``, or the input areas; dtype, size, reduction; with ``head_words``,
        that many control words at the start of each input area and the input after them, at
        ``head_bytes``), and their address; made once per kind, until the segment grows, and
        renewed when the wait policy (``symmem.WAIT``) is replaced."""
        key = (0 if registered is None else registered[0].data_ptr(), dtype, numel, code,
               head_words)  # fmt: skip
        entry = self._pointers.get(key)
        if entry is not None and entry[2] is symmem.WAIT:
            return entry[0], entry[1]
        if entry is None:
            if len(self._pointers) > 64:  # many kinds in turn: keep the cache small
                self._pointers.clear()
            offset = head_bytes(self.size) if head_words else 0
            views = registered if registered is not None else self.areas(dtype, numel, offset)
            inputs = (ctypes.c_void_p * self.size)(*[v.data_ptr() for v in views])
            ready_, consumed, pids, aborts = self.mem.signals()
            args = OneShotArgs(
                inputs, numel, code[0], code[1], self.size, self.index,
                int(registered is not None), ready_, consumed, pids, aborts, self.mem.timeout,
            )
            heads = None
            if head_words:
                starts = self.areas(torch.int64, head_words)
                heads = (ctypes.c_void_p * self.size)(*[v.data_ptr() for v in starts])
                args.heads, args.head_words = heads, head_words
            keep = (inputs, heads)  # the struct points into them
        else:
            args, keep = entry[0], entry[3]
        args.spin_s, args.yield_s = symmem.WAIT.spin_s, symmem.WAIT.yield_s
        entry = (args, ctypes.addressof(args), symmem.WAIT, keep)
        self._pointers[key] = entry
        return entry[0], entry[1]

    def areas(self, dtype: torch.dtype, numel: int, offset: int = 0) -> list[torch.Tensor]:
        """``numel`` elements of ``dtype`` at byte ``offset`` of every rank's data area of the
        current segment (offset 0: the input area, ``self.area``: the output area), by rank;
        cached until the segment grows."""
        key = (dtype, numel, offset)
        views = self._areas.get(key)
        if views is None:
            if len(self._areas) > 64:  # many sizes in turn: keep the cache small
                self._areas.clear()
            views = [self.mem.buffer(j, dtype, numel, offset) for j in range(self.size)]
            self._areas[key] = views
        return views

    def publish(
        self, mem: SymmetricMemory, x: torch.Tensor
    ) -> tuple[Callable[[int], torch.Tensor], bool]:
        """Make contiguous ``x`` readable by the peers for this epoch: (peer j's copy of it, by
        j; whether it lives in symmetric memory of its own). A registered tensor is read in
        place; any other is copied into this rank's input area."""
        peer = self.peer_views(x)
        if peer is not None:
            return peer, True
        mem.buffer(self.index, x.dtype, x.numel()).view(x.shape).copy_(x)
        return (lambda j: mem.buffer(j, x.dtype, x.numel()).view(x.shape)), False

    def views(self, key: tuple, owner: object, make: Callable[[], list[torch.Tensor]]
              ) -> list[torch.Tensor]:
        """``make()``, or what it returned last time for ``key`` while ``owner`` (the memory
        the views are of) is the same object. The views go to coconet's own generated code and
        commit, which read and write their elements, never their shape or storage."""
        hit = self._views.get(key)
        if hit is not None and hit[0] is owner:
            return hit[1]
        if len(self._views) > 64:  # many kinds in turn: keep the cache small
            self._views.clear()
        made = make()
        self._views[key] = (owner, made)
        return made

    def published_owner(self, mem: SymmetricMemory, x: torch.Tensor, registered: bool) -> object:
        """What ``publish(mem, x)`` made the peers' copies of ``x`` views of: a registered
        tensor's own memory entry, else ``mem``."""
        return self.registered.get(x.data_ptr()) if registered else mem

    def peer_views(self, x: torch.Tensor) -> Callable[[int], torch.Tensor] | None:
        """For a registered tensor ``x`` (the whole of it): peer j's copy of it, by j."""
        entry = self.registered.get(x.data_ptr())
        if entry is None or not x.is_contiguous():
            return None
        mem, numel, dtype = entry
        if x.numel() != numel or x.dtype != dtype:
            return None
        return lambda j: mem.buffer(j, dtype, numel).view(x.shape)

    def begin(self, nbytes: int) -> tuple[SymmetricMemory, int]:
        """Start the next epoch for a collective that needs ``nbytes`` per area: (memory, epoch).

        Waits until every peer has finished reading this rank's segment for the previous epoch,
        so the areas can be overwritten."""
        if self.mem is not None:
            self.mem.wait(Phase.CONSUMED, self.epoch)
        if self.mem is None or nbytes > self.area:
            self._grow(nbytes)
        self.epoch += 1
        return self.mem, self.epoch

    def _grow(self, nbytes: int) -> None:
        area = max(_MIN_BYTES, 2 * self.area)
        while area < nbytes:
            area *= 2
        old = self.mem
        mem = self._segment(2 * area)  # collective: the same size at the same epoch everywhere
        for phase in Phase:  # a new segment's signals start where the group's epoch is
            mem.post(phase, self.epoch)
        self.gather(None)  # every rank posted: waits on the new segments are meaningful
        if old is not None:
            old.close()
        self.mem, self.area = mem, area
        # they viewed the old segment
        self._areas, self._pointers, self._views, self.one_shot_plans = {}, {}, {}, {}

    def abort(self, code: int = ABORTED) -> None:
        """Tell the peers that this rank's step failed (or that it left the job: ``code``):
        their waits on it fail at once."""
        for mem in (self.mem, *(m for m, _, _ in self.registered.values()), *self._uneven):
            if mem is not None:
                mem.abort(code)

    def close(self) -> None:
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        for mem in (*(m for m, _, _ in self.registered.values()), *self._uneven):
            mem.close()
        self.registered, self._copies, self._areas, self._pointers = {}, {}, {}, {}
        self.one_shot_plans = {}
        self._views, self._uneven = {}, []
        for r in set(self.replicas.values()):
            r.close()
        self.replicas, self.open_replica = {}, None




def numel_of(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
