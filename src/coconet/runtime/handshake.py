"""The start-of-step handshake: ranks agree on the program and their inputs before communicating.

Ranks that run different programs, or pass inputs of mismatched sizes, would issue collectives
that do not line up; on gloo a size mismatch aborts the process from C++ (MACHINE-NOTES), beyond
any Python error handling. So before the step's first collective every rank contributes a short
fixed-size vector to one MAX all_reduce (which cannot mismatch):

    [identity hash, -identity hash, "I need a full exchange", "my inputs failed their check"]

Equal hashes on every rank show as max(h) == -max(-h). When the hashes differ, a rank's input
shapes changed (or it is the first step), or a rank found a bad input, every rank learns it from
the same reduced vector and they all take part in a full exchange of ``RankReport``s (pickled
objects of any size, ``all_gather_object``). From the same reports every rank reaches the same
verdict: the global sizes, or one ``RuntimeFault`` naming the difference, raised on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from coconet.codegen.geometry import bind_sizes
from coconet.errors import RuntimeFault
from coconet.ir.mesh import Mesh
from coconet.ir.program import Program

__all__ = ["RankReport", "identity_hash", "settle", "verdict"]

_MASK = (1 << 62) - 1


@dataclass(frozen=True)
class RankReport:
    """What one rank is about to run: identity fields that must be equal, and its inputs."""

    rank: int
    identity: tuple[tuple[str, str], ...]  # (field, value), e.g. ("program digest", "3fa1...")
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    error: str | None = None


def identity_hash(identity: Sequence[tuple[str, str]]) -> int:
    text = "\x00".join(f"{k}={v}" for k, v in identity)
    return int(hashlib.sha256(text.encode()).hexdigest()[:16], 16) & _MASK


def settle(comm, report: RankReport, need_exchange: bool) -> list[RankReport] | None:
    """Run the handshake; the reports of every rank when a full exchange happened, else None.

    Every rank must call it at the same point of the step (before any other collective).
    """
    h = identity_hash(report.identity)
    flags = comm.agree_max([h, -h, int(need_exchange), int(report.error is not None)], "hash")
    same = flags[0] == -flags[1]
    if same and not flags[2] and not flags[3]:
        return None
    return comm.exchange(report, "input shapes")


def verdict(reports: Sequence[RankReport], program: Program, mesh: Mesh) -> dict[str, int]:
    """The global Dim sizes, or a ``RuntimeFault`` (the same on every rank) naming the problem."""
    first = reports[0]
    for r in reports[1:]:
        if r.identity != first.identity:
            mine, theirs = dict(first.identity), dict(r.identity)
            diffs = [
                f"{k}: rank 0 has {mine.get(k)!r}, rank {r.rank} has {theirs.get(k)!r}"
                for k in dict.fromkeys([*mine, *theirs])
                if mine.get(k) != theirs.get(k)
            ]
            raise RuntimeFault(
                "ranks are running different programs",
                op="handshake",
                details=diffs,
                hint="every rank must compile the same program and schedule with the same "
                "coconet and options",
            )
    errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error is not None]
    if errors:
        raise RuntimeFault(
            "bad inputs (checked on every rank before any communication)",
            op=f"{program.name} step",
            details=errors,
            hint="fix the inputs named above; nothing was communicated or updated",
        )
    dtypes = [
        f"input {name!r} is {r.dtypes[name]} on rank {r.rank} but {first.dtypes[name]} on rank 0"
        for r in reports[1:]
        for name in r.dtypes
        if r.dtypes[name] != first.dtypes.get(name)
    ]
    sizes, problems = bind_sizes(program, mesh, [r.shapes for r in reports])
    if dtypes or problems:
        raise RuntimeFault(
            "the ranks' input shapes do not fit the program together",
            op=f"{program.name} step",
            details=dtypes + problems,
            hint="Local and Replicated inputs have the global shape on every rank; a Sliced "
            "input holds this rank's torch.tensor_split part along its sliced dim",
        )
    return sizes
