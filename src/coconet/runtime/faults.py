"""``FaultGuard``: what turns a transport's failure into a ``RuntimeFault``, and only that.

Every collective, control message and shared-memory call of a communicator runs under its guard.
A failure of the job — a peer that died (its connections close, its signals stay unposted), a
peer that stalled (the deadline trips), a store that went away — becomes a ``RuntimeFault``
naming the collective, the value it computed and the likely cause, and marks the communicator
broken: a group that failed mid-collective cannot line up again, so later calls are refused.

Anything else is a bug (in coconet, or a bad value that slipped past the checks) and raises as
what it is, with its own traceback: a ``ValueError`` from a shape, or a ``RuntimeError`` that no
transport wrote, is not reported as a dead peer, and does not break the communicator (the step
that called still aborts and tells its peers, ``coconet.runtime.step``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from coconet import tracing
from coconet.errors import RuntimeFault, capture_loc
from coconet.runtime import flight
from coconet.runtime.flight import FlightRecorder

_now = time.perf_counter_ns
_STARTED, _COMPLETED = flight.STARTED, flight.COMPLETED

__all__ = ["LEFT", "LEFT_HINT", "FaultGuard", "is_peer_failure"]

# How a rank that left the job says so (``ControlChannel.depart``), and what to do about it.
LEFT = "left the job"
LEFT_HINT = ("every rank must make the same calls (the same number of optimizer steps, layer "
             "calls, collectives): give every rank the same number of batches (drop_last=True, a "
             "DistributedSampler), or stop every rank at the same step")

# What torch.distributed's backends and stores write when the job, not the caller, failed.
_TRANSPORT_WORDS = (
    "timed out",
    "timeout",
    "closed",
    "reset by peer",
    "broken pipe",
    "eof",
    "connection",
    "socket",
    "gloo",
    "nccl",
    "store",
    "peer",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the job failed (a peer, the network or the store), not the caller:
    torch.distributed's own errors, the operating system's connection errors, and the runtime
    errors its backends raise, which name their transport or the connection."""
    if isinstance(exc, (dist.DistError, OSError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(w in text for w in _TRANSPORT_WORDS)
    return False


class FaultGuard:
    """Runs a communicator's calls, turning the job's failures into ``RuntimeFault``."""

    def __init__(
        self,
        rank: int,
        world: int,
        backend: str,
        timeout: float,
        ranks_of: Callable[[str | None], Sequence[int]],
    ) -> None:
        self.rank, self.world, self.backend, self.timeout = rank, world, backend, timeout
        self._ranks_of = ranks_of  # the ranks of this rank's group along an axis
        self.broken: str | None = None  # why the communicator refuses further work
        # what a peer that aborted or left said (the control channel reads it from the store),
        # added to a shared-memory wait's fault, which sees only the peer's abort word
        self.explain: Callable[[], str | None] | None = None
        # the last calls (coconet.runtime.flight), and how to learn where the peers are when a
        # call fails (ControlChannel.positions: rank -> its position, None: no answer)
        self.recorder: FlightRecorder | None = None
        self.positions: Callable[[str, float], dict[int, str | None]] | None = None
        self._reported = False  # a failure's verdict and dump are made once

    def __call__(self, op: str, label: str, axis: str | None, fn: Callable, /, *args, **kwargs):
        """``fn(*args, **kwargs)``; a failure of the job is a ``RuntimeFault`` (see the module).
        Traced as a span of ``op``'s category (``coconet.runtime.tracing``)."""
        if tracing.active():
            with tracing.span(op, tracing.category_of(op), label,
                              self._call_args(axis, _span_args(axis, args))):  # fmt: skip
                return self._run(op, label, axis, fn, args, kwargs)
        return self._run(op, label, axis, fn, args, kwargs)

    def collective(self, op: str, label: str, axis: str | None, nbytes: int, transport: Any,
                   fn: Callable, /, *args):  # fmt: skip
        """``fn(*args)``: starting the collective ``op`` of ``nbytes`` over ``transport``, as
        ``__call__`` (traced with its bytes and its transport's kind)."""
        if tracing.active():
            kind = getattr(getattr(transport, "kind", None), "value", None)
            found = self._call_args(axis, {"axis": axis, "bytes": nbytes, "transport": kind})
            with tracing.span(op, tracing.Category.COLLECTIVE, label, found):
                return self._run(op, label, axis, fn, args, {})
        return self._run(op, label, axis, fn, args, {})

    def _call_args(self, axis: str | None, found: dict[str, Any]) -> dict[str, Any]:
        """``found`` (a traced call's span arguments) with the call's number on this
        communicator and its group's ranks: the same call on every rank of the group, which
        ``coconet.trace.merge`` lines up (who started it last). Traced calls only."""
        recorder = self.recorder
        if recorder is not None:
            found.update(comm=recorder.name, call=recorder.seq + 1,
                         group=list(self._ranks_of(axis)))  # fmt: skip
        return found

    def wait(self, op: str, label: str, axis: str | None, fn: Callable, /, *args):
        """``fn(*args)``: the wait for a started collective ``op``, as ``__call__`` (traced as a
        wait: how long this rank waited for its peers)."""
        if tracing.active():
            with tracing.span(f"wait {op}", tracing.Category.WAIT, label, _span_args(axis, ())):
                return self._run(op, label, axis, fn, args, {})
        return self._run(op, label, axis, fn, args, {})

    def _run(self, op: str, label: str, axis: str | None, fn: Callable, args: tuple,
             kwargs: dict):  # fmt: skip
        if self.broken is not None:
            self.check(op, label)
        recorder = self.recorder
        slot = -1
        if recorder is not None:  # a call begins (FlightRecorder's layout): at every call
            seq = recorder.seq = recorder.seq + 1
            slot = seq % recorder.capacity
            recorder.seqs[slot] = seq
            recorder.ops[slot], recorder.labels[slot], recorder.axes[slot] = op, label, axis
            recorder.states[slot] = _STARTED
            recorder.starts[slot] = _now()
        try:
            out = fn(*args, **kwargs)
        except RuntimeFault as fault:
            if slot >= 0:
                recorder.end(slot, flight.FAILED)
            self._add_reason(fault)
            self._report(fault, slot)
            raise
        except Exception as exc:
            if slot >= 0:
                recorder.end(slot, flight.FAILED)
            if not is_peer_failure(exc):
                raise  # a bug raises as a bug
            fault = self.fault(op, label, axis, exc)
            self._report(fault, slot)
            raise fault from exc
        if slot >= 0:
            recorder.states[slot] = _COMPLETED  # (no end time: see FlightRecorder)
        return out

    def _report(self, fault: RuntimeFault, slot: int) -> None:
        """The first failure of this communicator: where the peers are (the ranks that have not
        reached this call), the user's line that made it, and the flight recorder's dump, added
        to the fault. Never raises: a failure is being reported."""
        if self._reported or self.recorder is None or slot < 0:
            return
        self._reported = True
        entry = self.recorder.call(slot)
        try:
            lines = [f"flight recorder: call #{entry[0]} of this communicator ({entry[1]}: "
                     f"{entry[2]})" + (f", made at {loc}" if (loc := capture_loc()) else "")]
            lines += self._peers(entry)
            path = flight.dump(self.recorder.members[self.rank], len(self.recorder.members),
                               f"{fault.op}: {fault.args[0] if fault.args else fault}")
            lines.append(f"flight recorder dump: {path} (every rank's: coconet trace why "
                         f"{path.parent})")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the fault itself must still be raised
            lines = [f"flight recorder: no verdict ({type(exc).__name__}: {exc})"]
        fault.details = (*fault.details, *lines)

    def _peers(self, entry: tuple[int, str, str]) -> list[str]:
        """Where each peer is, as it said in the job's store (``positions``)."""
        if self.positions is None or len(self.recorder.members) == 1:
            return []
        # the peers that failed too post within milliseconds of this rank (their waits end
        # alike); a stalled one never does: how long it is waited for delays this error
        grace = min(1.0, max(0.25, self.timeout / 20))
        seen = self.positions(self.recorder.position(), grace)
        members = self.recorder.members
        lines = []
        for peer in sorted(seen):
            said = seen[peer]
            who = f"rank {members[peer]}" + ("" if members[peer] == peer else
                                             f" (group rank {peer})")  # fmt: skip
            if said is None:
                lines.append(f"{who}: no answer within {grace:g} s: it had not reached call "
                             f"#{entry[0]} ({entry[1]}: {entry[2]}), stalled or dead")
            elif said.startswith("dead"):
                lines.append(f"{who}: {said}: it had not reached call #{entry[0]} ({entry[1]}: "
                             f"{entry[2]})")
            else:
                lines.append(f"{who}: at {said}")
        return lines

    def _add_reason(self, fault: RuntimeFault) -> None:
        """A peer's own words (its abort reason, or which calls it made before it left) on a
        fault that saw only its abort word."""
        if self.explain is None or fault.op != "shared memory" or getattr(fault, "explained",
                                                                           False):  # fmt: skip
            return
        reason = self.explain()
        fault.explained = True
        if reason is None:
            return
        fault.details = (*fault.details, f"the peer said: {reason}")
        if LEFT in reason:
            fault.hint = LEFT_HINT

    def check(self, op: str = "communicator", label: str = "") -> None:
        """A ``RuntimeFault`` when an earlier failure broke the communicator."""
        if self.broken is not None:
            raise RuntimeFault(
                f"the communicator is unusable after an earlier failure ({self.broken})",
                op=op,
                details=[f"value: {label}", f"rank {self.rank} of {self.world}"],
                hint="end this job (coconet.runtime.shutdown) and start it again",
            )

    def fault(self, op: str, label: str, axis: str | None, exc: BaseException) -> RuntimeFault:
        """The ``RuntimeFault`` for the job's failure ``exc`` in ``op`` (marks the communicator
        broken)."""
        text = str(exc)
        low = text.lower()
        if "timed out" in low or "timeout" in low:
            cause = f"no answer within {self.timeout:g} s: a peer rank stalled or died"
        elif any(s in low for s in ("closed by peer", "reset by peer", "broken pipe", "eof")):
            cause = "a peer rank died: its connection closed"
        else:
            cause = "communication failed"
        self.broken = cause
        try:
            ranks: list[Any] = list(self._ranks_of(axis))
        except Exception:  # noqa: BLE001 - an axis the mesh lacks: the fault says so by []
            ranks = []
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return RuntimeFault(
            cause,
            op=op,
            details=[
                f"value: {label}",
                f"on rank {self.rank} of {self.world}, group along axis {axis!r}: ranks {ranks}",
                f"backend ({self.backend}) said: {first[:300]}",
            ],
            hint="look at the other ranks' output for the first failure; this job cannot "
            "continue: end it (coconet.runtime.shutdown) and restart it",
        )


def _span_args(axis: str | None, args: tuple) -> dict[str, Any]:
    """A traced call's arguments in the trace: its axis and the bytes of its first tensor."""
    out: dict[str, Any] = {"axis": axis}
    for a in args:
        if isinstance(a, torch.Tensor):
            out["bytes"] = a.numel() * a.element_size()
            break
    return out
