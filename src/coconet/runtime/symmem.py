"""Symmetric memory on one host: buffers every rank of a group maps, and signals between them.

Shaped like PyTorch's symmetric memory (``torch.distributed._symmetric_memory``) so that the GPU
path can follow the same design: each rank allocates a segment of the same size, a rendezvous
over the group maps every peer's segment, and ``buffer(peer)`` gives a peer's memory as a tensor.
Each segment starts with a signal area: one 64-byte cache line per ``Phase``, holding an epoch
counter that only its owner writes and that is never reset (``coconet.runtime.native`` does the
release stores and the waits with deadlines).

**Nothing can leak.** A segment is an anonymous ``memfd`` (``memfd_create``), never a file in
/dev/shm: peers map it through ``/proc/<owner pid>/fd/<fd>``, and the kernel frees it when the
last rank that maps it exits, however it exits (a normal exit, an exception, SIGKILL of one rank
or of the whole job). Names cannot collide between jobs because there are none. The memory counts
against RAM, not against a container's small /dev/shm: free memory is checked first, with a clear
error.

**Same host** is decided from evidence every rank contributes: hostname, the kernel's boot id and
the PID namespace (``/proc/<pid>/fd`` of a peer resolves only within one). ``COCONET_HOST_ID``
overrides it, for tests that pretend that ranks of one machine live on different hosts.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from coconet.errors import ConfigError, RuntimeFault
from coconet.runtime.native import sync_library

__all__ = ["Phase", "SymmetricMemory", "WaitPolicy", "host_identity", "wait_cause"]

_LINE = 64  # bytes per signal: one cache line each, so writers never share a line
_MAGIC = 0x636F636F6E657431  # "coconet1": the header word a mapper checks


class Phase(enum.IntEnum):
    """The signals of a segment, one epoch counter each (index = cache line after the header)."""

    READY = 1  # my input (or my slice for a gather) is in my segment for this epoch
    REDUCED = 2  # my reduced slice is in my segment's output area
    CONSUMED = 3  # I finished reading the peers' segments for this epoch (and my published
    # gather slots may be overwritten: for a published gather, posted after the commit)


# After the phases, one more line: the owner's abort word (0, or 1 once its step failed or was
# interrupted: ``abort``); every wait on the owner gives up when it sees it set.
_ABORT_OFFSET = _LINE * (max(Phase) + 1)
SIGNAL_BYTES = _ABORT_OFFSET + _LINE  # header line + one line per phase + the abort line


def host_identity() -> str:
    """What two ranks must share to map each other's memory: hostname, boot id, PID namespace."""
    override = os.environ.get("COCONET_HOST_ID")
    if override:
        return f"override:{override}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "no-pid-ns"
    return f"{socket.gethostname()}|{boot}|{pidns}"


def available_memory() -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# What a rank's abort word says (0: nothing): its step failed or was interrupted, or it left
# the job (it will make no more calls: ``ControlChannel.depart``).
ABORTED = 1
DEPARTED = 2


