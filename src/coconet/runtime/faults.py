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

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from coconet.errors import RuntimeFault

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

    def __call__(self, op: str, label: str, axis: str | None, fn: Callable, /, *args, **kwargs):
        """``fn(*args, **kwargs)``; a failure of the job is a ``RuntimeFault`` (see the module)."""
        self.check(op, label)
        try:
            return fn(*args, **kwargs)
        except RuntimeFault as fault:
            self._add_reason(fault)
            raise
        except Exception as exc:
            if not is_peer_failure(exc):
                raise  # a bug raises as a bug
            raise self.fault(op, label, axis, exc) from exc

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
