"""Candidates: every legal schedule of a program the tuner considers, with its transport.

A ``Candidate`` is a ``Schedule`` (or none: the unscheduled program, always a candidate) plus the
transport that runs its collectives and, on torch.distributed, the algorithm of each collective op.
Its decisions are the schedule's typed steps (``coconet.schedule.Step``: a ``Primitive`` and the
values it applies to), so a candidate prints, serialises (``to_json``) and replays
(``Candidate.from_json``) exactly like a hand-written schedule.

``enumerate_candidates`` builds the schedules from the primitives, for each tensor all_reduce of
the program (the same recipe for every one of them, so k all_reduces do not make 9^k candidates):

=========================  ===================================================================
recipe                     primitives
=========================  ===================================================================
``none``                   nothing: each op runs on its own
``fuse``                   fuse(computations(ar))                 (AR_C, MM_AR_C, AR_P2P_C)
``split``                  split(ar)
``split+fuse``             split(ar); fuse(computations(ag))
``split+reorder``          split; reorder(computations(ag), ag)
``split+reorder+fuse``     ... ; fuse(computations(rs))           (RS_C_AG, MM_RS_C_AG, ...)
``...+as_slice``           ... ; as_slice(the state the reorder made sliceable)
``...+fuse_collective``    ... ; fuse(rs, computations, ag)       (fuse_RS_C_AG)
``...+overlap(k)``         ... ; overlap([producer, rs, ...], k)  (ol_MM_fuse_RS_C_AG, ...)
=========================  ===================================================================

A primitive that does not apply raises ``ScheduleError``; the recipe is then recorded as a
``Rejection`` with that error (``explain()`` shows it) and is not a candidate. Recipes that give
the same program (same nodes, layouts and groups) are one candidate: the first, simplest, keeps
its name. A candidate that is one of the paper's schedules (``coconet.schedule.paper``) is named
after it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coconet.errors import ScheduleError
from coconet.ir.ops import COMMUNICATION, Op
from coconet.ir.program import Program
from coconet.options import Algorithm, TransportKind
from coconet.schedule import paper
from coconet.schedule.paper import fuse_after
from coconet.schedule.schedule import Schedule

__all__ = [
    "CHUNKS",
    "Candidate",
    "Enumeration",
    "Rejection",
    "enumerate_candidates",
    "enumerate_schedules",
]

# The chunk counts tried for overlap; the cost model's fill + (k-1) max + drain picks among them.
CHUNKS: tuple[int, ...] = (2, 4, 8)

_FORMAT = "coconet.candidate/1"


@dataclass(frozen=True)
class Candidate:
    """One schedule of a program on one transport (a ``str``-printable, replayable decision).

    ``schedule`` is None for the unscheduled program. ``algorithms`` fixes the torch.distributed
    algorithm of collective ops, as ``CommOptions(algorithms=...)`` takes them; empty leaves it
    to the communicator (measured per size class). Shared memory has one way of each collective.
    """

    program: Program
    schedule: Schedule | None
    transport: TransportKind
    algorithms: tuple[tuple[Op, Algorithm], ...] = ()
    recipe: str = "none"  # the enumeration's recipe (``none`` for the unscheduled program)

    @property
    def name(self) -> str:
        return self.schedule.name if self.schedule is not None else "unscheduled"

    @property
    def target(self) -> Program | Schedule:
        """What ``coconet.compile`` takes."""
        return self.schedule if self.schedule is not None else self.program

    @property
    def scheduled(self) -> Program:
        """The transformed program."""
        return self.schedule.program if self.schedule is not None else self.program

    @property
    def steps(self) -> tuple[str, ...]:
        if self.schedule is None:
            return ()
        return tuple(str(line).strip() for line in str(self.schedule).splitlines()[1:])

    @property
    def label(self) -> str:
        """Short: ``fuse_RS_C_AG [shared memory]``."""
        algos = ", ".join(f"{op.value}={a.value}" for op, a in self.algorithms)
        return f"{self.name} [{self.transport.value}{'; ' + algos if algos else ''}]"

    @property
    def key(self) -> tuple:
        """Structural identity: the scheduled program (nodes, layouts, groups) and transport."""
        return (self.scheduled.structural_key(), self.transport, self.algorithms)

    def with_algorithms(self, algorithms: Mapping[Op, Algorithm]) -> Candidate:
        pairs = tuple(sorted(algorithms.items(), key=lambda kv: kv[0].value))
        return Candidate(self.program, self.schedule, self.transport, pairs, self.recipe)

    @property
    def parent_recipe(self) -> str | None:
        """The recipe this one adds its last rewrite to (None for the unscheduled program)."""
        if self.recipe == "none":
            return None
        head, _, _ = self.recipe.rpartition("+")
        return head or "none"

    @property
    def last_rewrite(self) -> str:
        return self.recipe.rpartition("+")[2]

    def __str__(self) -> str:
        steps = (
            "; ".join(s for s in self.steps if s != "(no transformation)") or "(no transformation)"
        )
        return f"{self.label}: {steps}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "name": self.name,
            "recipe": self.recipe,
            "transport": self.transport.value,
            "algorithms": {op.value: a.value for op, a in self.algorithms},
            "schedule": None if self.schedule is None else json.loads(self.schedule.to_json()),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, program: Program, d: Mapping[str, Any]) -> Candidate:
        if not isinstance(d, Mapping) or d.get("format") != _FORMAT:
            raise ScheduleError(
                f"not a {_FORMAT} document",
                op="Candidate.from_json",
                hint="pass what Candidate.to_json() wrote",
            )
        try:
            transport = TransportKind(d["transport"])
            algos = {Op(k): Algorithm(v) for k, v in dict(d.get("algorithms", {})).items()}
        except (KeyError, ValueError, TypeError) as e:
            raise ScheduleError(
                f"a candidate document with a bad transport or algorithm: {e}",
                op="Candidate.from_json",
                hint="pass what Candidate.to_json() wrote",
            ) from None
        raw = d.get("schedule")
        schedule = None if raw is None else Schedule.from_json(program, json.dumps(raw))
        recipe = str(d.get("recipe", "none"))
        return cls(program, schedule, transport, (), recipe).with_algorithms(algos)

    @classmethod
    def from_json(cls, program: Program, text: str) -> Candidate:
        return cls.from_dict(program, json.loads(text))


@dataclass(frozen=True)
class Rejection:
    """A rewrite the enumeration tried and could not apply: the primitive's own error."""

    recipe: str
    error: ScheduleError

    def __str__(self) -> str:
        return f"{self.recipe}: illegal: {self.error.message}"


