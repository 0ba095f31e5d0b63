"""The start-of-step handshake: ranks agree on the program and their inputs before communicating.

Ranks that run different programs, or pass inputs of mismatched sizes, would issue collectives
that do not line up; on gloo a size mismatch aborts the process from C++ (SIGABRT from
``gloo::EnforceNotMet``), beyond any Python error handling. So before the step's first data
moves, at every step, every rank contributes a few words to one round that cannot mismatch
(``ControlChannel.agreement``: gathered over shared memory, a MAX of the words and their
negations on torch.distributed):

    [identity hash, ordinal, call, Replicated values' hash, local steps' digest,
     the shapes' verdict, "I need a full exchange", "my inputs failed", what rides along]

The identity is the compiled step's (program, schedule, mesh, every option that changes the
collectives or the numerics); ``call`` counts this rank's calls of steps with that identity, so a
rank that skipped or repeated a step is caught at the next one instead of pairing its step t with
a peer's step t+1. When the first six words differ, a rank's input shapes changed to ones it has
not run with (or it is the first step), or a rank found a bad input, every rank learns it from
the same words and they all take part in a full exchange of ``RankReport``s (pickled objects of
any size, ``all_gather_object``). From the same reports every rank reaches the same verdict: the
global sizes, or one ``RuntimeFault`` naming the difference, raised on every rank.

Shapes seen before cost no exchange (``Verdicts``): a verdict is kept by every rank's shapes,
and a rank whose shapes change to ones it had under a kept verdict proposes that verdict (the
sixth word: its hash) instead of asking for an exchange. Every rank's word is equal only when
every rank proposes the same verdict, which holds its own shapes: then each rank's shapes are
the verdict's, and the verdict stands without a word more. A decoder's growing context (a new
length per token, the same lengths prompt after prompt) pays the exchange once per length.

Two ways the round costs less than a round of its own (``coconet.runtime.step``):

- **A small all_reduce rides with it.** When a step's first communication is a small
  all_reduce over the whole world (a row-parallel layer's), the step runs its local work first
  and the agreement's words go in the same round as that all_reduce's data
  (``settle_carrying``): one round of signals instead of two. The data is used only if every
  rank agreed and carried the same all_reduce; otherwise it is dropped (no rank used it) and the
  verdict is reached as before. A rank that cannot defer (a bad input, new shapes, its first
  call) agrees before its step as usual: its round pairs with the others' carrying round.
- **Steps that communicate nothing are agreed at the next round** (``LocalSteps``): a step with
  no collective and no update (a column-parallel layer's forward) moves no data, so after its
  first call it runs without a round; its calls (identity, call count, Replicated values) are
  folded into the next agreement round of the communicator, before that step moves any data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from coconet.codegen.geometry import Geometry, bind_alike, bind_sizes, geometry
from coconet.errors import RuntimeFault
from coconet.ir.mesh import Mesh
from coconet.ir.ops import ReduceOp
from coconet.ir.program import Program

__all__ = [
    "CallRefused",
    "Deferred",
    "Disagreement",
    "LocalSteps",
    "RankReport",
    "Verdicts",
    "identity_hash",
    "settle",
    "settle_carrying",
    "verdict",
]

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
    # The steps that communicate nothing run since the last round (``LocalSteps.take``): (their
    # number, the first few as (program, ordinal, call, Replicated values))
    local: tuple = (0, ())
    # The hash of the verdict whose shapes this rank's are (``Verdicts``; 0: none proposed)
    verdict: int = 0


def identity_hash(identity: Sequence[tuple[str, str]]) -> int:
    text = "\x00".join(f"{k}={v}" for k, v in identity)
    return int(hashlib.sha256(text.encode()).hexdigest()[:16], 16) & _MASK


class LocalSteps:
    """The calls of steps that communicate nothing and update nothing (a column-parallel layer's
    forward), made on one communicator since its last agreement round.

    Such a step moves no data between ranks, so nothing it does can mismatch across them while
    it runs: after its first call it runs without a round of its own, and its calls are compared
    by the next agreement round of the communicator (any step's), before that step moves any data.
    A rank that ran other local steps, or the same ones with other Replicated values, fails that
    round on every rank with the calls named."""

    KEPT = 64  # calls kept for the message; the digest covers all of them

    def __init__(self) -> None:
        self.digest = 0
        self.calls: list[tuple[str, int, int, tuple[tuple[str, str], ...]]] = []
        self.count = 0

    def add(self, name: str, identity: int, ordinal: int, call: int,
            replicated: Mapping[str, str]) -> None:  # fmt: skip
        # Python's hash of a tuple of ints is the same in every process (only str and bytes
        # hashes are salted): the digest of the same calls is the same on every rank
        self.digest = hash((self.digest, identity, ordinal, call, _replicated_hash(replicated)))
        self.count += 1
        if len(self.calls) < self.KEPT:
            self.calls.append((name, ordinal, call, tuple(sorted(replicated.items()))))

    def take(self) -> tuple[int, tuple]:
        """(the digest, the calls kept) of the calls since the last round, and start anew."""
        taken = (self.digest, (self.count, tuple(self.calls)))
        self.digest, self.calls, self.count = 0, [], 0
        return taken


@dataclass
class Deferred:
    """A step's agreement put off until its first all_reduce, which it rides with
    (``CompiledStep.run``; ``settle_carrying``)."""

    report: RankReport
    identity: int  # identity_hash(report.identity)
    label: str  # the all_reduce it rides with


class CallRefused(RuntimeFault):
    """A call refused on every rank before anything moved: the per-step agreement found the
    ranks' reports different (``reports``: every rank's, in rank order), or, in a step that
    communicates nothing, this rank's own inputs were bad (no reports). Nothing was counted and
    the communicator stays usable. A typed value: a caller that words the difference itself
    (``coconet.optim``'s call agreement, ``coconet.nn``'s replica check) asks which of its
    agreed values differ (``values``, ``differs``), never the message."""

    def __init__(self, fault: RuntimeFault, reports: Sequence[RankReport] = ()) -> None:
        super().__init__(fault.message, op=fault.op, loc=fault.loc, details=fault.details,
                         hint=fault.hint)  # fmt: skip
        self.reports: tuple[RankReport, ...] = tuple(reports)

    def values(self, key: str) -> list[str | None]:
        """Each rank's value of the agreed value ``key`` (None: a rank that did not send it)."""
        return [r.replicated.get(key) for r in self.reports]

    def differs(self, key: str) -> bool:
        """Whether the ranks sent ``key`` with different values (or some without it)."""
        return len(set(self.values(key))) > 1


