"""defer: a collective started at the end of one step and waited for at the start of the next.

Before (Overlap Local-SGD's sync, ``avg`` an input that only the program writes)::

    z_new = add(z, v_new)                      # f32[N] Replicated: the anchor moves to the average
    x_new = add(x, mul(pull, sub(z_new, x)))   # f32[N] Local: the model pulled toward it
    avg_sum = all_reduce(x_new)                # f32[N] Replicated
    avg_new = div(avg_sum, world)              # f32[N] Replicated
    update(avg, avg_new)                       # ... which the next step reads as ``avg``

After ``defer(avg_sum)`` the nodes are unchanged and the program carries
``# schedule: defer(avg_sum, avg_new)``. The compiled step starts ``avg_sum`` once the step has
committed on every rank, from a snapshot of ``x_new`` that belongs to the collective alone, and
returns; the next call waits for it first, computes ``avg_new`` and writes it into ``avg``, then
runs its own body. Whatever the caller does between the two calls (Local-SGD's local steps)
runs while the collective is in flight.

Why it means what the program says (the simulator's meaning, unchanged): the program's next read
of ``avg`` is the next call's, and the wait comes before it. ``CompiledStep.wait_deferred()``
lands an average in flight at once (to read ``avg`` between calls, or to save it).

What makes a collective deferrable, each refused with both lines named when it does not hold:

- its value reaches only updates of inputs, through computations (the *landing*): nothing in its
  own step reads it before its wait, an output included;
- the landing reads nothing else that an input or another collective makes: the next call would
  read that value as this call's commit (or the caller) left it, not as this step saw it. So two
  collectives never land in one buffer (each would read the other before its wait), and each
  in-flight collective owns its snapshot and its landing buffer;
- it is not fused or overlapped (the other primitives refuse its members likewise), and it is
  deferred once.

Waited for exactly once holds by the lowering: every call lands what the previous one started
before it starts its own, and a landing that fails drops the work (raised, nothing written).
"""

from __future__ import annotations

from typing import Any

from coconet.errors import ScheduleError
from coconet.ir.group import Group, GroupKind
from coconet.ir.node import Node
from coconet.ir.ops import COLLECTIVES, LEAVES, Op
from coconet.ir.program import Program
from coconet.schedule.graph import a_or_an, resolve

__all__ = ["apply_defer", "check_defer", "deferred_members", "landing", "refuse_deferred"]


def _line(n: Node) -> str:
    return f"{n.name} ({n.loc})" if n.loc is not None else n.name


def _depends_on_input(node: Node) -> Node | None:
    """An input or collective ``node`` is computed from (None: constants and sizes only)."""
    stack, seen = [node], {id(node)}
    while stack:
        n = stack.pop()
        if n.op is Op.INPUT or n.op in COLLECTIVES:
            return n
        for i in n.inputs:
            if id(i) not in seen:
                seen.add(id(i))
                stack.append(i)
    return None


def landing(program: Program, collective: Node) -> tuple[list[Node], list[Node]]:
    """(the computations between ``collective`` and its updates, in program order; those
    updates), or a ScheduleError naming what reads the value before its wait."""
    chain: list[Node] = []
    updates: list[Node] = []
    reached = {collective.name}
    outputs = {n.name for n in program.outputs}
    for n in program.nodes:
        if not any(i.name in reached for i in n.inputs):
            continue
        if n.op is Op.UPDATE:
            if n.inputs[1].name in reached:
                updates.append(n)
                continue
        elif n.op not in COLLECTIVES and n.op is not Op.SEND:
            reached.add(n.name)
            chain.append(n)
            continue
        raise ScheduleError(
            f"{_line(n)} reads {_line(collective)} in the step that starts it: a deferred "
            "collective's value is there only at the next step's start, after its wait",
            op="defer",
            loc=n.loc,
            details=[f"the collective: {_line(collective)}", f"the reader: {_line(n)}"],
            hint=f"defer a collective whose value only updates inputs; keep {collective.name} "
            "in its step",
        )
    for n in [collective, *chain]:
        if n.name in outputs:
            raise ScheduleError(
                f"{_line(n)} is an output of the step, and depends on the deferred "
                f"{_line(collective)}: the caller would read it before its wait",
                op="defer",
                loc=n.loc,
                details=[f"the collective: {_line(collective)}", f"the output: {_line(n)}"],
                hint=f"return {n.name} from the next step instead (as the update of an input "
                "it reads)",
            )
        for other in n.inputs if n is not collective else ():  # (its operand: the snapshot)
            if other.name in reached or (other.op in LEAVES and other.op is not Op.INPUT):
                continue
            source = _depends_on_input(other)
            if source is None:
                continue  # made of constants and sizes: the landing computes it again
            raise ScheduleError(
                f"{_line(n)} reads {_line(other)} with the deferred {_line(collective)}: at the "
                f"next step's start, where it lands, {source.name} is no longer what this step "
                "read",
                op="defer",
                loc=n.loc,
                details=[
                    f"the collective: {_line(collective)}",
                    f"the other value: {_line(other)}, made from {_line(source)}",
                ],
                hint="land the collective's value alone (update(avg, all_reduce(x) / world)) "
                "and combine it with the rest in the next step, where it is read",
            )
    # (every node of a program leads to an output or an update, and an output was refused
    # above: ``updates`` is never empty here)
    return chain, updates


def check_defer(program: Program, collective: Any) -> tuple[Node, list[Node]]:
    """The collective to defer and its landing computations, or a ScheduleError."""
    node = resolve(program, collective, "defer")
    if node.op not in COLLECTIVES:
        raise ScheduleError(
            f"{node.name} is {a_or_an(node.op)}, not a collective",
            op="defer",
            loc=node.loc,
            hint="defer takes one collective (all_reduce, reduce_scatter, all_gather, ...)",
        )
    for g in program.groups:
        if node.name in g.members:
            done = g.kind is GroupKind.DEFER
            raise ScheduleError(
                f"{node.name} is already {'deferred' if done else 'in ' + str(g)}",
                op="defer",
                loc=node.loc,
                hint="defer it once" if done else "defer a collective before fusing or "
                "overlapping, and leave it and its landing out of those groups",
            )
    chain, _ = landing(program, node)
    for n in chain:
        for g in program.groups:
            if n.name in g.members:
                raise ScheduleError(
                    f"{_line(n)}, where the deferred {node.name} lands, is in {g}",
                    op="defer",
                    loc=n.loc,
                    hint="leave the landing's computations out of fuse and overlap groups",
                )
    return node, chain


def apply_defer(program: Program, collective: Any) -> Program:
    """The program with ``collective`` and its landing in a DEFER group (nodes unchanged)."""
    node, chain = check_defer(program, collective)
    group = Group(GroupKind.DEFER, (node.name, *(n.name for n in chain)))
    return Program.from_nodes(
        program.name, program.inputs, program.outputs, program.updates,
        groups=(*program.groups, group),
    )


def deferred_members(program: Program) -> dict[str, Group]:
    """Each node a DEFER group holds -> that group."""
    return {m: g for g in program.groups if g.kind is GroupKind.DEFER for m in g.members}


def refuse_deferred(program: Program, members: list[Node], primitive: str) -> None:
    """A ScheduleError when ``primitive`` would group a deferred collective or its landing."""
    held = deferred_members(program)
    for n in members:
        if n.name in held:
            raise ScheduleError(
                f"{n.name} is in {held[n.name]}: it runs at the next step's start",
                op=primitive,
                loc=n.loc,
                hint=f"leave it out of {primitive}, or do not defer {held[n.name].members[0]}",
            )