@dataclass
class Enumeration:
    """The legal schedules (de-duplicated, the unscheduled program first), what was rejected, and
    how many recipes gave a schedule already in the list."""

    program: Program
    schedules: list[Schedule | None] = field(default_factory=list)
    recipes: list[str] = field(default_factory=list)  # each schedule's recipe
    rejected: list[Rejection] = field(default_factory=list)
    duplicates: dict[str, str] = field(default_factory=dict)  # recipe -> the candidate it equals


# -- recipes ------------------------------------------------------------------------------------


def _tensor_all_reduces(program: Program) -> list[str]:
    return [n.name for n in program.nodes if n.op is Op.ALL_REDUCE and n.type.rank > 0]


def _kernel_part(s: Schedule, names: Iterable[str]) -> list[str]:
    """The computations of ``names`` a kernel can hold (a send stays outside, as in AR_P2P_C)."""
    return [n for n in names if s.program.node(n).op not in COMMUNICATION]


def _sliceable_state(s: Schedule, state: Sequence[str]) -> tuple[str, ...]:
    """Of the optimizer ``state`` named by the caller, what as_slice accepts after the reorder
    (the whole set when it applies, else each one that applies alone), in the given order.

    Only named state: which inputs a step may keep sliced is the caller's contract (the
    parameters must stay whole for the forward pass, though as_slice could slice them)."""
    from coconet.schedule.as_slice import check_as_slice

    try:
        check_as_slice(s.program, list(state))
        return tuple(state)
    except ScheduleError:
        pass
    ok: list[str] = []
    for name in state:
        try:
            check_as_slice(s.program, [name])
        except ScheduleError:
            continue
        ok.append(name)
    return tuple(ok)


_Action = Callable[[Schedule, dict], None]


def _split(s: Schedule, h: dict) -> None:
    h["rs"], h["ag"] = s.split(h["ar"])


def _fuse_whole(s: Schedule, h: dict) -> None:
    s.fuse(_kernel_part(s, s.computations(h["ar"])))


def _fuse_after_gather(s: Schedule, h: dict) -> None:
    s.fuse(_kernel_part(s, s.computations(h["ag"])))