class Disagreement(Exception):  # noqa: N818 - a control-flow signal inside coconet, not an error
    """Out of a step whose deferred agreement found a difference (or a peer asked for the full
    exchange): every rank's report, exchanged. ``CompiledStep.run`` turns it into the verdict."""

    def __init__(self, reports: list[RankReport]) -> None:
        super().__init__("the ranks' agreement found a difference")
        self.reports = reports


def _words(report: RankReport, identity: int, local: int, need_exchange: bool,
           carried: int) -> list[int]:  # fmt: skip
    """The agreement's words: four that must be equal everywhere (identity, ordinal, call, the
    Replicated values' hash), the local steps' digest and the shapes' verdict (equal everywhere
    too), two flags that must be 0 everywhere, and what payload rides along (0: none)."""
    return [
        identity,
        report.ordinal,
        report.call,
        _replicated_hash(report.replicated),
        local,
        report.verdict,
        int(need_exchange),
        int(report.error is not None),
        carried,
    ]


_EQUAL = 6  # the first six words must be equal on every rank
_EXCHANGE, _ERROR, _CARRIED = 6, 7, 8


def _agreed(high: list[int], low: list[int]) -> bool:
    return high[:_EQUAL] == low[:_EQUAL] and not high[_EXCHANGE] and not high[_ERROR]


