"""Lowering: a (scheduled) Program -> the ordered list of per-rank steps the emitter writes out.

A step is one of

- ``Compute(node)``: one local op, with the meaning the simulator uses (``coconet.ir.semantics``);
- ``Kernel``: a run of computations of one ``fuse`` group, written as one function that the
  runtime compiles with ``torch.compile`` (or runs eagerly when fused kernels are off);
- ``Start(node)`` / ``Wait(node)``: an asynchronous collective, started as soon as its input is
  ready and waited for just before its first use, so that independent work runs meanwhile.

Keeping the plan a flat list of small steps is what lets later passes wrap a sub-list in a chunk
loop (overlap groups) without touching the emitter's per-step code.

Fused groups with a collective inside (``fuse(reduce_scatter, update, all_gather)``) become their
collectives plus one kernel per run of computations between them (see ``_units``), wrapped in one
``FusedCollective`` step: the unit a transport may run in a form of its own, such as one pass
(CoCoNet's fused collective: a shared-memory transport reads the peers' slices, reduces, computes
and publishes in one kernel). Which unit takes which form on which transport is decided in
``coconet.codegen.forms``; the plan knows nothing of transports. ``Plan.body`` is the
structured list; ``Plan.steps`` the same with every fused collective flattened into its steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

from coconet.errors import CodegenError
from coconet.ir.chunks import read_in_chunks
from coconet.ir.group import Group, GroupKind
from coconet.ir.node import Node
from coconet.ir.ops import (
    COMMUNICATION,
    LEAVES,
    Op,
)
from coconet.ir.opspec import Lowering, Prop, ops_with, spec
from coconet.ir.program import Program

__all__ = [
    "KERNEL_OPS",
    "ChunkLoop",
    "Compute",
    "FusedCollective",
    "Kernel",
    "Plan",
    "Start",
    "Step",
    "Wait",
    "loop_name",
    "lower",
    "step_inputs",
]

# Ops a fused kernel may contain: local computation with no communication and no rank geometry
# other than what is passed in as arguments.
KERNEL_OPS = ops_with(Prop.KERNEL)

# Ops whose result is a new tensor that no one else holds, so a collective may reuse its buffer.
_FRESH = ops_with(Prop.FRESH)


@dataclass(frozen=True)
class Compute:
    node: Node


@dataclass(frozen=True)
class Start:
    node: Node
    donate: bool  # the operand is a temporary used only here: the collective may overwrite it


@dataclass(frozen=True)
class Wait:
    node: Node


@dataclass(frozen=True)
class Kernel:
    name: str
    group: Group
    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]  # values computed outside the kernel (constants excluded)
    outputs: tuple[Node, ...]  # members read after the kernel, in program order
    chunked: bool = False  # inside a ChunkLoop: dropout also takes the chunk's global rows


@dataclass(frozen=True)
class ChunkLoop:
    name: str  # "overlap_<k>": the k-th group of the program
    group: Group
    stages: tuple[tuple[Compute | Start | Wait | Kernel, ...], ...]
    chunked: tuple[Node, ...]  # values from outside the chain, read chunk by chunk
    outputs: tuple[Node, ...]  # members read after the loop, reassembled from their chunks

    @property
    def chunks(self) -> int:
        return self.group.chunks

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return tuple(s for stage in self.stages for s in stage if isinstance(s, Kernel))


@dataclass(frozen=True)
class FusedCollective:
    """A ``fuse`` group with collectives inside, as one unit: its collectives and the computation
    between them (kernels, and the scalar arithmetic that runs once), in the order they run.

    Nothing outside the unit runs between its first and its last step, so a transport can run it
    as one pass. Its steps read only values computed before it, and what it computes is read
    after it.
    """

    name: str  # "fused_collective_<k>"
    group: Group
    steps: tuple[Compute | Start | Wait | Kernel, ...]

    @property
    def collectives(self) -> tuple[Node, ...]:
        return tuple(s.node for s in self.steps if isinstance(s, Start))

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return tuple(s for s in self.steps if isinstance(s, Kernel))


Step = Compute | Start | Wait | Kernel | ChunkLoop | FusedCollective


@dataclass(frozen=True)
class Deferral:
    """A collective of a ``defer`` group: started once the step has committed, from a snapshot
    of its operand that only it holds, and landed at the next call's start: its wait, then the
    computations up to its updates (``coconet.schedule.defer``).

    ``prelude``: the values the landing reads that are made of constants and sizes only,
    computed again there (the step's own copies are gone by then)."""

    collective: Node
    snapshot: bool  # the operand outlives the step (an input, an output, an update): copy it
    prelude: tuple[Node, ...]
    chain: tuple[Node, ...]
    updates: tuple[Node, ...]

    @property
    def operand(self) -> Node:
        return self.collective.inputs[0]

    @property
    def lands_in(self) -> tuple[str, ...]:
        return tuple(u.inputs[0].name for u in self.updates)


@dataclass(frozen=True)
class Plan:
    program: Program
    body: tuple[Step, ...]  # what the emitter writes: fused collectives as units
    constants: tuple[Node, ...]
    deferred: tuple[Deferral, ...] = ()  # started after the commit, landed at the next call

    @property
    def steps(self) -> tuple[Step, ...]:
        """The body with each fused collective replaced by its steps: the order they run in."""
        out: list[Step] = []
        for s in self.body:
            out.extend(s.steps if isinstance(s, FusedCollective) else (s,))
        return tuple(out)

    @property
    def fused_collectives(self) -> tuple[FusedCollective, ...]:
        return tuple(s for s in self.body if isinstance(s, FusedCollective))

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        out: list[Kernel] = []
        for s in self.steps:
            if isinstance(s, Kernel):
                out.append(s)
            elif isinstance(s, ChunkLoop):
                out.extend(s.kernels)
        return tuple(out)

    @property
    def loops(self) -> tuple[ChunkLoop, ...]:
        return tuple(s for s in self.steps if isinstance(s, ChunkLoop))

def lower(program: Program, donate: frozenset[str] = frozenset()) -> Plan:
    """The per-rank steps of ``program`` in an order that respects every dependency.

    ``donate``: inputs the caller lets the step overwrite (a collective reading only them reduces
    in place).
    """
    _check_groups(program)
    deferred = _deferrals(program)
    later = {n.name for d in deferred for n in (d.collective, *d.chain, *d.updates)}
    units = _units(program, exclude=later)
    order = _topo(units)
    kept = frozenset(d.operand.name for d in deferred)
    steps = _with_waits(program, order, donate=donate, kept=kept)
    consts = tuple(n for n in program.nodes if n.op is Op.CONST)
    plan = Plan(program, tuple(_fused_collectives(program, steps)), consts, deferred)
    _check_order(plan)
    return plan


def _deferrals(program: Program) -> tuple[Deferral, ...]:
    """Each ``defer`` group as the collective, its snapshot, and its landing."""
    out = []
    returned = {n.name for n in program.outputs} | {u.inputs[1].name for u in program.updates}
    for g in program.groups:
        if g.kind is not GroupKind.DEFER:
            continue
        collective, *chain = (program.node(m) for m in g.members)
        members = set(g.members)
        updates = tuple(u for u in program.updates if u.inputs[1].name in members)
        prelude: set[str] = set()
        stack = [i for n in chain for i in n.inputs if i.name not in members]
        while stack:
            n = stack.pop()
            if n.op not in LEAVES and n.name not in prelude:
                prelude.add(n.name)
                stack.extend(n.inputs)
        x = collective.inputs[0]
        snapshot = x.op not in _FRESH or x.name in returned
        before = tuple(n for n in program.nodes if n.name in prelude)
        out.append(Deferral(collective, snapshot, before, tuple(chain), updates))
    return tuple(out)


def _check_order(plan: Plan) -> None:
    """Every step reads only values computed before it, and waits only for started collectives:
    what the emitted code relies on. A violation is coconet's bug, caught here rather than as a
    NameError on the ranks."""
    known = {n.name for n in plan.program.nodes if n.op in LEAVES}
    started: set[str] = set()
    for d in plan.deferred:  # the landing reads its wait, leaves and what it computes again
        inside = known | {n.name for n in (d.collective, *d.prelude, *d.chain)}
        outside = {i.name for n in (*d.prelude, *d.chain) for i in n.inputs} - inside
        if outside:
            raise CodegenError(
                f"internal: the landing of {d.collective.name} reads {sorted(outside)}",
                op="defer",
                hint="a coconet bug: please report the program and schedule (print(schedule))",
            )
    for s in plan.steps:
        missing = sorted(_reads(s) - known)
        if isinstance(s, Wait) and s.node.name not in started:
            missing.append(f"the start of {s.node.name}")
        if missing:
            what = s.name if isinstance(s, (Kernel, ChunkLoop)) else s.node.name
            raise CodegenError(
                f"internal: step {what} would run before {', '.join(missing)}",
                op="lower",
                hint="a coconet bug: please report the program and schedule (print(schedule))",
            )
        if isinstance(s, Start):
            started.add(s.node.name)
        known |= _produces(s)


def loop_name(program: Program, group: Group) -> str:
    """The name of an overlap group's loop: its position among the program's groups."""
    return f"overlap_{program.groups.index(group) + 1}"


def _check_groups(program: Program) -> None:
    overlapped = {m for g in program.groups if g.kind is GroupKind.OVERLAP for m in g.members}
    for g in program.groups:
        if g.kind is GroupKind.FUSE:
            inside = [m in overlapped for m in g.members]
            if any(inside) and not all(inside):
                raise CodegenError(
                    f"{g} lies partly inside an overlapped chain",
                    op="fuse",
                    hint="fuse a group wholly inside the overlapped chain, or wholly outside it",
                )


# -- units: single nodes and fused runs ---------------------------------------------------------


@dataclass
class _Unit:
    nodes: list[Node]
    group: Group | None  # set for a kernel
    first: int  # program position of the first node (the scheduling priority)


def _units(
    program: Program, only: set[str] | None = None, exclude: set[str] = frozenset()
) -> list[_Unit]:
    """Single nodes, and kernels: the computations of one fuse group between two of its
    collectives.

    A member goes as late as it can: into the run just before the first collective of its group
    that depends on it (after the last one, when none does), so that in
    ``fuse(reduce_scatter, update, all_gather)`` the scalar bias corrections join the update's
    kernel instead of forming a kernel of their own before the reduce_scatter. A member joins its
    run's current kernel unless that would make a cycle between units (the kernel would both feed
    and read some other unit); then it starts a new kernel.

    An overlap group is one unit (its members are lowered on their own by ``_loop``); with
    ``only``, just those nodes are made into units (the members of one overlap group). Nodes in
    ``exclude`` (deferred collectives and their landings) are not the step's.
    """
    index = {n.name: i for i, n in enumerate(program.nodes)}
    run_of = _runs(program)
    units: list[_Unit] = []
    unit_of: dict[str, int] = {}  # node name -> its unit
    after: list[set[int]] = []  # unit -> the units that read from it
    open_kernel: dict[tuple[Group, int], int] = {}
    overlap_of = {
        m: g
        for g in program.groups
        if g.kind is GroupKind.OVERLAP and only is None
        for m in g.members
    }
    overlap_unit: dict[Group, int] = {}

    def reaches(src: int, dst: int) -> bool:
        stack, seen = [src], {src}
        while stack:
            u = stack.pop()
            if u == dst:
                return True
            for v in after[u] - seen:
                seen.add(v)
                stack.append(v)
        return False

    for n in program.nodes:
        if n.op in LEAVES or (only is not None and n.name not in only) or n.name in exclude:
            continue
        producers = {unit_of[i.name] for i in n.inputs if i.name in unit_of}
        group = overlap_of.get(n.name)
        if group is not None:
            # the chain is one unit: no outside value sits between its members (overlap's check)
            if group not in overlap_unit:
                overlap_unit[group] = len(units)
                units.append(_Unit([], group, index[n.name]))
                after.append(set())
            k = overlap_unit[group]
            units[k].nodes.append(n)
            unit_of[n.name] = k
            for p in producers - {k}:
                after[p].add(k)
            continue
        run = run_of.get(n.name)
        k = open_kernel.get(run) if run is not None else None
        if k is not None and any(p != k and reaches(k, p) for p in producers):
            k = None  # joining would close a cycle: start a new kernel for this run
        if k is None:
            k = len(units)
            units.append(_Unit([], run[0] if run is not None else None, index[n.name]))
            after.append(set())
            if run is not None:
                open_kernel[run] = k
        units[k].nodes.append(n)
        unit_of[n.name] = k
        for p in producers - {k}:
            after[p].add(k)
    return units


def _runs(program: Program) -> dict[str, tuple[Group, int]]:
    """For each kernel-able member of a fuse group: (group, run), run r lying between the group's
    r-th and (r+1)-th collective, as late as the member's dependents allow.

    A member that no collective of the group reads (Lion's momentum, whose new value the
    all_gather does not need) joins the last run that feeds a collective, or the first run
    after the collectives it reads when that is later: the group stays one kernel where its
    data allows (one pass over shared memory), rather than a second kernel after the gather.
    When no member feeds a collective (LAMB's first group, closed by its reduce_scatter), such
    members go after the last collective, with the rest of the computation.
    """
    out: dict[str, tuple[Group, int]] = {}
    users = program.users()
    for g in program.groups:
        if g.kind is not GroupKind.FUSE:
            continue
        members = [program.node(m) for m in g.members]
        comms = [m.name for m in sorted(members, key=_position(program)) if m.op in COMMUNICATION]
        loose: list[Node] = []
        feeding = -1  # the last run that feeds a collective (-1: none does)
        for m in members:
            if m.op not in KERNEL_OPS or _scalar_only(m):
                continue
            reached = _downstream(m.name, users)
            later = [j for j, c in enumerate(comms) if c in reached]
            if later:
                out[m.name] = (g, min(later))
                feeding = max(feeding, min(later))
            else:
                loose.append(m)
        for m in loose:
            if feeding < 0:
                out[m.name] = (g, len(comms))
                continue
            read = _upstream(m)
            after_read = 1 + max((j for j, c in enumerate(comms) if c in read), default=-1)
            out[m.name] = (g, max(feeding, after_read))
    return out


def _upstream(node: Node) -> set[str]:
    seen: set[str] = set()
    stack = [node]
    while stack:
        for i in stack.pop().inputs:
            if i.name not in seen:
                seen.add(i.name)
                stack.append(i)
    return seen


def _scalar_only(n: Node) -> bool:
    """Arithmetic on 0-d values only (``1 - beta1 ** step``): it runs once, before the kernel.

    Inside a compiled kernel Inductor would recompute it for every element (a ``pow`` per
    element, for Adam's bias corrections): a float64 step inside the kernel made it compute in
    double per element, 2.5-3x slower, when it was measured on the development machines.
    """
    return n.type.rank == 0 and all(i.type.rank == 0 for i in n.inputs)


def _position(program: Program):
    index = {n.name: i for i, n in enumerate(program.nodes)}
    return lambda n: index[n.name]


def _downstream(name: str, users: dict[str, list[Node]]) -> set[str]:
    seen: set[str] = set()
    stack = [name]
    while stack:
        for u in users[stack.pop()]:
            if u.name not in seen:
                seen.add(u.name)
                stack.append(u.name)
    return seen


def _topo(units: list[_Unit]) -> list[_Unit]:
    """Kahn's algorithm: among the ready units, collectives first (started as early as their
    inputs allow, so they are in flight while other work runs), then by program position, so the
    order stays close to the user's."""
    producer: dict[str, int] = {}
    for k, u in enumerate(units):
        for n in u.nodes:
            producer[n.name] = k
    deps: list[set[int]] = []
    for k, u in enumerate(units):
        d = {producer[i.name] for n in u.nodes for i in n.inputs if i.name in producer}
        d.discard(k)
        deps.append(d)
    users: list[list[int]] = [[] for _ in units]
    for k, d in enumerate(deps):
        for p in d:
            users[p].append(k)
    missing = [len(d) for d in deps]

    def priority(k: int) -> tuple[int, int, int]:
        u = units[k]
        is_comm = u.group is None and u.nodes[0].op in COMMUNICATION
        return (0 if is_comm else 1, u.first, k)

    ready = [priority(k) for k, u in enumerate(units) if missing[k] == 0]
    heapq.heapify(ready)
    order: list[_Unit] = []
    while ready:
        k = heapq.heappop(ready)[-1]
        order.append(units[k])
        for c in users[k]:
            missing[c] -= 1
            if missing[c] == 0:
                heapq.heappush(ready, priority(c))
    if len(order) != len(units):  # pragma: no cover - _units never makes a cycle
        raise CodegenError("internal error: fused runs form a cycle", op="fuse")
    return order


# -- steps --------------------------------------------------------------------------------------


def _with_waits(
    program: Program, order: list[_Unit], prefix: str = "", donate: frozenset[str] = frozenset(),
    kept: frozenset[str] = frozenset(),
) -> list[Step]:
    """``kept``: values the step hands on (a deferred collective's operand), as if returned."""
    users = program.users()
    returned = {n.name for n in program.outputs} | {u.inputs[1].name for u in program.updates}
    returned |= kept
    pending: dict[str, Node] = {}  # started collectives not yet waited for
    steps: list[Step] = []
    kernel_count = 0

    def wait_for(nodes: list[Node]) -> None:
        for n in nodes:
            for i in n.inputs:
                if i.name in pending:
                    steps.append(Wait(pending.pop(i.name)))

    for u in order:
        wait_for(u.nodes)
        if u.group is not None and u.group.kind is GroupKind.OVERLAP:
            steps.append(_loop(program, u.group, users, returned, donate))
            continue
        if u.group is not None:
            kernel_count += 1
            kernel = _kernel(f"{prefix}fused_{kernel_count}", u, users, returned)
            steps.append(replace(kernel, chunked=bool(prefix)))
            continue
        (n,) = u.nodes
        if n.op in COMMUNICATION:
            steps.append(Start(n, _donatable(n, users, returned, donate)))
            pending[n.name] = n
        else:
            steps.append(Compute(n))
    steps.extend(Wait(n) for n in pending.values())
    return steps


def _kernel(name: str, u: _Unit, users: dict[str, list[Node]], returned: set[str]) -> Kernel:
    members = {n.name for n in u.nodes}
    inputs: list[Node] = []
    seen: set[str] = set()
    for n in u.nodes:
        for i in n.inputs:
            if i.name not in members and i.op is not Op.CONST and i.name not in seen:
                seen.add(i.name)
                inputs.append(i)
    outputs = [
        n
        for n in u.nodes
        if n.name in returned or any(c.name not in members for c in users[n.name])
    ]
    return Kernel(name, u.group, _reductions_last(u.nodes), tuple(inputs), tuple(outputs))


def _reductions_last(nodes: Sequence[Node]) -> tuple[Node, ...]:
    """``nodes`` (a kernel's, in a valid order) with each reduction as late as what reads it
    allows: the same values, but torch.compile (Inductor's CPU scheduler) fuses a reduction into
    the loop of the elementwise work traced before it, and leaves one traced first in a loop of
    its own, which reads the shared inputs a second time (a speculative step's sum of squares
    before its update: 8 ms more over 8M elements here)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    waiting = {n.name: len({i.name for i in n.inputs if i.name in index}) for n in nodes}
    readers: dict[str, list[Node]] = {n.name: [] for n in nodes}
    for n in nodes:
        for i in {i.name for i in n.inputs if i.name in index}:
            readers[i].append(n)

    def key(n: Node) -> tuple[bool, int]:
        return spec(n.op).lowering is Lowering.REDUCTION, index[n.name]

    ready = [key(n) + (n.name,) for n in nodes if waiting[n.name] == 0]
    heapq.heapify(ready)
    by_name = {n.name: n for n in nodes}
    order: list[Node] = []
    while ready:
        n = by_name[heapq.heappop(ready)[2]]
        order.append(n)
        for r in readers[n.name]:
            waiting[r.name] -= 1
            if waiting[r.name] == 0:
                heapq.heappush(ready, key(r) + (r.name,))
    return tuple(order)


def _donatable(
    n: Node, users: dict[str, list[Node]], returned: set[str], donate: frozenset[str]
) -> bool:
    """The operand is a temporary (or a donated input) that only this collective reads: its
    buffer can be reused."""
    x = n.inputs[0]
    reusable = x.op in _FRESH or (x.op is Op.INPUT and x.name in donate)
    return reusable and len(users[x.name]) == 1 and x.name not in returned


def _loop(
    program: Program, group: Group, users, returned: set[str], donate: frozenset[str]
) -> ChunkLoop:
    """An overlap group as a chunk loop: its members' steps, cut into stages at each wait."""
    name = loop_name(program, group)
    members = set(group.members)
    inner = _with_waits(program, _topo(_units(program, members)), f"{name}_", donate)
    stages: list[list[Step]] = [[]]
    for step in inner:
        if isinstance(step, Wait) and stages[-1] and not isinstance(stages[-1][-1], Wait):
            stages.append([])
        stages[-1].append(step)
    by_name = {n.name: n for n in program.nodes}
    rows = by_name[group.members[0]].type.shape[0]
    chunked: dict[str, Node] = {}
    for m in group.members:
        node = by_name[m]
        for k, i in enumerate(node.inputs):
            if i.name in members or i.op is Op.CONST:
                continue
            if read_in_chunks(node, k, i, members, rows):
                chunked.setdefault(i.name, i)
    outputs = tuple(
        by_name[m]
        for m in group.members
        if m in returned or any(u.name not in members for u in users[m])
    )
    return ChunkLoop(
        name, group, tuple(tuple(st) for st in stages), tuple(chunked.values()), outputs
    )


# -- fused collectives ---------------------------------------------------------------------------


def _fused_collectives(program: Program, steps: list[Step]) -> list[Step]:
    """Wrap the steps of each fuse group that contains a collective into a ``FusedCollective``.

    The group's steps span from its first to its last step; other steps that fall in that span
    (independent work the scheduler interleaved) move before it when they read nothing the group
    computes, else after it when the group reads nothing they compute. A group whose span cannot
    be cleared that way stays as flat steps (it still runs correctly, just not as one unit).
    Groups inside overlapped chains are pipelined stage by stage instead (``ChunkLoop``).
    """
    out = list(steps)
    count = 0
    for group in program.groups:
        members = set(group.members)
        if group.kind is not GroupKind.FUSE:
            continue
        if not any(spec(program.node(m).op).has(Prop.COMMUNICATES) for m in members):
            continue
        inside = [i for i, s in enumerate(out) if _belongs(s, group, members)]
        if not inside or not any(isinstance(out[i], Start) for i in inside):
            continue  # the group lies inside a chunk loop
        lo, hi = inside[0], inside[-1]
        mine = [out[i] for i in inside]
        others = [s for s in out[lo : hi + 1] if not _belongs(s, group, members)]
        tainted = {n for s in mine for n in _produces(s)}  # the group's values and their users'
        before, after = [], []
        started_after: set[str] = set()  # collectives whose start moved after the group
        for s in others:
            # a wait goes where its start went (it reads the collective's buffer, not a value)
            waits_for_later = isinstance(s, Wait) and s.node.name in started_after
            if _reads(s) & tainted or waits_for_later:
                after.append(s)
                tainted |= _produces(s)
                if isinstance(s, Start):
                    started_after.add(s.node.name)
            else:
                before.append(s)
        read = {n for s in mine for n in _reads(s)}
        if any(_produces(s) & read for s in after):
            continue  # interleaved both ways: leave the group as flat steps
        count += 1
        unit = FusedCollective(f"fused_collective_{count}", group, tuple(mine))
        out = out[:lo] + before + [unit] + after + out[hi + 1 :]
    return out


def _belongs(step: Step, group: Group, members: set[str]) -> bool:
    if isinstance(step, Kernel):
        return step.group == group
    return isinstance(step, (Compute, Start, Wait)) and step.node.name in members


def _produces(step: Step) -> set[str]:
    """Values a step makes available (a collective's at its wait)."""
    if isinstance(step, Kernel):
        return {n.name for n in step.nodes}
    if isinstance(step, (Compute, Wait)):
        return {step.node.name}
    if isinstance(step, ChunkLoop):
        return set(step.group.members)
    if isinstance(step, FusedCollective):  # an earlier group's unit inside this group's span
        return {n for s in step.steps for n in _produces(s)}
    return set()


def _reads(step: Step) -> set[str]:
    if isinstance(step, Kernel):
        return {i.name for i in step.inputs}
    if isinstance(step, (Compute, Start)):
        return {i.name for i in step.node.inputs}
    if isinstance(step, ChunkLoop):
        members = set(step.group.members)
        nodes = [n for n in step.stages for n in n]
        return {i.name for s in nodes for i in step_inputs(s)} - members
    if isinstance(step, FusedCollective):
        return {n for s in step.steps for n in _reads(s)} - _produces(step)
    return set()  # a wait reads its own collective's buffer


def step_inputs(step: Step) -> tuple[Node, ...]:
    if isinstance(step, Kernel):
        return step.inputs
    if isinstance(step, (Compute, Start)):
        return step.node.inputs
    return ()