def _reorder(s: Schedule, h: dict) -> None:
    s.reorder(s.computations(h["ag"]), h["ag"])


def _as_slice(s: Schedule, h: dict) -> None:
    named = h["state"]
    state = _sliceable_state(s, named)
    if not state:
        why = (
            f"none of the state {list(named)} can be stored sliced here"
            if named
            else "no optimizer state was named to store sliced"
        )
        raise ScheduleError(
            why,
            op="as_slice",
            hint="name the optimizer state (Adam's m and v) with state=(...) "
            "(coconet tune --state m,v; a module's STATE tuple is read by the CLI)",
        )
    s.as_slice(state)


def _fuse_slices(s: Schedule, h: dict) -> None:
    s.fuse(_kernel_part(s, s.computations(h["rs"])))


def _fuse_collective(s: Schedule, h: dict) -> None:
    fuse_after(s, h["rs"])


def _fuse_collective_after(s: Schedule, h: dict) -> None:
    # The reduce_scatter stays outside (overlapped with the fused send/compute/all_gather).
    fuse_after(s, h["rs"], include=False)


def _overlap(chunks: int, with_producer: bool) -> _Action:
    def act(s: Schedule, h: dict) -> None:
        chain = [h["rs"], *s.downstream(h["rs"])]
        if with_producer:
            producer = s.original.node(h["ar"]).inputs[0]
            if producer.op is not Op.MATMUL:
                raise ScheduleError(
                    f"{h['ar']} sums {producer.name} ({producer.op}), not a matmul: there is no "
                    "producer to overlap the reduce_scatter with",
                    op="overlap",
                    hint="overlap pays when a matmul feeds the collective",
                )
            chain.insert(0, producer.name)
        s.overlap(chain, chunks)

    return act


def _recipes(chunks: Sequence[int]) -> list[tuple[str, tuple[_Action, ...]]]:
    split_reorder = (_split, _reorder)
    out: list[tuple[str, tuple[_Action, ...]]] = [
        ("fuse", (_fuse_whole,)),
        ("split", (_split,)),
        ("split+fuse", (_split, _fuse_after_gather)),
        ("split+reorder", split_reorder),
        ("split+reorder+fuse", (*split_reorder, _fuse_slices)),
        ("split+reorder+as_slice", (*split_reorder, _as_slice)),
        ("split+reorder+as_slice+fuse", (*split_reorder, _as_slice, _fuse_slices)),
        ("split+reorder+fuse_collective", (*split_reorder, _fuse_collective)),
        ("split+reorder+as_slice+fuse_collective", (*split_reorder, _as_slice, _fuse_collective)),
    ]
    for k in chunks:
        out += [
            (
                f"split+reorder+fuse_collective+overlap({k})",
                (*split_reorder, _fuse_collective, _overlap(k, with_producer=True)),
            ),
            (
                f"split+reorder+fuse_after_rs+overlap_rs({k})",
                (*split_reorder, _fuse_collective_after, _overlap(k, with_producer=False)),
            ),
        ]
    return out


def _paper_schedules(program: Program, named: Sequence[str]) -> dict[str, Schedule]:
    """The paper's schedules that apply to ``program``, with the ``named`` state sliced."""
    out: dict[str, Schedule] = {}
    state: tuple[str, ...] = ()
    ars = _tensor_all_reduces(program)
    if len(ars) == 1 and named:
        try:
            s = Schedule(program)
            h = {"ar": ars[0]}
            _split(s, h)
            _reorder(s, h)
            state = _sliceable_state(s, named)
        except ScheduleError:
            pass
    makers: dict[str, Callable[[], Schedule]] = {
        "AR_C": lambda: paper.AR_C(program),
        "RS_C_AG": lambda: paper.RS_C_AG(program, state),
        "fuse_RS_C_AG": lambda: paper.fuse_RS_C_AG(program, state),
        "MM_AR_C": lambda: paper.MM_AR_C(program),
        "MM_RS_C_AG": lambda: paper.MM_RS_C_AG(program),
        "AR_P2P_C": lambda: paper.AR_P2P_C(program),
        "RS_P2P_C_AG": lambda: paper.RS_P2P_C_AG(program),
    }
    for k in CHUNKS:
        makers[f"ol_MM_fuse_RS_C_AG({k})"] = lambda k=k: paper.ol_MM_fuse_RS_C_AG(program, k)
        makers[f"ol_RS_fuse_P2P_C_AG({k})"] = lambda k=k: paper.ol_RS_fuse_P2P_C_AG(program, k)
    # A paper name only for its family: MM_ for a matmul's partial sums, P2P for a pipeline
    # boundary, the others for data-parallel updates (the same rewrite is all three).
    matmul = any(program.node(ar).inputs[0].op is Op.MATMUL for ar in _tensor_all_reduces(program))
    sends = any(n.op is Op.SEND for n in program.nodes)
    for name, make in makers.items():
        family_mm, family_p2p = "MM_" in name, "P2P" in name
        fits = (matmul or not family_mm) and (sends or not family_p2p)
        if not fits or (not family_mm and not family_p2p and (matmul or sends)):
            continue
        try:
            out[name] = make()
        except ScheduleError:
            continue
    return out