def settle(
    comm, report: RankReport, need_exchange: bool, identity: int | None = None
) -> list[RankReport] | None:
    """Run the handshake; the reports of every rank when a full exchange happened, else None.
    ``identity``: ``identity_hash(report.identity)`` when the caller has it (a compiled step
    keeps it: hashing the identity at every step cost more than a small step's agreement).

    Every rank must call it at the same point of the step (before any other collective), or
    ``settle_carrying`` there: the two pair. A world of one has nobody to agree with: its own
    report decides, without hashing.
    """
    if comm.world == 1:
        return [report] if need_exchange or report.error is not None else None
    h = identity_hash(report.identity) if identity is None else identity
    local, calls = comm.local_steps.take()
    high, low, _ = comm.control.agreement(_words(report, h, local, need_exchange, 0))
    if _agreed(high, low):
        return None
    return comm.exchange(_with_local(report, calls), "input shapes")


def settle_carrying(
    comm, deferred: Deferred, payload: torch.Tensor, reduce_op: ReduceOp, donate: bool
) -> torch.Tensor | None:
    """The agreement of ``deferred``'s step with its first all_reduce (``payload``) riding along,
    in one round (shared memory, a small all_reduce: ``ControlChannel.agreement``): the
    all_reduce's result when every rank agreed and carried it; None when they agreed but some
    rank could not carry it (the caller runs the all_reduce as usual: every rank sees the same
    words, so every rank does). Raises ``Disagreement`` with every rank's report (exchanged)
    when they did not agree: the step's result is dropped, and ``CompiledStep.run`` gives the
    verdict, as ``settle`` does."""
    report = deferred.report
    carries = comm.control.carries(payload, reduce_op)
    # what rides: the same positive word on every rank that carries the same all_reduce
    carried = ((payload.numel() << 8) | (_DTYPES[payload.dtype] << 4) | _OPS[reduce_op]) + 1 \
        if carries else 0  # fmt: skip
    local, calls = comm.local_steps.take()
    words = _words(report, deferred.identity, local, False, carried)
    high, low, result = comm.control.agreement(words, payload if carries else None, reduce_op,
                                               donate)  # fmt: skip
    if not _agreed(high, low):
        raise Disagreement(comm.exchange(_with_local(report, calls), "input shapes"))
    if high[_CARRIED] == low[_CARRIED] != 0:
        return result
    return None


# the payloads that can ride (the dtypes and reductions cn_one_shot computes), as numbers
_DTYPES = {torch.float32: 1, torch.float64: 2, torch.int32: 3, torch.int64: 4}
_OPS = {ReduceOp.SUM: 1, ReduceOp.PROD: 2, ReduceOp.MAX: 3, ReduceOp.MIN: 4}


class Verdicts:
    """One compiled step's verdicts, kept by every rank's shapes and dtypes (the last ``limit``).

    ``remember`` keeps a verdict (an exchange's, or one every rank proposed) and makes it the
    current one; ``propose`` is, for this rank's new shapes, the kept verdict under which this
    rank had them, else the one every rank reaches if every rank has this rank's shapes. A
    proposal every rank makes alike holds every rank's shapes, so it stands without an exchange
    (the module's docstring); one that some rank does not make only costs an exchange, never a
    wrong size."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self.current = 0  # the hash of the verdict the step runs under (0: none yet)
        # verdict hash -> (the hash, every rank's key, the value: the step's geometry)
        self._values: dict[int, tuple[int, tuple, object]] = {}
        self._mine: dict[tuple, int] = {}  # this rank's shapes -> the last verdict holding them

    @staticmethod
    def key(shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str]) -> tuple:
        """One rank's part of a verdict's name."""
        return (tuple(sorted((k, tuple(v)) for k, v in shapes.items())),
                tuple(sorted(dtypes.items())))  # fmt: skip

    @staticmethod
    def hash_of(every: Sequence[tuple]) -> int:
        """The name of the verdict on every rank's ``key``s (in rank order): never 0."""
        return identity_hash([("shapes", repr(tuple(every)))]) or 1

    def remember(self, every: Sequence[tuple], rank: int, value: object,
                 h: int | None = None) -> int:  # fmt: skip
        """Keep the verdict on every rank's ``key``s (``h``: its ``hash_of`` if known) with
        ``value``; it becomes the current one. Returns its hash."""
        h = self.hash_of(every) if h is None else h
        if h not in self._values and len(self._values) >= self.limit:
            # a model that never repeats its shapes: start over
            self._values.clear()
            self._mine.clear()
        self._values[h] = (h, tuple(every), value)
        self._mine[every[rank]] = h
        self.current = h
        return h

    @staticmethod
    def _alike(kept: tuple | None) -> bool:
        """Whether a kept verdict is of every rank with the same shapes."""
        return kept is not None and len(set(kept[1])) == 1

    def remember_reports(self, reports: Sequence[RankReport], rank: int, value: object) -> int:
        """``remember`` the verdict an exchange reached on ``reports`` (in rank order)."""
        return self.remember([self.key(r.shapes, r.dtypes) for r in reports], rank, value)

    def propose(
        self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str],
        program: Program, mesh: Mesh, comm,
    ) -> tuple[int, tuple, Geometry] | None:  # fmt: skip
        """The verdict this rank proposes for its new ``shapes``, in place of an exchange: (its
        hash, every rank's key, the geometry). The kept one under which this rank had these
        shapes; else the one every rank reaches if every rank has them (a tensor-parallel
        layer's activations: the same on every rank), which stands only where every rank
        proposes it. While the ranks run with the same shapes, a kept verdict of ranks with
        different ones gives way to the worked-out one (so a switch between the two kinds costs
        one exchange, and staying with either none). None where this rank's shapes alone do
        not fit ``program`` (the exchange says why)."""
        mine = self.key(shapes, dtypes)
        kept = self._values.get(self._mine.get(mine, 0))
        if kept is not None and (self._alike(kept) or not self._alike(self._values.get(
                self.current))):  # fmt: skip
            return kept
        # (a kept verdict of ranks with other shapes than this one's, while the ranks run with
        # the same shapes: the one worked out is the likelier to be every rank's)
        return _alike_verdict(program, mesh, comm, mine, shapes)


