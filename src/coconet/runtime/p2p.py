"""``PeerChannels``: untagged FIFO point-to-point channels among the ranks of one host, through
symmetric memory.

What a pipeline's stages send each other (activations forward, their gradients back) when two of
them share a host. The model is gloo's and NCCL's pair messages, the one
``coconet.pipeline.check`` proves schedules against: per (source, destination) one FIFO channel
without tags, so that the n-th receive a rank posts from a peer takes the n-th message that peer
sent it, whatever it carries. Here the message goes through memory both ranks map: one copy in,
one copy out, no socket, no kernel copy and no gloo thread in between.

**Layout.** Each directed channel (source -> destination) is a ring of ``slots`` slots in the
source's segment of one ``SymmetricMemory`` over the host's ranks (anonymous memfds: nothing is
ever left in /dev/shm), and two counters on cache lines of their own, each written by its only
writer and never reset: ``sent`` (messages the source wrote, in the source's segment) and
``consumed`` (messages the destination read, in the destination's). Every rank derives the
layout from the same list of channels (``layout``), which the ranks compare when they connect.

**A message.** A send of message n waits until ``consumed >= n - slots`` (its slot is free: it
waits only when the ring is full), writes the slot and publishes ``sent = n`` with a release
store; a receive of message n waits until ``sent >= n`` (acquire), copies the slot out and
publishes ``consumed = n``. Both waits are ``cn_wait_all``'s (``shm_sync.c``): the deadline, the
peer's life and its abort word looked at every ~10 ms, so none can hang, and a peer whose step
failed (``abort``) or that died is seen at once, not at the deadline.

**Checked, not tagged.** Each slot starts with a header (the message's number, two words the
caller chooses, such as a pipeline message's kind and micro-batch, and its bytes), which the
receiver compares with what its receive expects: messages pair by order alone, as untagged
channels pair them, and the header only verifies that pairing, so two ranks out of step get a
``RuntimeFault`` naming both messages instead of each other's tensors.

Posting is what the caller makes of it: a send returns once its message is in the ring (at once
unless the ring is full), a receive once its message is copied out. A caller that posts a step's
sends before its receives and sizes each ring to hold every message one round of its schedule
puts on that channel (the pipeline does) never has a send wait on a message of the same round,
so the channels add no wait that a proof over rendezvous channels did not already allow.

**``PeerLinks``** is what a caller gets from ``Communicator.p2p(axis, channels)``: every
(source, destination) channel of one group with routing's verdict on it (``Link``: shared memory
through ``PeerChannels`` among the ranks of this rank's host, or the torch.distributed
transport's untagged pair messages; ``coconet.runtime.routing.peer_plan`` decides, nothing else
does), and ``send_start`` / ``recv_start`` / ``wait`` over whichever carries each, every call
under the communicator's ``FaultGuard``.
"""

from __future__ import annotations

import ctypes
import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from coconet.errors import ConfigError, RuntimeFault
from coconet.options import TransportKind
from coconet.runtime import symmem
from coconet.runtime.symmem import SymmetricMemory
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import Group, Pending, ready

__all__ = ["ChannelSpec", "Link", "PeerChannels", "PeerLinks", "PeerPlan", "PeerWork", "Place",
           "layout"]  # fmt: skip

_LINE = 64  # a counter per cache line; slots start on one
_HEADER = 4  # int64 words at the start of a slot: number, two caller words, bytes


class ChannelSpec(NamedTuple):
    """One directed channel: ``src`` sends to ``dst`` (their indices in the host group), through
    a ring of ``slots`` slots of up to ``payload_bytes`` bytes each."""

    src: int
    dst: int
    slots: int
    payload_bytes: int


class Link(NamedTuple):
    """How one (source, destination) channel of a group runs, and why (routing's verdict:
    ``coconet.runtime.routing.peer_plan``)."""

    transport: TransportKind
    why: str