def enumerate_schedules(
    program: Program, chunks: Sequence[int] = CHUNKS, state: Sequence[str] = ()
) -> Enumeration:
    """Every legal schedule of ``program`` the recipes make, de-duplicated; None (the unscheduled
    program) first. ``state``: the inputs the schedules may store sliced (an optimizer's state,
    as for ``RS_C_AG``)."""
    unknown = [n for n in state if n not in {i.name for i in program.inputs}]
    if unknown:
        raise ScheduleError(
            f"state {unknown} are not inputs of {program.name}",
            op="enumerate_schedules",
            hint=f"its inputs: {[i.name for i in program.inputs]}",
        )
    found = Enumeration(program, [None], recipes=["none"])
    seen: dict[str, str] = {program.structural_key(): "unscheduled"}
    _sequence_parallel(program, chunks, found, seen)
    ars = _tensor_all_reduces(program)
    if not ars:
        return found
    # The paper's names for the programs they make (only for naming: "MM_AR_C" and "AR_C" make
    # the same program for a tensor-parallel layer, the first that matches names it).
    paper_names: dict[str, str] = {}
    for name, s in _paper_schedules(program, state).items():
        paper_names.setdefault(s.program.structural_key(), name)
    for recipe, actions in _recipes(chunks):
        s = Schedule(program, recipe)
        try:
            for ar in ars:
                handles: dict[str, Any] = {"ar": ar, "state": tuple(state)}
                for act in actions:
                    act(s, handles)
        except ScheduleError as e:
            found.rejected.append(Rejection(recipe, e))
            continue
        _record(found, seen, s, recipe, paper_names.get(s.program.structural_key(), recipe))
    return found


def _record(found: Enumeration, seen: dict[str, str], s: Schedule, recipe: str,
            name: str) -> None:  # fmt: skip
    """``s`` made by ``recipe`` becomes a candidate named ``name``, unless an earlier recipe
    made the same program (then it is recorded as that one's duplicate)."""
    key = s.program.structural_key()
    if key in seen:
        found.duplicates[recipe] = seen[key]
        return
    s.name = name
    seen[key] = name
    found.schedules.append(s)
    found.recipes.append(recipe)


def _sequence_parallel(program: Program, chunks: Sequence[int], found: Enumeration,
                       seen: dict[str, str]) -> None:  # fmt: skip
    """The sequence-parallel layer's overlaps (``paper.ol_AG_MM``, ``paper.ol_MM_RS_C``), each
    chunk count a candidate: every chain of the kind overlapped (as the recipes above treat
    every all_reduce alike). A program with no such chain gets none, and no rejection: the
    recipes are not about it."""
    for name, chains in paper.sequence_parallel_chains(program).items():
        if not chains:
            continue
        for k in chunks:
            recipe = f"{name}({k})"
            try:
                s = paper.overlap_every_chain(program, name, k)
            except ScheduleError as e:
                found.rejected.append(Rejection(recipe, e))
                continue
            _record(found, seen, s, recipe, recipe)


def enumerate_candidates(
    program: Program,
    transports: Sequence[TransportKind],
    chunks: Sequence[int] = CHUNKS,
    state: Sequence[str] = (),
) -> tuple[list[Candidate], Enumeration]:
    """Every legal schedule on every transport given (shared memory only where the ranks share a
    host: the caller knows), the unscheduled program first."""
    found = enumerate_schedules(program, chunks, state)
    out = [
        Candidate(program, s, t, (), r)
        for t in transports
        for s, r in zip(found.schedules, found.recipes, strict=True)
    ]
    return out, found