def _alike_verdict(program: Program, mesh: Mesh, comm, mine: tuple,
                   shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, tuple, Geometry] | None:
    """The verdict every rank reaches if every rank has ``shapes`` (None: they do not fit),
    kept by the communicator (``comm.alike_verdicts``) for every compiled step of ``program``.

    Every block of a model runs the same programs (each block's c_fc is one program), so a
    context that grows by a token is worked out once per program and length, not once per
    layer: binding the sizes is most of what a new length costs a layer's call. A geometry is
    never written to after it is made, so the steps of one program share it."""
    known = comm.alike_verdicts
    k = (program.structural_key(), mesh, comm.rank, comm.world, mine)
    if k in known:
        return known[k]
    sizes = bind_alike(program, mesh, shapes)
    every = (mine,) * comm.world
    v = None if sizes is None else (Verdicts.hash_of(every), every,
                                    geometry(program, mesh, comm.rank, sizes))
    if len(known) >= 1024:  # a model that never repeats its shapes: start over
        known.clear()
    known[k] = v
    return v


def _with_local(report: RankReport, calls: tuple) -> RankReport:
    return replace(report, local=calls) if calls[0] else report


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
    _check_local_steps(reports)
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


def _check_local_steps(reports: Sequence[RankReport]) -> None:
    """A ``RuntimeFault`` when the ranks ran other steps that communicate nothing since their
    last round (``LocalSteps``), naming the first call that differs."""
    first = reports[0]
    for r in reports[1:]:
        if r.local == first.local:
            continue
        (n0, calls0), (n1, calls1) = first.local, r.local
        details = [f"rank 0 ran {n0} such calls, rank {r.rank} ran {n1}"]
        for k, (a, b) in enumerate(zip(calls0, calls1, strict=False)):
            if a != b:
                details.append(f"call {k + 1}: rank 0 ran {_local_call(a)}, rank {r.rank} ran "
                               f"{_local_call(b)}")  # fmt: skip
                break
        raise RuntimeFault(
            "ranks ran different steps that communicate nothing (checked at the next agreement)",
            op="handshake",
            details=details,
            hint="every rank must call its compiled steps in the same order and the same number "
            "of times, with the same Replicated values; this job's ranks have diverged: restart "
            "it",
        )


def _local_call(call: tuple) -> str:
    name, ordinal, number, replicated = call
    values = ", ".join(f"{k}={v}" for k, v in replicated)
    return f"{name} (compiled step {ordinal + 1}) call {number}" + (f" with {values}" if values
                                                                    else "")  # fmt: skip
