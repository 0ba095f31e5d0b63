"""Schedule: an ordered, replayable record of primitives applied to a program.

::

    s = Schedule(program)
    rs, ag = s.split("g_sum")              # handles, valid for the rest of the schedule
    s.reorder(s.computations(ag), ag)
    s.as_slice(["m", "v"])
    s.fuse([rs, *s.computations(rs), ag])  # ag: the all_gathers the reorder left (see Handle)
    print(s)            # the primitives, one per line
    print(s.program)    # the transformed program: verifiable, printable, runnable in the simulator
    text = s.to_json()  # ... and Schedule.from_json(program, text) replays it
    s.digest            # a hash of that JSON: the schedule's identity (compile cache, handshake)

Each method checks its primitive first (``ScheduleError`` saying what blocks it) and leaves the
schedule unchanged when the check fails.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from coconet.errors import ScheduleError, UnknownNameError
from coconet.ir.ops import Op
from coconet.ir.program import Program
from coconet.schedule.as_slice import apply_as_slice
from coconet.schedule.defer import apply_defer
from coconet.schedule.fuse import apply_fuse
from coconet.schedule.graph import downstream, resolve, value_list
from coconet.schedule.overlap import apply_overlap
from coconet.schedule.reorder import REORDERABLE, apply_reorder
from coconet.schedule.split import apply_split

__all__ = ["Handle", "Primitive", "Schedule", "Step"]

_FORMAT = "coconet.schedule/1"


class Primitive(enum.Enum):
    SPLIT = "split"
    REORDER = "reorder"
    AS_SLICE = "as_slice"
    FUSE = "fuse"
    OVERLAP = "overlap"
    DEFER = "defer"


@dataclass(frozen=True)
class Step:
    """One applied primitive, with its arguments as value names (so it replays from JSON)."""

    primitive: Primitive
    nodes: tuple[str, ...]
    target: str | None = None  # reorder's all_gather
    chunks: int | None = None  # overlap's chunk count
    dim: int | None = None  # split's dim

    def format(self, shorthand: str | None = None) -> str:
        """One line; ``shorthand`` replaces the node list (``computations(g_sum)``), and long
        lists are elided (the JSON form always has every name)."""
        if shorthand:
            nodes = shorthand
        elif len(self.nodes) > 8:
            nodes = ", ".join([*self.nodes[:4], "...", *self.nodes[-2:]])
            nodes = f"{nodes} ({len(self.nodes)} values)"
        else:
            nodes = ", ".join(self.nodes)
        if shorthand and self.primitive is Primitive.REORDER:
            return f"reorder({nodes}, {self.target})"
        if self.primitive is Primitive.SPLIT:
            dim = f", dim={self.dim}" if self.dim else ""
            return f"split({nodes}{dim})"
        if self.primitive is Primitive.REORDER:
            return f"reorder([{nodes}], {self.target})"
        if self.primitive is Primitive.OVERLAP:
            return f"overlap([{nodes}], chunks={self.chunks})"
        if self.primitive is Primitive.DEFER:
            return f"defer({nodes})"
        return f"{self.primitive.value}([{nodes}])"

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"primitive": self.primitive.value, "nodes": list(self.nodes)}
        for key in ("target", "chunks", "dim"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Step:
        try:
            primitive = Primitive(d["primitive"])
        except (KeyError, ValueError, TypeError):
            known = ", ".join(p.value for p in Primitive)
            raise ScheduleError(
                f"unknown schedule step {d!r}", hint=f"primitives: {known}"
            ) from None
        # A document is written by Schedule.to_json: a step that does not fit was edited by hand.
        fix = "replay a document written by Schedule.to_json, or correct this step"
        nodes = d.get("nodes", ())
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise ScheduleError(
                f"schedule step {d!r}: nodes must be a list of value names", hint=fix
            )
        one = {Primitive.SPLIT: "all_reduce", Primitive.DEFER: "collective"}.get(primitive)
        if one is not None and len(nodes) != 1:
            raise ScheduleError(
                f"schedule step {d!r}: {primitive.value} takes exactly one {one}", hint=fix
            )
        for key, kind in (("target", str), ("chunks", int), ("dim", int)):
            v = d.get(key)
            if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
                raise ScheduleError(
                    f"schedule step {d!r}: {key} must be a {kind.__name__}", hint=fix
                )
        return cls(primitive, tuple(nodes), d.get("target"), d.get("chunks"), d.get("dim"))


class Handle(str):
    """A value a primitive returned (``rs, ag = s.split("g_sum")``), valid for the rest of the
    schedule.

    A handle is the value's name when it was returned (it compares, hashes and prints as that
    string), and the Schedule follows it through the rewrites since: when a later primitive
    removes the value, the handle stands for the values that took over its role. ``reorder``
    moves the all_gather past the computations, so after::

        rs, ag = s.split("g_sum")                # ag == "g_sum": all_gather(g_sum_rs)
        s.reorder(s.computations(ag), ag)        # g_sum is gone; p_new = all_gather(p_new_slice)

    ``ag`` stands for ``p_new`` (every all_gather the reorder made: one per value still needed
    whole), and ``s.fuse([rs, *s.computations(rs), ag])`` fuses up to it. A handle whose value
    was removed with nothing in its place (``as_slice`` drops the all_gather of a state's new
    value) stands for no value. A plain string is only ever a name in the current program.
    """

    __slots__ = ()


def _apply(program: Program, step: Step) -> tuple[Program, list[str]]:
    if step.primitive is Primitive.SPLIT:
        return apply_split(program, step.nodes[0], step.dim or 0)
    if step.primitive is Primitive.REORDER:
        return apply_reorder(program, step.nodes, step.target), []
    if step.primitive is Primitive.AS_SLICE:
        return apply_as_slice(program, step.nodes), []
    if step.primitive is Primitive.FUSE:
        return apply_fuse(program, step.nodes), []
    if step.primitive is Primitive.DEFER:
        return apply_defer(program, step.nodes[0]), []
    return apply_overlap(program, step.nodes, step.chunks), []


def _took_over(step: Step, removed: str, program: Program) -> tuple[str, ...]:
    """The values of ``program`` (after ``step``) that took over the role of ``removed``."""
    if step.primitive is Primitive.REORDER and removed == step.target:
        # The all_gather moved past the computations: it now gathers each of their results that
        # is still needed whole, under the computation's name.
        moved = set(step.nodes)
        return tuple(n.name for n in program.nodes if n.op is Op.ALL_GATHER and n.name in moved)
    # Anything else a step removes has no successor of its kind: a computation moved onto
    # slices, a scatter or an all_gather that as_slice made unnecessary.
    return ()


def _ancestors(node) -> set[str]:
    out: set[str] = set()
    stack = [node]
    while stack:
        for i in stack.pop().inputs:
            if i.name not in out:
                out.add(i.name)
                stack.append(i)
    return out


class Schedule:
    """The primitives applied to ``original`` so far; ``program`` is the result."""

    def __init__(self, program: Program, name: str | None = None) -> None:
        if not isinstance(program, Program):
            raise ScheduleError(
                f"Schedule takes a Program, got {type(program).__name__} {program!r}",
                op="Schedule",
                hint="build the program with coconet.Program(...) and pass it: Schedule(program)",
            )
        if name is not None and not isinstance(name, str):
            raise ScheduleError(
                f"a schedule's name is a string, got {type(name).__name__} {name!r}",
                op="Schedule",
                hint='Schedule(program, name="my_schedule")',
            )
        self.original = program
        self.program = program
        self.name = name or "custom"
        self.steps: list[Step] = []
        self._shorthands: list[str | None] = []
        # name -> (the names that took over its role, the index of the step that removed it),
        # for every value a step removed: how handles are followed (see Handle).
        self._removed: dict[str, tuple[tuple[str, ...], int]] = {}

    # -- primitives -----------------------------------------------------------------------------

    def split(self, all_reduce: Any, dim: int = 0) -> tuple[Handle, Handle]:
        """all_reduce -> reduce_scatter + all_gather; returns their handles (see ``Handle``)."""
        node = self._resolve(all_reduce, "split")
        rank = self.program.node(node).type.rank
        if isinstance(dim, int) and not isinstance(dim, bool) and rank and -rank <= dim < rank:
            dim %= rank  # one spelling per schedule: split(x, dim=-1) records dim=rank-1
        rs, ag = self._do(Step(Primitive.SPLIT, (node,), dim=dim or None))
        return Handle(rs), Handle(ag)

    def reorder(self, computations: Iterable[Any], all_gather: Any) -> None:
        """Run ``computations`` on slices before ``all_gather``."""
        names = self._resolve_all(computations, "reorder")
        self._do(Step(Primitive.REORDER, names, target=self._resolve(all_gather, "reorder")))

    def as_slice(self, tensors: Iterable[Any] | Any) -> None:
        """Store these Replicated state inputs sliced."""
        if isinstance(tensors, str) or not isinstance(tensors, Iterable):
            tensors = [tensors]
        self._do(Step(Primitive.AS_SLICE, self._resolve_all(tensors, "as_slice")))

    def fuse(self, nodes: Iterable[Any]) -> None:
        """One kernel (or one fused collective) for these nodes."""
        self._do(Step(Primitive.FUSE, self._resolve_all(nodes, "fuse")))

    def overlap(self, nodes: Iterable[Any], chunks: int = 4) -> None:
        """Run this producer-consumer chain chunk by chunk."""
        self._do(Step(Primitive.OVERLAP, self._resolve_all(nodes, "overlap"), chunks=chunks))

    def defer(self, collective: Any) -> None:
        """Start ``collective`` at the end of the step and wait for it at the next call's start
        (``coconet.schedule.defer``): its value may only land in inputs."""
        self._do(Step(Primitive.DEFER, (self._resolve(collective, "defer"),)))

    # -- helpers for writing schedules ----------------------------------------------------------

    def downstream(self, value: Any) -> list[str]:
        """Names of every value (computation or communication) that depends on ``value``."""
        start = resolve(self.program, self._resolve(value, "downstream"), "downstream")
        return [n.name for n in downstream(self.program, start) if n.op is not Op.UPDATE]

    def computations(self, value: Any) -> list[str]:
        """The computation that consumes ``value``, as names in program order.

        That is every pointwise op, reduction and send that depends on ``value`` (up to, not
        through, other communication), plus the computations feeding those that do not depend on
        it (``beta1 * m`` in Adam's ``m_new = beta1 * m + (1 - beta1) * g_sum``): everything a
        ``reorder`` must move onto slices so that no whole value is left to read.

        Of an all_gather (what ``reorder`` moves computations before), only whole (Replicated)
        values are listed, since only they can move onto slices: a value that already runs on
        slices (one an earlier ``reorder`` moved before another all_gather, such as the update
        of a first gradient that a shared global norm makes depend on a second one) or a Local
        one is not, so that ``reorder(s.computations(ag), ag)`` works for each all_gather in
        turn. Of anything else (a reduce_scatter, for ``fuse``) every layout is listed.
        """
        start = resolve(self.program, self._resolve(value, "computations"), "computations")
        whole_only = start.op is Op.ALL_GATHER

        def movable(n) -> bool:
            return n.op in REORDERABLE and (n.type.layout.is_replicated or not whole_only)

        chosen = {start.name}
        for n in downstream(self.program, start):
            if movable(n) and any(i.name in chosen for i in n.inputs):
                chosen.add(n.name)
        before_start = _ancestors(start)
        stack = [self.program.node(c) for c in chosen if c != start.name]
        while stack:
            for i in stack.pop().inputs:
                if movable(i) and i.name not in chosen and i.name not in before_start:
                    chosen.add(i.name)
                    stack.append(i)
        chosen.discard(start.name)
        return [n.name for n in self.program.nodes if n.name in chosen]

    def _resolve(self, ref: Any, primitive: str) -> str:
        """The name in the current program of one value: a name, a DSL Tensor, or a handle."""
        if isinstance(ref, Handle):
            names = self._follow(ref, primitive)
            if len(names) == 1:
                return names[0]
            _, index = self._removed[ref]
            by = f"step {index + 1}, {self._format_step(index)},"
            if not names:
                raise ScheduleError(
                    f"{ref} is gone: {by} removed it and nothing took its place",
                    op=primitive,
                    hint="refer to a value of the current program (print(s.program) lists them)",
                )
            raise ScheduleError(
                f"{ref} now stands for {len(names)} values ({', '.join(names)}): {by} replaced it",
                op=primitive,
                hint=f"pass one of them, e.g. {names[0]!r}",
            )
        if isinstance(ref, str):
            return resolve(self.program, ref, primitive).name
        try:
            return self.original.node(ref).name
        except UnknownNameError:
            return resolve(self.program, ref, primitive).name

    def _resolve_all(self, refs: Iterable[Any], primitive: str) -> tuple[str, ...]:
        """The names of several values; a handle counts for every value it stands for now."""
        names: list[str] = []
        for ref in value_list(refs, primitive):  # a lone name is refused, not iterated
            if isinstance(ref, Handle):
                names += self._follow(ref, primitive)
            else:
                names.append(self._resolve(ref, primitive))
        return tuple(names)

    def _follow(self, name: str, primitive: str, seen: frozenset[str] = frozenset()) -> list[str]:
        """The current names of what ``name`` stood for, following the values steps removed."""
        if name in seen or name not in self._removed:
            # a value of the current program, or none by that name (resolve raises)
            return [resolve(self.program, name, primitive).name]
        try:
            return [self.program.node(name).name]  # removed once, made again since
        except KeyError:
            pass
        successors, _ = self._removed[name]
        return [n for s in successors for n in self._follow(s, primitive, seen | {name})]

    def _do(self, step: Step) -> list[str]:
        shorthand = None
        if step.primitive is Primitive.REORDER and set(step.nodes) == set(
            self.computations(step.target)
        ):
            shorthand = f"computations({step.target})"
        program, names = _apply(self.program, step)
        after = {n.name for n in program.nodes}
        for n in self.program.nodes:
            if n.name not in after:
                self._removed[n.name] = (_took_over(step, n.name, program), len(self.steps))
        self.program = program
        self.steps.append(step)
        self._shorthands.append(shorthand)
        return names

    def _format_step(self, index: int) -> str:
        return self.steps[index].format(self._shorthands[index])

    # -- printing and JSON ----------------------------------------------------------------------

    def __str__(self) -> str:
        lines = [f"schedule {self.name} of {self.original.name}:"]
        steps = zip(self.steps, self._shorthands, strict=True)
        lines += [f"  {s.format(short)}" for s, short in steps] or ["  (no transformation)"]
        return "\n".join(lines)

    __repr__ = __str__

    def _document(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "name": self.name,
            "program": self.original.name,
            "program_digest": self.original.digest(),
            "steps": [s.to_dict() for s in self.steps],
        }

    def to_json(self) -> str:
        return json.dumps(self._document(), indent=2)

    @classmethod
    def from_json(cls, program: Program, text: str) -> Schedule:
        """Replay a saved schedule onto ``program`` (the program it was recorded on)."""
        if not isinstance(program, Program):
            raise ScheduleError(
                f"from_json replays onto a Program, got {type(program).__name__} {program!r}",
                op="Schedule.from_json",
                hint="Schedule.from_json(program, text): the program the schedule was made for",
            )
        if not isinstance(text, (str, bytes, bytearray)):
            raise ScheduleError(
                f"from_json takes the JSON text, got {type(text).__name__}",
                op="Schedule.from_json",
                hint="pass what Schedule.to_json() returned (for a parsed document: "
                "json.dumps(doc))",
            )
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(
                f"not a schedule JSON document: {e}",
                hint="pass what Schedule.to_json() returned",
            ) from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ScheduleError(
                f"not a {_FORMAT} document",
                hint=f'Schedule.to_json() writes {{"format": "{_FORMAT}", ...}}',
            )
        if data.get("program_digest") not in (None, program.digest()):
            raise ScheduleError(
                f"the schedule was recorded on another program ({data.get('program')!r}, digest "
                f"{data.get('program_digest')}); this is {program.name!r}, digest "
                f"{program.digest()}",
                hint="replay a schedule onto the program it was made for",
            )
        steps = data.get("steps", [])
        if not isinstance(steps, list):
            raise ScheduleError(
                f"the schedule's steps must be a list, got {steps!r}",
                hint="replay a document written by Schedule.to_json",
            )
        s = cls(program, data.get("name"))
        for d in steps:
            s._do(Step.from_dict(d))
        return s

    @property
    def digest(self) -> str:
        """A stable hex digest of the schedule: what the compile cache and the ranks' handshake
        key on.

        It hashes the JSON document (the original program's digest, the schedule's name and
        every step with every name), so two schedules that differ anywhere differ here, even when
        their printed text is the same (``str`` elides long lists of names). Replaying the JSON
        gives the same digest. The document is hashed in a canonical form (sorted keys, no
        indentation), so how ``to_json`` lays the text out does not matter.
        """
        canonical = json.dumps(self._document(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
