"""Lowering forms: how each transport runs the units of a plan, registered per transport.

A plan (``coconet.codegen.plan``) says what runs in which order; it knows nothing of transports.
A transport may run some units in a form of its own instead of step by step (the JAX way: a
primitive's lowering registered per platform). This module is the one place that decides which
unit takes which form: the emitter writes each unit in the form ``forms()`` gives it, and the cost
model predicts that same form, so the two cannot disagree.

The forms (``Form``):

- ``PLAIN``: the unit's steps one after the other (every transport; the only form of
  torch.distributed);
- ``ONE_PASS``: a fused collective, or each chunk of an overlapped chain, as one kernel that reads
  every peer's slice of a ``reduce_scatter``'s input and/or writes an ``all_gather``'s input into
  this rank's slot of the gather (``OnePass``: CoCoNet's computation inside the collective);
- ``READ_IN_PLACE``: an all_reduce whose one elementwise consumer kernel reads the reduced value
  where each slice's owner reduced it (``ReadInPlace``);
- ``PUBLISHED``: a one-pass unit's gather that stays in the peers' slots until the commit copies
  it into the caller's tensor (the gather is the commit);
- ``CONTROL``: a scalar all_reduce over the whole mesh after a published gather, run over the
  communicator's control channel (every rank's value gathered exactly, reduced in rank order):
  the published gather holds its group's epoch open until the commit, so the scalar cannot take
  that group's next epoch (a speculative step's norm, computed in the same pass as the update).

Each transport registers the matchers of the forms it has (``REGISTRY``); a transport with none
runs everything plainly. ``missing_transports()`` names a transport the registry lacks (a test
keeps it empty). Adding a transport: its entry here, its overrides of the emitter's default
lowering (an ``Emission``, ``coconet.codegen.lowering``, registered in
``coconet.codegen.emissions``; shared memory's is ``coconet.codegen.emit_shm``), its transport
class.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from coconet.codegen.plan import (
    ChunkLoop,
    Compute,
    FusedCollective,
    Kernel,
    Plan,
    Start,
    Step,
    Wait,
    step_inputs,
)
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.opspec import Lowering, Prop, spec
from coconet.options import TransportKind

__all__ = [
    "Form",
    "Forms",
    "OnePass",
    "REGISTRY",
    "ReadInPlace",
    "TransportForms",
    "forms",
    "loop_one_pass",
    "missing_transports",
    "one_pass",
    "reads_in_place",
]


class Form(enum.Enum):
    """The form a unit of a plan takes on its transport."""

    PLAIN = "plain"
    ONE_PASS = "one pass"
    READ_IN_PLACE = "read in place"
    PUBLISHED = "published"
    CONTROL = "control"


@dataclass(frozen=True)
class OnePass:
    """A fused collective in the form a shared-memory transport runs as one pass: a kernel that
    reads every peer's slice of a ``reduce_scatter``'s input (along dim 0) and reduces them itself,
    in rank order, and/or writes an ``all_gather``'s input straight into this rank's slot of the
    gather, where the peers read it:

    - ``reduce_scatter -> (scalar arithmetic) -> kernel -> all_gather`` (Adam's fuse_RS_C_AG);
    - ``reduce_scatter -> kernel`` and ``kernel -> all_gather`` (halves: a unit that a collective
      outside the group cuts in two, such as LAMB's all_reduce of the partial norms).
    """

    reduce_scatter: Node | None
    kernel: Kernel
    all_gather: Node | None
    scalars: tuple[Compute, ...]  # arithmetic on 0-d values that runs once, before the kernel

    @property
    def axis(self) -> str | None:
        return (self.reduce_scatter or self.all_gather).attr("axis")


@dataclass(frozen=True)
class ReadInPlace:
    """An all_reduce whose only reader is one elementwise kernel over values of its shape (AR_C's
    update): a shared-memory transport leaves the reduced value where each slice's owner wrote
    it, and the kernel runs slice by slice on it there, so the result is never copied into a
    tensor of this rank's own. Bitwise the same as one call: every op of the kernel computes
    each element alone and rounds the same on any slice (no ``Prop.ROUNDS_PER_KERNEL`` op)."""

    all_reduce: Node
    kernel: Kernel


# -- the matchers: which units have a form's structure (whatever runs them) ----------------------


def one_pass(unit: FusedCollective) -> OnePass | None:
    """The unit's ``OnePass`` form: one kernel; steps Start(rs), Compute*, Wait(rs), Compute*,
    Kernel (reading the reduce_scatter), Start(ag of a kernel output), Wait(ag), or one half of
    that (no rs: Compute*, Kernel, Start(ag), Wait(ag); no ag: ending at the kernel); both
    collectives along dim 0 and over one axis."""
    starts = [s.node for s in unit.steps if isinstance(s, Start)]
    kernels = unit.kernels
    if len(kernels) != 1 or not 1 <= len(starts) <= 2:
        return None
    (kernel,) = kernels
    rs = starts[0] if starts[0].op is Op.REDUCE_SCATTER else None
    ag = starts[-1] if starts[-1].op is Op.ALL_GATHER else None
    if len(starts) != (rs is not None) + (ag is not None):
        return None
    if rs is not None and (rs.type.layout.dim != 0 or rs not in kernel.inputs):
        return None
    made = {n.name for n in kernel.outputs}
    if ag is not None and (ag.inputs[0].type.layout.dim != 0 or ag.inputs[0].name not in made):
        return None
    if rs is not None and ag is not None and rs.attr("axis") != ag.attr("axis"):
        return None
    k = unit.steps.index(kernel)
    after = [type(s) for s in unit.steps[k + 1 :]]
    if after != ([Start, Wait] if ag is not None else []):
        return None
    if not all(
        (isinstance(s, Compute) and rs not in s.node.inputs)
        or (isinstance(s, (Start, Wait)) and s.node is rs)
        for s in unit.steps[:k]
    ):
        return None
    scalars = tuple(s for s in unit.steps[:k] if isinstance(s, Compute))
    return OnePass(rs, kernel, ag, scalars)


def loop_one_pass(loop: ChunkLoop) -> OnePass | None:
    """A chain whose only collectives are a reduce_scatter and an all_gather along dim 0 over one
    axis, with one kernel that alone reads the reduce_scatter and makes the gather's input:
    each chunk runs as a ``OnePass`` (its scalars: none; the chain has no 0-d values)."""
    steps = [s for stage in loop.stages for s in stage]
    starts = [s.node for s in steps if isinstance(s, Start)]
    if len(starts) != 2:
        return None
    rs, ag = starts
    if rs.op is not Op.REDUCE_SCATTER or ag.op is not Op.ALL_GATHER:
        return None
    if rs.type.layout.dim != 0 or ag.inputs[0].type.layout.dim != 0:
        return None
    if rs.attr("axis") != ag.attr("axis"):
        return None
    readers = [
        s for s in steps if isinstance(s, (Compute, Kernel, Start)) and rs in step_inputs(s)
    ]
    if len(readers) != 1 or not isinstance(readers[0], Kernel):
        return None
    (kernel,) = readers
    if ag.inputs[0] not in kernel.outputs:
        return None
    return OnePass(rs, kernel, ag, ())


def reads_in_place(plan: Plan) -> tuple[ReadInPlace, ...]:
    """Top-level ``Start(ar) ... Wait(ar) ... Kernel`` with nothing communicating in between
    (the transport keeps the group's epoch open until the kernel is done), the kernel the only
    reader of ``ar``, elementwise, and every tensor it reads or writes shaped like ``ar``."""
    out = []
    users = plan.program.users()
    body = plan.body
    for i, s in enumerate(body):
        if not isinstance(s, Start) or s.node.op is not Op.ALL_REDUCE:
            continue
        ar = s.node
        k = next(
            (
                j
                for j in range(i + 1, len(body))
                if isinstance(body[j], Kernel) and ar in body[j].inputs
            ),
            None,
        )
        if k is None:
            continue
        kernel = body[k]
        between = body[i + 1 : k]
        if not all(
            isinstance(t, Compute) or (isinstance(t, Wait) and t.node is ar) for t in between
        ):
            continue
        members = {n.name for n in kernel.nodes}
        if kernel.chunked or not all(u.name in members for u in users[ar.name]):
            continue
        if any(n.name == ar.name for n in plan.program.outputs):
            continue
        shape = ar.type.shape
        if not all(
            spec(n.op).lowering is Lowering.POINTWISE
            and not spec(n.op).has(Prop.ROUNDS_PER_KERNEL)
            for n in kernel.nodes
        ):
            continue
        if not all(i.type.rank == 0 or i.type.shape == shape for i in kernel.inputs):
            continue
        if not all(n.type.shape == shape for n in kernel.outputs):
            continue
        out.append(ReadInPlace(ar, kernel))
    return tuple(out)


# -- the registry: the forms each transport has --------------------------------------------------


@dataclass(frozen=True)
class TransportForms:
    """The forms one transport has: for each kind of unit, the matcher that finds the units it
    runs in a form of its own (None: it runs that kind of unit plainly)."""

    fused_collective: Callable[[FusedCollective], OnePass | None] | None = None
    chunk_loop: Callable[[ChunkLoop], OnePass | None] | None = None
    all_reduce: Callable[[Plan], tuple[ReadInPlace, ...]] | None = None
    # whether a one-pass gather read only by updates may stay in the peers' slots until the
    # commit (``Form.PUBLISHED``)
    publishes: bool = False


REGISTRY: dict[TransportKind, TransportForms] = {
    TransportKind.TORCH_DISTRIBUTED: TransportForms(),
    TransportKind.SHARED_MEMORY: TransportForms(
        fused_collective=one_pass,
        chunk_loop=loop_one_pass,
        all_reduce=reads_in_place,
        publishes=True,
    ),
    # two levels of plain collectives (coconet.runtime.hierarchy): no form of its own yet
    TransportKind.HIERARCHICAL: TransportForms(),
}


def missing_transports() -> list[TransportKind]:
    """Transports without an entry in ``REGISTRY`` (kept empty by a test)."""
    return [t for t in TransportKind if t not in REGISTRY]


@dataclass(frozen=True)
class Forms:
    """The form of every unit of one plan on the transports that run it (``forms()``)."""

    plan: Plan
    transports: Mapping[str | None, TransportKind]
    default: TransportKind  # the transport of an axis ``transports`` does not name
    units: Mapping[str, OnePass] = field(default_factory=dict)  # fused collective -> one pass
    loops: Mapping[str, OnePass] = field(default_factory=dict)  # chunk loop -> each chunk's
    in_place: Mapping[str, ReadInPlace] = field(default_factory=dict)  # by all_reduce name
    published: frozenset[str] = frozenset()  # all_gathers left for the commit to copy
    control: frozenset[str] = frozenset()  # scalar all_reduces over the control channel

    def transport(self, axis: str | None) -> TransportKind:
        """What runs the collectives along ``axis``."""
        return self.transports.get(axis, self.default)

    def of(self, step: Step) -> Form:
        """The form ``step`` (a unit of the plan's body) takes."""
        if isinstance(step, FusedCollective):
            return Form.ONE_PASS if step.name in self.units else Form.PLAIN
        if isinstance(step, ChunkLoop):
            return Form.ONE_PASS if step.name in self.loops else Form.PLAIN
        if isinstance(step, Start) and step.node.name in self.in_place:
            return Form.READ_IN_PLACE
        if isinstance(step, Start) and step.node.name in self.control:
            return Form.CONTROL
        return Form.PLAIN

    def one_pass(self, step: FusedCollective | ChunkLoop) -> OnePass | None:
        """The one-pass form of a fused collective or of each chunk of a loop (None: plain)."""
        table = self.units if isinstance(step, FusedCollective) else self.loops
        return table.get(step.name)

    def is_published(self, all_gather: Node) -> bool:
        return all_gather.name in self.published

    def commit_target(self, all_gather: Node) -> Node | None:
        """The input a published gather is committed into (the target of the one update that
        reads it; None when several targets read it). Where that input is a host replica the
        transport writes the slots into its spare buffer and the commit flips it
        (``coconet.runtime.replica``)."""
        if not self.is_published(all_gather):
            return None
        updates = self.plan.program.users()[all_gather.name]
        targets = {u.inputs[0].name: u.inputs[0] for u in updates}
        return next(iter(targets.values())) if len(targets) == 1 else None

    @property
    def kernels_in_place(self) -> dict[str, ReadInPlace]:
        """The kernels that read an all_reduce in place, by kernel name."""
        return {r.kernel.name: r for r in self.in_place.values()}

    @property
    def one_pass_kernels(self) -> dict[str, OnePass]:
        """The kernels written in their one-pass form, by kernel name."""
        return {op.kernel.name: op for op in (*self.units.values(), *self.loops.values())}


def forms(
    plan: Plan, transports: Mapping[str | None, TransportKind] | TransportKind | None = None
) -> Forms:
    """The form of each unit of ``plan`` when ``transports`` run its axes' collectives: by axis
    (an axis not named: torch.distributed), or one kind for every axis. The one entry point the
    emitter and the cost model share."""
    if isinstance(transports, TransportKind):
        by_axis, default = {}, transports
    else:
        by_axis, default = dict(transports or {}), TransportKind.TORCH_DISTRIBUTED

    def registered(axis: str | None) -> TransportForms:
        return REGISTRY[by_axis.get(axis, default)]

    units: dict[str, OnePass] = {}
    for unit in plan.fused_collectives:
        match = registered(unit.collectives[0].attr("axis")).fused_collective
        if match is not None and (found := match(unit)) is not None:
            units[unit.name] = found
    loops: dict[str, OnePass] = {}
    for loop in plan.loops:
        axes = [s.node.attr("axis") for st in loop.stages for s in st if isinstance(s, Start)]
        match = registered(axes[0]).chunk_loop if axes else None
        if match is not None and (found := match(loop)) is not None:
            loops[loop.name] = found
    in_place: dict[str, ReadInPlace] = {}
    for kind in REGISTRY.values():
        for r in kind.all_reduce(plan) if kind.all_reduce is not None else ():
            if registered(r.all_reduce.attr("axis")) is kind:
                in_place[r.all_reduce.name] = r
    published = frozenset(
        op.all_gather.name
        for unit in plan.fused_collectives
        if (op := units.get(unit.name)) is not None
        and op.all_gather is not None
        and registered(op.axis).publishes
        and _only_committed(plan, op.all_gather)
        and not _communicates_after(plan, unit)
    )
    control = frozenset(
        s.node.name
        for unit in plan.fused_collectives
        if (op := units.get(unit.name)) is not None and op.all_gather is not None
        and op.all_gather.name in published
        for s in plan.body[plan.body.index(unit) + 1 :]
        if isinstance(s, Start) and _rides_control(s.node)
    )
    return Forms(plan, by_axis, default, units, loops, in_place, published, control)


def _rides_control(node: Node) -> bool:
    """A scalar all_reduce over the whole mesh: the control channel runs it (``Form.CONTROL``),
    so it does not keep a gather before it from being published."""
    return node.op is Op.ALL_REDUCE and node.type.rank == 0 and node.attr("axis") is None


def _only_committed(plan: Plan, all_gather: Node) -> bool:
    """Read by updates alone (not an output): its value is needed only by the commit."""
    program = plan.program
    return all_gather.name not in {n.name for n in program.outputs} and all(
        u.op is Op.UPDATE for u in program.users()[all_gather.name]
    )


def _communicates_after(plan: Plan, unit: FusedCollective) -> bool:
    """Whether any collective runs after ``unit`` in the step: a published gather holds its
    group's epoch open until the commit, so a later collective would wait for peers that wait
    for it."""
    later = plan.body[plan.body.index(unit) + 1 :]
    return any(
        (isinstance(s, Start) and not _rides_control(s.node))
        or isinstance(s, FusedCollective)
        or (isinstance(s, ChunkLoop) and any(isinstance(t, Start) for st in s.stages for t in st))
        for s in later
    )
