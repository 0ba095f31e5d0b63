"""The start-of-step handshake: ranks agree on the program and their inputs before communicating.

Ranks that run different programs, or pass inputs of mismatched sizes, would issue collectives
that do not line up; on gloo a size mismatch aborts the process from C++ (SIGABRT from
``gloo::EnforceNotMet``), beyond any Python error handling. So before the step's first
collective, at every step, every rank contributes a short fixed-size vector to one MAX
all_reduce (which cannot mismatch):

    [identity hash, -identity hash, call, -call, "I need a full exchange", "my inputs failed"]

The identity is the compiled step's (program, schedule, mesh, every option that changes the
collectives or the numerics); ``call`` counts this rank's calls of steps with that identity, so a
rank that skipped or repeated a step is caught at the next one instead of pairing its step t with
a peer's step t+1. Equal values on every rank show as max(x) == -max(-x). When the hashes or
the calls differ, a rank's input shapes changed (or it is the first step), or a rank found a bad
input, every rank learns it from the same reduced vector and they all take part in a full
exchange of ``RankReport``s (pickled objects of any size, ``all_gather_object``). From the same
reports every rank reaches the same verdict: the global sizes, or one ``RuntimeFault`` naming
the difference, raised on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
    call: int = 0  # this call's number among the calls of this compiled step (from 1)
    ordinal: int = 0  # which compiled step of this identity it is, on this communicator
    # The Replicated inputs that must be equal on every rank, as compared: the scalars' exact
    # values, and with check_replicated a checksum of each Replicated tensor.
    replicated: dict[str, str] = field(default_factory=dict)


def identity_hash(identity: Sequence[tuple[str, str]]) -> int:
    text = "\x00".join(f"{k}={v}" for k, v in identity)
    return int(hashlib.sha256(text.encode()).hexdigest()[:16], 16) & _MASK


def settle(
    comm, report: RankReport, need_exchange: bool, identity: int | None = None
) -> list[RankReport] | None:
    """Run the handshake; the reports of every rank when a full exchange happened, else None.
    ``identity``: ``identity_hash(report.identity)`` when the caller has it (a compiled step
    keeps it: hashing the identity at every step cost more than a small step's agreement).

    Every rank must call it at the same point of the step (before any other collective).
    A world of one has nobody to agree with: its own report decides, without hashing.
    """
    if comm.world == 1:
        return [report] if need_exchange or report.error is not None else None
    agreed = [
        identity_hash(report.identity) if identity is None else identity,
        report.ordinal,
        report.call,
        _replicated_hash(report.replicated),
    ]
    a, b, c, d = agreed
    flags = comm.agree_max(
        [a, b, c, d, -a, -b, -c, -d, int(need_exchange), int(report.error is not None)], "hash"
    )
    # equal everywhere: max(x) == -max(-x), for each of the four; and no flag raised
    if flags[:4] == [-f for f in flags[4:8]] and not flags[8] and not flags[9]:
        return None
    return comm.exchange(report, "input shapes")


_REPLICATED: dict[tuple, int] = {}  # the last few replicated values' hashes (by their items)


def _replicated_hash(replicated: Mapping[str, str]) -> int:
    """``identity_hash`` of the sorted Replicated values, remembered for the few last seen (an
    optimizer's scalars mostly stay the same from one step to the next)."""
    items = tuple(sorted(replicated.items()))
    h = _REPLICATED.get(items)
    if h is None:
        if len(_REPLICATED) > 256:
            _REPLICATED.clear()
        h = _REPLICATED[items] = identity_hash(items)
    return h


def verdict(
    reports: Sequence[RankReport],
    program: Program,
    mesh: Mesh,
    sources: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """The global Dim sizes, or a ``RuntimeFault`` (the same on every rank) naming the problem.
    ``sources``: what the user set that an input is made from (``{"step_size": "lr"}``), named
    first when that input differs across ranks."""
    sources = sources or {}
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
    if len({r.ordinal for r in reports}) > 1:
        raise RuntimeFault(
            "ranks are running different compiled steps of the same program (two steps of one "
            "program and shapes, called in a different order)",
            op=f"{program.name} step",
            details=[
                f"rank {r.rank} runs the compiled step it called first as number {r.ordinal + 1}"
                " of this program"
                for r in reports
            ],
            hint="every rank must call its compiled steps in the same order",
        )
    calls = sorted({r.call for r in reports})
    if len(calls) > 1:
        raise RuntimeFault(
            "ranks are at different steps of the same program: one skipped or repeated a step",
            op=f"{program.name} step",
            details=[f"rank {r.rank} is at its call {r.call} of this step" for r in reports],
            hint="every rank must call the compiled step the same number of times, in the same "
            "order as its other steps; this job's ranks have diverged: restart it",
        )
    errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error is not None]
    if errors:
        raise RuntimeFault(
            "bad inputs (checked on every rank before any communication)",
            op=f"{program.name} step",
            details=errors,
            hint="fix the inputs named above; nothing was communicated or updated",
        )
    differing = [
        (r, name, value)
        for r in reports[1:]
        for name, value in r.replicated.items()
        if value != first.replicated.get(name)
    ]
    differ = [
        f"{_input_named(name, sources)}: rank 0 has {first.replicated.get(name)}, rank {r.rank} "
        f"has {value}"
        for r, name, value in differing
    ]
    if differ:
        named = list(dict.fromkeys(sources.get(name, name) for _, name, _ in differing))
        raise RuntimeFault(
            f"Replicated inputs differ across ranks: {', '.join(named)}",
            op=f"{program.name} step",
            details=differ,
            hint="a Replicated input must be the same on every rank (a step counter that differs "
            "means a rank skipped or repeated a step); nothing was communicated or updated",
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


def _input_named(name: str, sources: Mapping[str, str]) -> str:
    """``input 'x'``, or what the user set that it is made from, first."""
    if name in sources:
        return f"{sources[name]} (input {name!r}, made from it)"
    return f"input {name!r}"