def wait_cause(why: int, timeout: float, peer: str = "a peer rank", code: int = ABORTED) -> str:
    """Why ``cn_wait_all`` gave up, in words (``why``: 3 the peer aborted, or left the job when
    its abort word is ``DEPARTED``; 2 it died; else the deadline passed)."""
    if why == 3 and code == DEPARTED:
        return (f"{peer} left the job (its work returned, or its process is ending) while this "
                "rank waits for it: the ranks made different calls")
    if why == 3:
        return f"{peer} aborted its step (it failed or was interrupted)"
    if why == 2:
        return f"{peer} died"
    return f"no answer within {timeout:g} s: {peer} stalled or died"


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers' signals (``cn_wait_all`` in shm_sync.c): busy-polling up
    to ``spin_s`` seconds, then polling with ``sched_yield`` between looks up to ``yield_s``, then
    sleeping with a doubling interval. Every stage watches the deadline, the peer's life and its
    abort word (every ~10 ms), so none can hang.

    The default polls for 2 ms before it sleeps, yielding at every look and never spinning: a
    small collective's peer usually posts within microseconds, and a sleeping waiter pays
    ~60-100 us to wake (on 2 ranks of the 2-core machine that was most of a small all_reduce).
    Spinning saves ~1 us per wait on an idle machine, but where the cores are shared (2 ranks
    fill this machine's 2, and other jobs run beside them) a spinning waiter keeps the core its
    peer needs: ``benchmarks/small_steps.py`` (``--wait``), an 8 KiB all_reduce, in a run at load
    2-4: yield 35 us, spin 20 us then yield 46 us, spin only 514 us, sleep at once 129 us; in
    results/small_steps.txt (another CPU, load 1.4-2.1): 10.7, 12.2, 8.5 and 91.2 us. The
    sleeps after 2 ms stop a rank that waits long (a peer computing or compiling) from keeping
    its core busy."""

    spin_s: float = 0.0
    yield_s: float = 2e-3


WAIT = WaitPolicy()  # the process's policy (a benchmark may replace it: symmem.WAIT = ...)


@dataclass(frozen=True)
class _Entry:
    """What a rank tells its peers about its segment."""

    pid: int
    fd: int
    nbytes: int
    host: str


class SymmetricMemory:
    """One segment per rank of a group, each mapped by every rank of the group.

    Collective: every rank of the group constructs it at the same point, normally with the same
    ``nbytes``; a rank may ask for another size (0: a segment of signals only), and each peer's
    ``buffer`` is bounded by that peer's own size (a ``HostReplica`` lives in one rank's
    segment). ``gather(obj)`` is the group's control channel: it returns every member's ``obj``
    in group order (the communicator passes an all_gather_object over the group's process group).
    """

    def __init__(
        self,
        nbytes: int,
        index: int,
        size: int,
        gather: Callable[[object], Sequence[object]],
        *,
        timeout: float,
        cache_dir: str | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.index, self.size, self.timeout = index, size, timeout
        # the job's rank of each member, for errors (None: the group is the job's first ranks)
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(size))
        self.data_bytes = int(nbytes)
        self.lib = sync_library(cache_dir)
        total = SIGNAL_BYTES + self.data_bytes
        free = available_memory()
        if free is not None and total * 2 > free:  # this rank's segment plus headroom
            raise ConfigError(
                f"shared memory: {total / 2**20:.1f} MiB per rank requested, "
                f"{free / 2**20:.1f} MiB of memory available",
                op="shared memory",
                hint="use smaller buckets, or CommOptions(transport='torch.distributed')",
            )
        fd = os.memfd_create("coconet-symmem", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            mine = mmap.mmap(fd, total)
            entries = gather(_Entry(os.getpid(), fd, total, host_identity()))
            self.pids = [e.pid for e in entries]
            self._peer_bytes = [e.nbytes - SIGNAL_BYTES for e in entries]
            maps: list[mmap.mmap | None] = []
            failure = None
            for i, e in enumerate(entries):
                if i == index:
                    maps.append(mine)
                    continue
                try:
                    peer_fd = os.open(f"/proc/{e.pid}/fd/{e.fd}", os.O_RDWR)
                    try:
                        maps.append(mmap.mmap(peer_fd, e.nbytes))
                    finally:
                        os.close(peer_fd)
                except OSError as exc:
                    maps.append(None)
                    failure = f"rank {i} (pid {e.pid}): {exc}"
            # Everyone mapped (or failed): the owners may now close their fds; the mappings keep
            # the memory alive exactly as long as some rank of the job is alive.
            verdicts = gather(failure)
        finally:
            os.close(fd)
        problems = [v for v in verdicts if v]
        if problems:
            raise ConfigError(
                "shared memory: ranks could not map each other's segments",
                op="shared memory",
                details=[str(p) for p in problems],
                hint="run the ranks in one PID namespace, or use "
                "CommOptions(transport='torch.distributed')",
            )
        self._maps = maps
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        self._base = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
        # The header: a magic word and the owner's pid, checked by every peer.
        self._bytes[index][:8].view(torch.int64)[0] = _MAGIC
        self._bytes[index][8:16].view(torch.int64)[0] = os.getpid()
        verdict = gather(None)  # the headers are written
        del verdict
        for i in range(size):
            head = self._bytes[i][:16].view(torch.int64)
            if int(head[0]) != _MAGIC or int(head[1]) != self.pids[i]:
                raise ConfigError(
                    f"shared memory: the segment mapped for rank {i} is not that rank's",
                    op="shared memory",
                    hint="report this: the rendezvous mapped the wrong memory",
                )
        # the ctypes arguments of each (phase, peers) wait (``_make_wait_args``), and the word
        # a failed wait's reason comes back in
        self._wait_args: dict[tuple[Phase, tuple[int, ...] | None], tuple] = {}
        self._why = ctypes.c_int32(0)

    # -- memory ----------------------------------------------------------------------------------

    @property
    def peer_bytes(self) -> tuple[int, ...]:
        """The size of every rank's data area, by rank (the same list on every rank)."""
        return tuple(self._peer_bytes)

    def buffer(self, peer: int, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` of ``peer``'s data area."""
        start = SIGNAL_BYTES + offset
        nbytes = numel * dtype.itemsize
        if offset < 0 or start + nbytes > SIGNAL_BYTES + self._peer_bytes[peer]:
            raise ConfigError(
                f"shared memory: {nbytes} bytes at offset {offset} exceed rank {peer}'s "
                f"segment of {self._peer_bytes[peer]}",
                op="shared memory",
            )
        return self._bytes[peer][start : start + nbytes].view(dtype)

    # -- signals ---------------------------------------------------------------------------------

    def _counter(self, peer: int, phase: Phase) -> int:
        return self._base[peer] + _LINE * int(phase)

    def post(self, phase: Phase, epoch: int) -> None:
        """Publish ``epoch`` for ``phase``: everything this rank wrote before is visible to a peer
        that sees it."""
        self.lib.cn_store_release(self._counter(self.index, phase), epoch)

    def value(self, peer: int, phase: Phase) -> int:
        return int(self.lib.cn_load_acquire(self._counter(peer, phase)))

    def wait(self, phase: Phase, epoch: int, peers: Sequence[int] | None = None) -> None:
        """Until every peer in ``peers`` (default: all others) posted ``phase`` >= ``epoch``;
        a ``RuntimeFault`` when one dies or the deadline passes."""
        key = (phase, None if peers is None else tuple(peers))
        args = self._wait_args.get(key)
        if args is None:
            args = self._wait_args[key] = self._make_wait_args(phase, peers)
        listed, counters, pids, n, aborts = args
        if not n:
            return
        why = self._why
        late = self.lib.cn_wait_all(
            counters, pids, n, epoch, self.timeout, why, aborts, WAIT.spin_s, WAIT.yield_s
        )
        if late >= 0:
            self._fail(listed[late], phase, epoch, why.value)

    def _make_wait_args(self, phase: Phase, peers: Sequence[int] | None) -> tuple:
        """The ctypes arrays ``cn_wait_all`` takes for (phase, peers): made once per key, not at
        every wait (building them cost more than a wait that finds its peers arrived)."""
        listed = [p for p in (range(self.size) if peers is None else peers) if p != self.index]
        n = len(listed)
        u64p = ctypes.POINTER(ctypes.c_uint64)
        counters = (u64p * n)(*[ctypes.cast(self._counter(p, phase), u64p) for p in listed])
        pids = (ctypes.c_int32 * n)(*[self.pids[p] for p in listed])
        aborts = (u64p * n)(*[ctypes.cast(self._base[p] + _ABORT_OFFSET, u64p) for p in listed])
        return listed, counters, pids, n, aborts

    def signals(self) -> tuple:
        """Every rank's READY and CONSUMED counters, pids (0 for this rank: never waited for) and
        abort words, as the ctypes arrays ``cn_one_shot`` takes; made once."""
        cached = self._wait_args.get(("signals", None))
        if cached is None:
            u64p = ctypes.POINTER(ctypes.c_uint64)
            ranks = range(self.size)

            def counters(phase: Phase):
                return (u64p * self.size)(*[ctypes.cast(self._counter(p, phase), u64p)
                                            for p in ranks])

            pids = (ctypes.c_int32 * self.size)(
                *[0 if p == self.index else self.pids[p] for p in ranks]
            )
            aborts = (u64p * self.size)(
                *[ctypes.cast(self._base[p] + _ABORT_OFFSET, u64p) for p in ranks]
            )
            cached = (counters(Phase.READY), counters(Phase.CONSUMED), pids, aborts)
            self._wait_args[("signals", None)] = cached
        return cached

    def _fail(self, peer: int, phase: Phase, epoch: int, why: int) -> None:
        """The ``RuntimeFault`` of a wait that gave up on ``peer`` (``why``: cn_wait_all's)."""
        code = int(self.lib.cn_load_acquire(self._base[peer] + _ABORT_OFFSET)) if why == 3 else 0
        raise RuntimeFault(
            wait_cause(why, self.timeout, code=code),
            op="shared memory",
            details=[
                f"waiting for {self.who(peer)} (pid {self.pids[peer]}) to reach "
                f"{phase.name.lower()} epoch {epoch}; it is at {self.value(peer, phase)}",
            ],
            hint="look at the other ranks' output for the first failure; this job cannot "
            "continue: end it (coconet.runtime.shutdown) and restart it",
        )

    def who(self, peer: int) -> str:
        """How an error names member ``peer``: its group rank, and the job's rank where that
        differs (a group along one axis of a mesh)."""
        job = self.ranks[peer]
        return f"group rank {peer}" if job == peer else f"rank {job} (group rank {peer})"

    def aborted(self, peer: int) -> int:
        """``peer``'s abort word: 0 while it goes on, else why it stopped (``abort``'s code)."""
        return int(self.lib.cn_load_acquire(self._base[peer] + _ABORT_OFFSET))

    def abort(self, code: int = ABORTED) -> None:
        """Tell every peer waiting on this rank that it will not post again (its step failed or
        was interrupted, ``ABORTED``; it left the job, ``DEPARTED``): their waits fail at once
        instead of at the deadline. Final."""
        if self._base:
            self.lib.cn_store_release(self._base[self.index] + _ABORT_OFFSET, code)

    def close(self) -> None:
        """Drop this rank's mappings (the memory goes when every rank dropped them)."""
        self._bytes, self._base = [], []
        self._wait_args = {}  # they point into the mappings
        for m in self._maps:
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass  # a tensor still views it: the mapping goes with the last view
        self._maps = []