class PeerPlan(NamedTuple):
    """Routing's verdict on the channels of one group (``coconet.runtime.routing.peer_plan``):
    each channel's ``Link`` by (source, destination) index in the group, the ``ChannelSpec``s of
    those on shared memory (by index in ``host``, every one of its members' channels, so that
    each lays its memory out alike), and ``host``: this rank's host group (its handle the
    ``ShmGroup`` whose control channel sets the rings up), None when no channel runs there."""

    links: dict[tuple[int, int], Link]
    specs: list[ChannelSpec]
    host: Group | None


@dataclass(frozen=True)
class Place:
    """Where a channel lives: its ``sent`` counter and ring in the source's segment (byte offsets
    in its data area; ``stride`` bytes per slot, header included), its ``consumed`` counter in
    the destination's."""

    sent_at: int
    ring_at: int
    stride: int
    consumed_at: int


def layout(channels: Sequence[ChannelSpec], size: int) -> tuple[dict[tuple[int, int], Place],
                                                                list[int]]:  # fmt: skip
    """Every channel's ``Place`` and each rank's data bytes, for a group of ``size``: on each
    rank, its outgoing channels (counter, then ring) in (src, dst) order, then its incoming
    channels' counters. The same on every rank that is given the same channels."""
    places: dict[tuple[int, int], Place] = {}
    sent: dict[tuple[int, int], tuple[int, int, int]] = {}
    sizes = []
    ordered = sorted(channels)
    for r in range(size):
        at = 0
        for ch in ordered:
            if ch.src == r:
                stride = _LINE + -(-ch.payload_bytes // _LINE) * _LINE
                sent[(ch.src, ch.dst)] = (at, at + _LINE, stride)
                at += _LINE + ch.slots * stride
        sizes.append(at)
    for r in range(size):
        for ch in ordered:
            if ch.dst == r:
                sent_at, ring_at, stride = sent[(ch.src, ch.dst)]
                places[(ch.src, ch.dst)] = Place(sent_at, ring_at, stride, sizes[r])
                sizes[r] += _LINE
    return places, sizes


_U64P = ctypes.POINTER(ctypes.c_uint64)


class _Wait(NamedTuple):
    """``cn_wait_all``'s arrays for one counter of one peer, made once."""

    counters: ctypes.Array
    pids: ctypes.Array
    aborts: ctypes.Array
    peer: int
    address: int  # of the counter


class _Slot(NamedTuple):
    header: ctypes.Array  # _HEADER int64 words, in place
    payload: torch.Tensor  # uint8, in place


@dataclass
class _End:
    """This rank's end of one channel: its own counter (where it publishes), the peer's it waits
    on, the ring's slots, and the messages it has moved so far."""

    peer: int
    mine: int  # address of this rank's counter (sent, or consumed)
    theirs: _Wait
    slots: list[_Slot]
    count: int = 0


class PeerChannels:
    """Untagged FIFO channels among the ranks of one host (see the module docstring).

    Collective over the group: every rank constructs it at the same point with the same
    ``channels`` and ``identity`` (what the ranks must agree on, such as a digest of the
    schedule the channels carry); a difference is a ``ConfigError`` on every rank, before any
    memory is made. ``gather(obj)`` returns every member's ``obj`` in group order (a
    shared-memory group's control channel). ``op`` names the caller in its errors."""

    def __init__(
        self,
        channels: Sequence[ChannelSpec],
        index: int,
        size: int,
        gather: Callable[[object], Sequence[object]],
        *,
        timeout: float,
        identity: str = "",
        op: str = "point-to-point",
        cache_dir: str | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.index, self.size, self.timeout, self.op = index, size, timeout, op
        specs = sorted(ChannelSpec(*c) for c in channels)
        seen = gather((identity, specs))
        if any(s != seen[0] for s in seen):
            raise ConfigError(
                f"{op}: the ranks of one host were set up with different channels",
                op=op,
                details=[f"rank {r}: {s[0]} {s[1]}" for r, s in enumerate(seen)],
                hint="every rank must build the same pipeline (schedule, micro-batches, shapes, "
                "dtype) at the same point of its program",
            )
        places, sizes = layout(specs, size)
        self.mem = SymmetricMemory(sizes[index], index, size, gather, timeout=timeout,
                                   cache_dir=cache_dir, ranks=ranks)  # fmt: skip
        self.lib = self.mem.lib
        self._why = ctypes.c_int32(0)
        self._out: dict[int, _End] = {}
        self._in: dict[int, _End] = {}
        self._views: dict[tuple[int, int, int, torch.dtype, int], torch.Tensor] = {}
        for ch in specs:
            place = places[(ch.src, ch.dst)]
            if ch.src == index:
                self._out[ch.dst] = _End(ch.dst, self._address(index, place.sent_at),
                                         self._wait_args(ch.dst, place.consumed_at),
                                         self._slots(index, ch, place))  # fmt: skip
            elif ch.dst == index:
                self._in[ch.src] = _End(ch.src, self._address(index, place.consumed_at),
                                        self._wait_args(ch.src, place.sent_at),
                                        self._slots(ch.src, ch, place))  # fmt: skip

    # -- setup ------------------------------------------------------------------------------------

    def _address(self, rank: int, offset: int) -> int:
        return self.mem.buffer(rank, torch.int64, 1, offset).data_ptr()

    def _wait_args(self, peer: int, offset: int) -> _Wait:
        aborts = self.mem.signals()[3]  # every rank's abort word, by rank
        address = self._address(peer, offset)
        return _Wait(
            (_U64P * 1)(ctypes.cast(address, _U64P)),
            (ctypes.c_int32 * 1)(self.mem.pids[peer]),
            (_U64P * 1)(aborts[peer]),
            peer,
            address,
        )

    def _slots(self, owner: int, ch: ChannelSpec, place: Place) -> list[_Slot]:
        out = []
        for s in range(ch.slots):
            at = place.ring_at + s * place.stride
            head = self._address(owner, at)
            out.append(_Slot((ctypes.c_int64 * _HEADER).from_address(head),
                             self.mem.buffer(owner, torch.uint8, ch.payload_bytes, at + _LINE)))
        return out

    # -- messages ---------------------------------------------------------------------------------

    def send(self, dst: int, t: torch.Tensor, words: tuple[int, int], what: str) -> None:
        """Put contiguous ``t`` on the channel to ``dst`` (a ``words`` pair goes in its header for
        the receiver to check); returns once it is in the ring. Waits, with the deadline, only
        while the ring is full."""
        end = self._out[dst]
        n = end.count + 1
        code = self.mem.aborted(dst)
        if code:
            # it will read nothing more: its step failed before it read this message (a rank
            # that stalled past its peer's timeout must not finish a step its peer gave up)
            self._why.value = 3
            self._fail(end.theirs, n, what, "consumed", code)
        slots = len(end.slots)
        if n > slots:  # the slot's previous message must have been read
            self._wait(end.theirs, n - slots, what, "consumed")
        slot = end.slots[(n - 1) % slots]
        nbytes = t.numel() * t.element_size()
        if nbytes > slot.payload.numel():
            raise ValueError(f"{what}: {nbytes} bytes, the channel's slots hold "
                             f"{slot.payload.numel()}")  # fmt: skip
        self._view(end, n, t.dtype, t.numel(), slot).copy_(t.reshape(-1))
        slot.header[0], slot.header[1], slot.header[2], slot.header[3] = n, *words, nbytes
        self.lib.cn_store_release(end.mine, n)  # the slot and its header are visible first
        end.count = n

    def recv(self, src: int, out: torch.Tensor, words: tuple[int, int], what: str) -> None:
        """Copy the next message from ``src`` into contiguous ``out``, once it has arrived; its
        header must say ``words`` and ``out``'s size (else the ranks are out of step)."""
        end = self._in[src]
        n = end.count + 1
        self._wait(end.theirs, n, what, "sent")
        slot = end.slots[(n - 1) % len(end.slots)]
        nbytes = out.numel() * out.element_size()
        got = tuple(slot.header)
        if got != (n, *words, nbytes):
            raise RuntimeFault(
                f"{what}: the ranks are out of step: the message that arrived is not the one "
                "this receive expects",
                op=self.op,
                details=[f"expected message {n}: words {list(words)}, {nbytes} bytes",
                         f"group rank {src} sent message {got[0]}: words {list(got[1:3])}, "
                         f"{got[3]} bytes"],  # fmt: skip
                hint="every rank must run the same schedule; see the other ranks' errors",
            )
        out.reshape(-1).copy_(self._view(end, n, out.dtype, out.numel(), slot))
        self.lib.cn_store_release(end.mine, n)  # the slot may be overwritten
        end.count = n

    def _view(self, end: _End, n: int, dtype: torch.dtype, numel: int, slot: _Slot
              ) -> torch.Tensor:  # fmt: skip
        """The slot of message ``n`` as ``numel`` elements of ``dtype`` (made once per kind)."""
        key = (id(end), (n - 1) % len(end.slots), numel, dtype, slot.payload.data_ptr())
        v = self._views.get(key)
        if v is None:
            size = dtype.itemsize
            v = self._views[key] = slot.payload[: numel * size].view(dtype)
        return v

    def _wait(self, w: _Wait, target: int, what: str, counter: str) -> None:
        if self.lib.cn_load_acquire(w.address) >= target:  # there already: one cheap look
            return
        late = self.lib.cn_wait_all(w.counters, w.pids, 1, target, self.timeout, self._why,
                                    w.aborts, symmem.WAIT.spin_s, symmem.WAIT.yield_s)  # fmt: skip
        if late < 0:
            return
        self._fail(w, target, what, counter,
                   self.mem.aborted(w.peer) if self._why.value == 3 else 0)  # fmt: skip

    def _fail(self, w: _Wait, target: int, what: str, counter: str, code: int) -> None:
        cause = symmem.wait_cause(self._why.value, self.timeout, "the peer rank",
                                  code or symmem.ABORTED)  # fmt: skip
        have = int(self.lib.cn_load_acquire(w.address))
        raise RuntimeFault(
            f"{what} did not complete: {cause}",
            op=self.op,
            details=[f"waiting for {self.mem.who(w.peer)} (pid {self.mem.pids[w.peer]}) to have "
                     f"{counter} {target} messages on this channel; it is at {have}"],
            hint="look at the other ranks' output for the first failure; this pipeline cannot "
            "continue: end the job and restart it",
        )  # fmt: skip

    # -- the end ----------------------------------------------------------------------------------

    def abort(self) -> None:
        """Tell the peers that this rank will send and read no more (its step failed): their
        waits on it fail at once. Final."""
        self.mem.abort()

    def close(self) -> None:
        """Drop this rank's mappings (the memory goes when every rank dropped them)."""
        self._out, self._in, self._views = {}, {}, {}
        self.mem.close()


# -- every channel of one group, whichever transport carries it ------------------------------------


class PeerWork(NamedTuple):
    """A message in flight (``PeerLinks.send_start`` / ``recv_start``); ``PeerLinks.wait``
    completes it."""

    label: str
    pending: Pending


class PeerLinks:
    """This rank's point-to-point channels in one group: what ``Communicator.p2p`` returns (see
    the module docstring). ``links``: every channel's ``Link`` by (source, destination) index in
    the group. ``channels``: the shared-memory ones (``PeerChannels``, None when there are none).

    A send over shared memory is done when ``send_start`` returns (its message is in the ring);
    a receive over shared memory is done by ``wait`` (it waits for its message and copies it
    out); over torch.distributed both are posted by ``*_start`` and completed by ``wait``. Post a
    round's sends and receives, then wait for them: a receive never blocks another's posting.
    ``words``: two integers that a shared-memory message carries in its header for its receive
    to check (messages pair by order alone, as untagged channels pair them; pair messages carry
    none)."""

    def __init__(
        self,
        plan: PeerPlan,
        group: Group,
        guard: Callable[..., object],
        *,
        timeout: float,
        identity: str,
        op: str,
        pairs: TorchDistributedTransport | None = None,
    ) -> None:
        self.links = plan.links
        self.axis, self.op = group.axis, op
        self._group, self._guard = group, guard
        self._timeout = datetime.timedelta(seconds=timeout)
        # what carries the channels that are not on shared memory: untagged pair messages
        self._pairs = pairs if pairs is not None else TorchDistributedTransport()
        me = group.index
        shm = TransportKind.SHARED_MEMORY
        self._shm_out = {d for (s, d), link in plan.links.items() if s == me and
                         link.transport is shm}  # fmt: skip
        self._shm_in = {s for (s, d), link in plan.links.items() if d == me and
                        link.transport is shm}  # fmt: skip
        self.channels: PeerChannels | None = None
        self._local: dict[int, int] = {}  # group index -> its index in the host group
        host = plan.host
        if plan.specs and host is not None:
            members = {r: i for i, r in enumerate(host.ranks)}
            self._local = {i: members[r] for i, r in enumerate(group.ranks) if r in members}
            st = host.handle  # the host's ShmGroup: its control channel sets the rings up
            self.channels = guard(
                op, "shared-memory channels", self.axis, PeerChannels, plan.specs,
                members[group.ranks[me]], len(host.ranks), st.gather, timeout=timeout,
                identity=identity, op=op, cache_dir=st.cache_dir, ranks=host.ranks,
            )  # fmt: skip

    def transport(self, src: int, dst: int) -> TransportKind | None:
        """What carries the channel from ``src`` to ``dst`` (None: there is no such channel)."""
        link = self.links.get((src, dst))
        return None if link is None else link.transport

    def send_start(self, x: torch.Tensor, dst: int, *, words: tuple[int, int], label: str
                   ) -> PeerWork:  # fmt: skip
        """Send contiguous ``x`` to the group's ``dst``-th rank."""
        if dst in self._shm_out:
            self._guard(self.op, label, self.axis, self._ring_send, dst, x, words, label)
            return PeerWork(label, ready(x))
        self._known(self._group.index, dst)
        return PeerWork(label, self._guard(self.op, label, self.axis, self._pairs.send_to, x,
                                           self._group, dst))  # fmt: skip

    def recv_start(self, out: torch.Tensor, src: int, *, words: tuple[int, int], label: str
                   ) -> PeerWork:  # fmt: skip
        """Receive the next message from the group's ``src``-th rank into contiguous ``out``
        (``wait`` returns ``out`` once it is there)."""
        if src in self._shm_in:
            def finish() -> torch.Tensor:
                self._ring_recv(src, out, words, label)
                return out

            return PeerWork(label, Pending([], finish))
        self._known(src, self._group.index)
        return PeerWork(label, self._guard(self.op, label, self.axis, self._pairs.recv_from, out,
                                           self._group, src))  # fmt: skip

    def wait(self, work: PeerWork) -> torch.Tensor:
        """The message's tensor once its send or receive completed on this rank."""
        return self._guard(self.op, work.label, self.axis, work.pending.wait, self._wait_pair)

    def _wait_pair(self, work) -> None:
        """A pair message's handle (``WholeWait``), waited for in one call of the timeout: gloo
        fails a pair whose wait ends early, so it cannot be waited for in slices. Nor is the
        job's store looked at first for a peer's abort, as a collective's wait does
        (``ControlChannel.wait_work``): a store round trip beside a message in flight cost more
        than the message (a 64 KiB round trip on 2 cores: 160 us alone, 300-770 us with one);
        a peer that died is seen when its connection closes, one that stalls at the timeout."""
        work.wait(self._timeout)

    def _ring_send(self, dst: int, x: torch.Tensor, words: tuple[int, int], label: str) -> None:
        self.channels.send(self._local[dst], x, words, label)

    def _ring_recv(self, src: int, out: torch.Tensor, words: tuple[int, int], label: str
                   ) -> None:  # fmt: skip
        self.channels.recv(self._local[src], out, words, label)

    def _known(self, src: int, dst: int) -> None:
        if (src, dst) not in self.links:
            raise ConfigError(
                f"{self.op}: no channel from group rank {src} to {dst} was set up",
                op=self.op,
                hint="Communicator.p2p(axis, channels) takes every (source, destination) pair "
                "that will carry a message",
            )

    def abort(self) -> None:
        """Tell the shared-memory peers that this rank will send and read no more (its round
        failed): their waits on it fail at once. Final."""
        if self.channels is not None:
            self.channels.abort()

    def close(self) -> None:
        """Hand back the shared-memory channels."""
        if self.channels is not None:
            self.channels.close()
            self.channels = None
