"""``ControlChannel``: a communicator's control messages, beside the data its transports move.

The per-step agreement (the handshake's check, the commit vote), the exchanges made once (host
identity, program digests), barriers, the readiness of ranks after a long compile, and the abort
a failing rank sends its peers. Over torch.distributed's default group and store; on one host the
agreement goes over a shared-memory group of its own (microseconds where a gloo round trip costs
milliseconds), which must not be a data group: a vote must not wait behind a step's open epoch (a
published gather stays open until the commit the vote allows).

Waits on torch.distributed work go through ``wait_work``: in slices, looking between them at the
job's store for a peer's abort, so that a peer blocked in a collective with a rank that failed
learns at once instead of at the timeout.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from coconet.errors import RuntimeFault
from coconet.ir import semantics
from coconet.ir.ops import ReduceOp
from coconet.runtime.faults import LEFT, LEFT_HINT, FaultGuard
from coconet.runtime.shmem import CONTROL_WORDS, RoundKind, SharedMemoryTransport
from coconet.runtime.symmem import DEPARTED
from coconet.runtime.transport import Group, WholeWait

__all__ = ["ControlChannel"]

# How long a collective may still take to end after a peer in it left the job, where that peer
# did not say how far it got (no flight recorder: ``ControlChannel._left_after``). A 4-rank gloo
# all_gather whose peers had completed it and left failed a rank with "the ranks made different
# calls" after 2 s, and once after 5 s (CI, 2 cores): a peer's posted position now decides.
LEFT_GRACE_S = 5.0
_LEAST = -(1 << 63)  # the least int64: the padding of a control round (MAX leaves it alone)
# the int type of each element size: how a scalar's bits ride in a control word
_WORD_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ControlChannel:
    """The control messages of one communicator (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: torch.device,
        timeout: float,
        guard: FaultGuard,
        abort_key: str,
        process_group: Any = None,
        root: int = 0,
        job_rank: int | None = None,
    ) -> None:
        self.rank, self.world, self.device, self.timeout = rank, world, device, timeout
        # how this rank names itself to its peers (an abort's reason): by the job's rank, and
        # its group rank where that differs (a communicator along one axis of a mesh)
        job = rank if job_rank is None else job_rank
        self._who = f"rank {rank}" if job == rank else f"rank {job} (group rank {rank})"
        self._guard = guard
        # The torch.distributed group of this communicator's world (None: the default group) and
        # the global rank of its first member (what torch names a broadcast's source by).
        self.process_group, self._root = process_group, root
        # Where a rank whose step failed or was interrupted says so (``abort``); every rank makes
        # its communicators in the same order, so the key names the same one everywhere.
        self._abort_key = self.abort_key = abort_key
        self._store = dist.distributed_c10d._get_default_store() if world > 1 else None
        self._ready_calls = 0
        self._shm: SharedMemoryTransport | None = None
        self._shm_group: Group | None = None  # the agreement's own group, on one host
        self._aborts: list[Group] = []  # shared-memory groups whose abort words this rank sets
        self._pids: dict[int, int] = {}  # the peers on this host: rank -> process id
        # agreement rounds run, and how many of them carried a step's all_reduce (tests and
        # benchmarks read them: what a step's safety costs in rounds)
        self.rounds = 0
        self.carried = 0
        self.exchanges = 0  # full exchanges of objects (an agreement's reports, among others)

    def use_shared_memory(self, transport: SharedMemoryTransport, control: Group) -> None:
        """Agree over ``control``: a shared-memory group of the whole world, of its own."""
        self._shm, self._shm_group = transport, control

    def abort_groups(self, groups: Sequence[Group]) -> None:
        """The shared-memory data groups whose abort words ``abort`` sets."""
        self._aborts = list(groups)

    def close(self) -> None:
        """Hand back the agreement's shared memory (``Communicator.close``)."""
        if self._shm_group is not None:
            self._shm_group.handle.close()

    # -- agreement and exchange -------------------------------------------------------------------

    def agreement(
        self,
        words: Sequence[int],
        payload: torch.Tensor | None = None,
        reduce_op: ReduceOp = ReduceOp.SUM,
        donate: bool = False,
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """The per-step agreement's ``words`` compared over the world, in one round: (the
        largest and the smallest value of each word over the ranks, and ``payload``'s all_reduce
        when it rode along, else None).

        Over shared memory every rank's words are gathered (``words_round``) and a small
        ``payload`` (one ``carries`` accepts) rides along: the step's first all_reduce costs no
        round of its own (``coconet.runtime.handshake.settle_carrying``). The result is the
        caller's to use only where the words say that every rank carried the same payload. On
        torch.distributed the words are one MAX all_reduce of the words and their negations,
        and nothing rides."""
        self.rounds += 1
        if self._shm_group is not None and self.world > 1:
            self.carried += payload is not None
            gathered, result = self._guard(
                "handshake", "agreement", None, self._shm.words_round, words, self._shm_group,
                kind=RoundKind.AGREEMENT, payload=payload, reduce_op=reduce_op, donate=donate,
            )  # fmt: skip
            first = gathered[0]
            if all(g == first for g in gathered):  # the usual case: the same words everywhere
                return first, first, result
            columns = list(zip(*gathered, strict=True))
            return [max(c) for c in columns], [min(c) for c in columns], result
        both = self._max_words(RoundKind.AGREEMENT, [*words, *(-w for w in words)], "agreement",
                               "handshake")  # fmt: skip
        n = len(words)
        return both[:n], [-w for w in both[n:]], None

    def carries(self, payload: torch.Tensor, reduce_op: ReduceOp) -> bool:
        """Whether ``agreement`` would carry ``payload`` (shared memory, a small tensor)."""
        return (
            self._shm_group is not None
            and self.world > 1
            and self._shm.can_carry(payload, self._shm_group, reduce_op)
        )

    def agree_max(self, values: Sequence[int], label: str, op: str = "handshake") -> list[int]:
        """Element-wise MAX over the world of a short int vector (the same length on every rank)."""
        if self._shm_group is not None and self.world > 1:
            # one C call: the words go through shared memory without a tensor
            words = self._shm.all_reduce_words
            return self._guard(op, label, None, words, values, self._shm_group,
                               reduce_op=ReduceOp.MAX)
        if self.world == 1:
            return list(values)
        return self._max_words(RoundKind.WORDS, values, label, op)

    def votes_counted(self, label: str) -> None:
        """After a vote (``agree_max``), before acting on it: wait until every peer has read every
        rank's words of that round, not only posted its own. A peer that posted its vote and then
        gave up waiting for this rank's (its timeout passed: this rank was late) decided not to
        commit and aborted; counting its vote, this rank would commit alone. Over shared memory
        each peer's ``CONSUMED`` of the round says it read them all (a ``RuntimeFault`` when it
        aborted, died or stays silent past the timeout instead). A wait only where the vote was
        late: a peer posts ``CONSUMED`` as it leaves the round.

        On torch.distributed nothing is waited for: a late rank's all_reduce can still complete
        against a peer that timed out in it, and only the peer's abort, when seen between the
        slices of a wait, stops this rank."""
        if self._shm_group is not None and self.world > 1:
            self._guard("commit vote", label, None, self._shm.round_read, self._shm_group)

    def _max_words(self, kind: RoundKind, values: Sequence[int], label: str, op: str
                   ) -> list[int]:  # fmt: skip
        """A control round on torch.distributed: one MAX all_reduce of a fixed number of words
        (its kind and length, each with its negation, then the values and padding), so that
        ranks in different rounds at the same point are told so (a ``RuntimeFault``) instead
        of mismatching sizes, which gloo answers by aborting the process."""
        n = len(values)
        width = 4 + 2 * max(CONTROL_WORDS, self.world)
        if n > width - 4:
            raise ValueError(f"a control round of {n} words: at most {width - 4}")
        t = torch.full((width,), _LEAST, dtype=torch.int64)
        t[:4] = torch.tensor([int(kind), -int(kind), n, -n])
        if n:
            t[4 : 4 + n] = torch.tensor(list(values), dtype=torch.int64)
        t = t.to(self.device)
        work = self._guard(op, label, None, dist.all_reduce, t, op=dist.ReduceOp.MAX,
                           group=self.process_group, async_op=True)  # fmt: skip
        self._guard(op, label, None, self.wait_work, work)
        got = t.tolist()
        if got[0] != -got[1] or got[2] != -got[3]:
            raise RuntimeFault(
                "the ranks are out of step on the control channel: they reached different "
                "control rounds at the same point",
                op="control channel",
                details=[f"value: {label}",
                         f"round kinds {-got[1]}..{got[0]}, lengths {-got[3]}..{got[2]}"],
                hint="every rank must run the same steps in the same order; this job's ranks "
                "have diverged: restart it",
            )
        return got[4 : 4 + n]

    def gather_floats(self, values: Sequence[float], label: str) -> list[list[float]]:
        """Every rank's ``values`` (float64, the same count on every rank), exactly, in rank
        order: one control round (a few microseconds over shared memory) per ``CONTROL_WORDS``
        words, so a caller that reduces them in rank order gets the same bits on every rank.
        Each value's bits ride in a word of their own, the least word in the other ranks'
        places, so the element-wise MAX of ``agree_max`` hands every rank every rank's bits."""
        if self.world == 1:
            return [[float(v) for v in values]]
        # a control round carries at most CONTROL_WORDS words (or one per rank): a few values
        # of every rank per round
        per_round = max(1, max(CONTROL_WORDS, self.world) // self.world)
        every: list[list[float]] = [[] for _ in range(self.world)]
        for start in range(0, len(values), per_round):
            chunk = [float(v) for v in values[start : start + per_round]]
            k = len(chunk)
            words = [_LEAST] * (self.world * k)
            mine = torch.tensor(chunk, dtype=torch.float64).view(torch.int64)
            words[self.rank * k : (self.rank + 1) * k] = mine.tolist()
            got = self.agree_max(words, label, op="gather")
            rows = torch.tensor(got, dtype=torch.int64).view(torch.float64).view(self.world, k)
            for r, row in enumerate(rows.tolist()):
                every[r].extend(row)
        return every

    def all_reduce_scalar(self, x: torch.Tensor, reduce_op: ReduceOp, label: str
                          ) -> torch.Tensor:  # fmt: skip
        """The all_reduce of a scalar of at most 8 bytes over the world, in one control round:
        every rank's value gathered exactly (its bits, one word per rank) and reduced here in
        rank order, as the simulator reduces: the same bits on every rank."""
        size = x.element_size()
        bits = int(x.detach().reshape(()).view(_WORD_OF_SIZE[size]).item())
        # a word per rank: this rank's bits in its own (unsigned below 8 bytes), the least word
        # elsewhere, so the element-wise MAX of the agreement hands every rank every rank's
        # bits unchanged
        words = [_LEAST] * self.world
        words[self.rank] = bits if size == 8 else bits & ((1 << 8 * size) - 1)
        got = self.agree_max(words, label, op="all_reduce")
        raw = torch.tensor(got, dtype=torch.int64).view(torch.uint8).view(self.world, 8)
        low = slice(0, size) if sys.byteorder == "little" else slice(8 - size, 8)  # its bits
        values = raw[:, low].contiguous().view(x.dtype).view(self.world, *x.shape)
        return semantics.reduce_values(reduce_op, list(values.to(x.device).unbind(0)))

    def max_over_world(self, values: Sequence[float], label: str) -> list[float]:
        """Element-wise MAX over the world of a short float vector (same length everywhere)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.world > 1 and len(values):
            self._guard("all_reduce", label, None, dist.all_reduce, t, op=dist.ReduceOp.MAX,
                        group=self.process_group)  # fmt: skip
        return t.tolist()

    def exchange(self, obj: Any, label: str) -> list[Any]:
        """Every rank's ``obj`` (any picklable value, of any size), in rank order."""
        if self.world == 1:
            return [obj]
        self.exchanges += 1
        out: list[Any] = [None] * self.world
        self._guard("handshake", label, None, dist.all_gather_object, out, obj,
                    group=self.process_group)  # fmt: skip
        return out

    def broadcast_object(self, obj: Any, label: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        self._guard("setup", label, None, dist.broadcast_object_list, box, src=self._root,
                    group=self.process_group)  # fmt: skip
        return box[0]

    def barrier(self, label: str = "barrier") -> None:
        if self.world > 1:
            self._guard("barrier", label, None, dist.barrier, group=self.process_group)

    def aligned_start(self, label: str) -> None:
        """A barrier that lets every rank go at about the same instant, for timing.

        torch.distributed's barrier releases the ranks up to milliseconds apart on a VM (a
        rank that waited in it had its vCPU halted and is woken late: median 20 us, p90 3.9
        ms when the ranks did unequal work before it, ``benchmarks/data_parallel_adam.py``);
        the rank that left first then waits for the late one inside whatever is timed. Over
        shared memory two word rounds follow the barrier: their waiters poll with
        ``sched_yield`` (``symmem.WaitPolicy``), so nobody is asleep when the last rank
        arrives; the first round takes up the barrier's skew, the second a sleeping waiter's
        wake-up. Elsewhere it is the barrier alone."""
        self.barrier(label)
        if self._shm_group is not None and self.world > 1:
            for _ in range(2):
                self.agree_max([0], label, op="barrier")

    # -- long work outside any collective: compiling, then readiness -----------------------------

    def set_peer_pids(self, pids: dict[int, int]) -> None:
        """The process ids of the peers on this host, by rank (watched during long waits)."""
        self._pids = dict(pids)

    def peer_pids(self) -> dict[int, int]:
        """The process ids of the peers on this host, by rank."""
        return dict(self._pids)

    def run_watched(self, fn: Callable[[], None], label: str, deadline_s: float) -> None:
        """Run ``fn`` (work outside any collective that may take long, such as compiling a
        step's kernels) on a thread of its own while this one watches the peers: one that dies
        (on this host: its process is gone; elsewhere: its heartbeat stops for the
        communicator's timeout) or aborts is a ``RuntimeFault`` at once, not when ``fn`` is
        done. ``fn``'s own exception is raised here. A Ctrl-C lands here, on the main thread,
        and ends the wait at once (``fn``'s thread is a daemon: it dies with the process)."""
        if self._store is None:
            fn()
            return
        failure: list[BaseException] = []

        def work() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the watching thread
                failure.append(exc)

        worker = threading.Thread(target=work, name=f"coconet: {label}", daemon=True)
        worker.start()
        self._watch(label, deadline_s, lambda: not worker.is_alive())
        worker.join()
        if failure:
            raise failure[0]

    def agree_ready(self, label: str, deadline_s: float) -> None:
        """Wait until every rank has called ``agree_ready`` with the same label, for up to
        ``deadline_s`` seconds (not the communicator's timeout: it is for work that may take
        long, such as compiling a step's kernels, done outside any collective). Through the
        job's store, watching the peers as ``run_watched`` does."""
        if self._store is None:
            return
        self._ready_calls += 1
        key = f"{self._abort_key}/ready/{self._ready_calls}"
        everyone = [f"{key}/{r}" for r in range(self.world)]

        def all_ready() -> bool:
            try:
                return self._store.check(everyone)
            except (RuntimeError, OSError):
                self.check_peers()  # the store is gone: a RuntimeFault that says so
                raise

        self._guard("readiness", label, None, self._store.set, f"{key}/{self.rank}", label)
        self._watch(label, deadline_s, all_ready)

    def _watch(self, label: str, deadline_s: float, done: Callable[[], bool]) -> None:
        """Wait until ``done()``, for up to ``deadline_s`` seconds, beating this rank's heart in
        the store and looking at the peers between looks: a peer that aborted, died on this host,
        or whose heartbeat stood still for the communicator's timeout is a ``RuntimeFault``."""
        pids = self.peer_pids()
        started = time.monotonic()
        give_up = started + deadline_s
        beats = _Heartbeats(self._store, self._abort_key, self.rank, self.world, started)
        pause = 0.001
        while not done():
            beats.beat()
            self.check_peers()
            now = time.monotonic()
            dead = [r for r, pid in pids.items() if not _alive(pid)]
            silent = [] if dead else beats.silent_for(self.timeout, now)
            if dead or silent or now > give_up:
                self._guard.broken = f"ranks not ready: {label}"
                if dead:
                    cause = f"rank(s) {dead} died"
                elif silent:
                    cause = f"rank(s) {silent} gave no sign of life for {self.timeout:g} s"
                else:
                    cause = f"not every rank was ready in {deadline_s:g} s"
                raise RuntimeFault(
                    f"{cause}: {label}",
                    op="readiness",
                    details=[f"on rank {self.rank} of {self.world}"],
                    hint="look at the other ranks' output; this job cannot continue: end it "
                    "(coconet.runtime.shutdown) and restart it",
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    # -- aborts ------------------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Mark the communicator broken and tell every peer at once, not at their timeout: a
        step failed or was interrupted here mid-way (peers may be inside a collective this rank
        will never finish). Over shared memory the peers' waits see this rank's abort word; on
        torch.distributed they look at the job's store between slices of their waits."""
        if self._guard.broken is None:
            self._guard.broken = reason
        for group in self._aborts:
            group.handle.abort()
        if self._shm_group is not None:
            self._shm_group.handle.abort()
        if self._store is not None:
            try:
                self._store.set(self._abort_key, f"{self._who}: {reason}")
            except (RuntimeError, OSError):
                pass  # the store is gone (its host died): the peers learn from that
        self._post_position(f"it aborted: {reason}")

    def positions(self, mine: str, grace_s: float) -> dict[int, str | None]:
        """Where every peer is, when a call failed here: this rank posts ``mine`` (its flight
        recorder's last call) in the job's store and reads what each peer posted (a peer that
        failed too, or aborted) for up to ``grace_s`` seconds. By the peer's rank here; None: no
        answer (it had not failed: stalled elsewhere, or dead). A peer on this host whose
        process is gone is not waited for: it is "dead". Empty without a store."""
        if self._store is None or self.world == 1:
            return {}
        prefix = f"{self._abort_key}/position/"
        dead = {r for r, pid in self._pids.items() if not _alive(pid)}
        missing = {r: f"{prefix}{r}" for r in range(self.world) if r != self.rank}
        found: dict[int, str | None] = dict.fromkeys(dead, "dead: its process is gone")
        for r in dead:
            missing.pop(r, None)
        try:
            self._store.set(f"{prefix}{self.rank}", mine)
            deadline = time.monotonic() + grace_s
            while missing:
                for r, key in list(missing.items()):
                    if self._store.check([key]):
                        found[r] = self._store.get(key).decode()
                        del missing[r]
                if not missing or time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        except (RuntimeError, OSError):
            pass  # the store is gone (its host died): what was read so far
        return {**found, **dict.fromkeys(missing)}

    def _post_position(self, note: str) -> None:
        """Post this rank's position (its flight recorder's last call) for its peers: those
        that fail while it aborts (``positions``), and those still waiting in a call when it
        leaves (``_left_after``)."""
        recorder = self._guard.recorder
        if recorder is None or self._store is None:
            return
        try:
            self._store.set(f"{self._abort_key}/position/{self.rank}",
                            f"{recorder.position()}, then {note}")  # fmt: skip
        except (RuntimeError, OSError):
            pass

    def check_peers(self, reason: str | None = None) -> None:
        """A ``RuntimeFault`` if a peer aborted (see ``abort``) or left the job (``depart``):
        as ``reason`` says when given (what ``_peer_word`` read), else as the store says now."""
        if self._store is None:
            return
        if reason is None:
            reason = self._peer_word()
        if reason is not None:
            self._guard.broken = f"a peer aborted: {reason}"
            left = LEFT in reason
            raise RuntimeFault(
                "a peer rank left the job while this rank waits for it: the ranks made "
                "different calls" if left else
                "a peer rank aborted its step (it failed or was interrupted)",
                op="communicator",
                details=[f"on rank {self.rank} of {self.world}", f"the peer said: {reason}"],
                hint=LEFT_HINT if left else "look at that rank's output for its failure; this "
                "job cannot continue: end it (coconet.runtime.shutdown) and restart it",
            )

    def _peer_word(self) -> str | None:
        """What a peer that aborted or left said, or that the store is gone; None if neither."""
        try:
            aborted = self._store.check([self._abort_key])
            return self._store.get(self._abort_key).decode() if aborted else None
        except (RuntimeError, OSError) as exc:
            return f"the job's store is unreachable (rank 0 died?): {exc}"

    def peer_reason(self) -> str | None:
        """What a peer that aborted or left said (``abort``, ``depart``), None if none did."""
        if self._store is None:
            return None
        try:
            if self._store.check([self._abort_key]):
                return self._store.get(self._abort_key).decode()
        except (RuntimeError, OSError):
            pass
        return None

    def depart(self, note: str) -> None:
        """This rank leaves the job: it makes no more calls on this communicator but the way
        out (``coconet.runtime.shutdown``'s barrier, through the store). A peer still waiting
        for it (it made one call more: a data loader one batch longer on that rank) fails at
        once, told which calls this rank made (``note``), not at its timeout. Unlike ``abort``
        this communicator is not marked broken, and a peer that is not waiting for this rank
        (every rank made the same calls) never notices."""
        for group in self._aborts:
            group.handle.abort(DEPARTED)
        if self._shm_group is not None:
            self._shm_group.handle.abort(DEPARTED)
        self._post_position(LEFT)  # (before the word: a peer that reads it finds where)
        if self._store is not None:
            try:
                self._store.set(self._abort_key, f"{self._who} {LEFT} {note}")
            except (RuntimeError, OSError):
                pass  # the store is gone (rank 0 left first): nobody is left to tell

    def store_barrier(self, label: str, deadline_s: float) -> None:
        """A barrier through the job's store only: what ranks that have left (``depart``) meet
        at, which their abort words cannot trip. A peer that aborted instead of coming, died (on
        this host: its process is gone; elsewhere: its heartbeat stood still for the
        communicator's timeout) or is late past ``deadline_s`` is a ``RuntimeFault``."""
        if self._store is None:
            return
        key = f"{self._abort_key}/{label}"
        try:
            self._store.set(f"{key}/{self.rank}", "1")
            self._await([f"{key}/{r}" for r in range(self.world)], label, deadline_s)
            # The job's store lives in rank 0's process: rank 0 leaves last, once every rank
            # is done with the store (a rank still polling it when rank 0's process ends gets a
            # reset connection, which torch's C++ logs as a stack dump)
            self._store.set(f"{key}/done/{self.rank}", "1")
            if self.rank == 0:
                self._await([f"{key}/done/{r}" for r in range(self.world)], label,
                            min(deadline_s, 5.0))  # fmt: skip
        except (RuntimeError, OSError) as exc:
            raise RuntimeFault(
                f"the job's store went away before every rank reached {label!r} (rank 0 left?)",
                op="store barrier",
                details=[f"on rank {self.rank} of {self.world}", str(exc).splitlines()[0][:200]],
                hint="look at the other ranks' output",
            ) from exc

    def _await(self, keys: list[str], label: str, deadline_s: float) -> None:
        """Poll the store until every one of ``keys`` (one per rank, in rank order) is set,
        watching the peers (a departure is not a failure here: the ranks that meet have all
        left)."""
        pids = self.peer_pids()
        started = time.monotonic()
        beats = _Heartbeats(self._store, self._abort_key, self.rank, self.world, started)
        pause = 0.001
        while not self._store.check(keys):
            beats.beat()
            now = time.monotonic()
            reason = self.peer_reason()
            # a peer gone (or silent) after it set its key is not a failure: it got here and
            # left (the ranks leave as they pass the barrier)
            dead = [r for r, pid in pids.items()
                    if not _alive(pid) and not self._store.check([keys[r]])]  # fmt: skip
            silent = [] if dead else [r for r in beats.silent_for(self.timeout, now)
                                      if not self._store.check([keys[r]])]  # fmt: skip
            if (reason is not None and LEFT not in reason) or dead or silent or (
                now > started + deadline_s
            ):
                cause = (f"a peer rank aborted ({reason})" if reason is not None and LEFT not in
                         reason else f"rank(s) {dead} died" if dead else
                         f"rank(s) {silent} gave no sign of life for {self.timeout:g} s" if silent
                         else f"not every rank came within {deadline_s:g} s")  # fmt: skip
                raise RuntimeFault(
                    f"{cause}: {label}",
                    op="store barrier",
                    details=[f"on rank {self.rank} of {self.world}"],
                    hint="look at the other ranks' output",
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def wait_work(self, work) -> None:
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
            self.check_peers()
            work.wait(datetime.timedelta(seconds=self.timeout))
            return
        deadline = time.monotonic() + self.timeout
        wait_s = 0.01
        joined = False  # every peer that left had made this call (``_left_after``)
        while True:
            try:
                work.wait(datetime.timedelta(seconds=wait_s))
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
            wait_s = min(2 * wait_s, 0.2)
            # (read once: a peer that leaves between two reads would be taken for one that
            # left before this collective ended)
            reason = self._peer_word()
            if reason is None or (joined and LEFT in reason):
                continue
            if LEFT in reason:
                # A peer leaves after its last call. Where it said how far it got (its flight
                # recorder's position, posted before it left), that decides: a peer that made
                # this call left it complete on its side (gloo's ring hands a rank the whole
                # result before the last bytes reach a slower peer), so this rank's part ends
                # once those bytes arrive, or fails at the timeout as any call; a peer that
                # left before it never will join it: the fault at once.
                joined = self._left_after()
                if joined:
                    continue
                if joined is None:  # no position (no flight recorder): a grace, then the fault
                    grace = max(0.0, min(LEFT_GRACE_S, deadline - time.monotonic()))
                    began = time.monotonic()
                    try:
                        work.wait(datetime.timedelta(seconds=grace))
                        return
                    except RuntimeError as exc:
                        if "timed out" not in str(exc).lower():
                            raise  # the collective failed here: its own error, not a guess
                    reason += (f" (this rank's part of the collective had not ended "
                               f"{time.monotonic() - began:.1f} s after it saw that)")  # fmt: skip
            self.check_peers(reason)

    def _left_after(self) -> bool | None:
        """Whether every peer that left the job (``depart``) had made this rank's current call
        on this communicator: True; one that had not: False; None where no peer that left said
        how far it got (it keeps no flight recorder), or the store cannot say."""
        recorder = self._guard.recorder
        if recorder is None or self._store is None:
            return None
        prefix = f"{self._abort_key}/position/"
        found = None
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                if not self._store.check([f"{prefix}{r}"]):
                    continue
                said = self._store.get(f"{prefix}{r}").decode()
            except (RuntimeError, OSError):
                return None
            if not said.endswith(f"then {LEFT}"):
                continue  # a peer that aborted: its word says so (check_peers)
            if said.startswith("no call yet"):
                return False
            number = said[1:].split(" ", 1)[0]  # "#<call> <op>: <label> (<state>), then ..."
            if not number.isdigit():
                return None
            if int(number) < recorder.seq:
                return False
            found = True
        return found


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


class _Heartbeats:
    """Each rank's heartbeat in the job's store during a long wait (``ControlChannel._watch``):
    a counter it raises at every look; a peer whose counter stands still, or never appears, for
    the communicator's timeout is silent (dead or frozen on another host, where its process
    cannot be watched)."""

    def __init__(self, store, prefix: str, rank: int, world: int, started: float) -> None:
        self._store, self._rank = store, rank
        self._keys = {r: f"{prefix}/beat/{r}" for r in range(world)}
        self._count = 0
        self._seen: dict[int, tuple[bytes | None, float]] = {
            r: (None, started) for r in range(world) if r != rank
        }
        self._next_look = started

    def beat(self) -> None:
        self._count += 1
        try:
            self._store.set(self._keys[self._rank], str(self._count))
        except (RuntimeError, OSError):
            pass  # the store is gone: check_peers says so

    def silent_for(self, seconds: float, now: float) -> list[int]:
        """The peers whose heartbeat has not moved for ``seconds`` (looked at every 0.5 s)."""
        if now < self._next_look:
            return []
        self._next_look = now + 0.5
        silent = []
        for r, (last, since) in self._seen.items():
            try:
                key = self._keys[r]
                value = self._store.get(key) if self._store.check([key]) else None
            except (RuntimeError, OSError):
                return []  # the store is gone: check_peers says so
            if value != last:
                self._seen[r] = (value, now)
            elif now - since > seconds:
                silent.append(r)
        return silent
