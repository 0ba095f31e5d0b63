"""fuse: one kernel for a group of computations; with a collective inside, one fused collective.

Before::

    g_sum_rs = reduce_scatter(g)                  # f32[N] Sliced(dim=0)
    m_new = add(mul(beta1, m), g_sum_rs)          # f32[N] Sliced(dim=0)
    p_new_slice = sub(p_slice, mul(lr, m_new))    # f32[N] Sliced(dim=0)
    p_new = all_gather(p_new_slice)               # f32[N] Replicated

After ``fuse([g_sum_rs, mul_1, m_new, mul_2, p_new_slice, p_new])`` the nodes are unchanged and the
program carries ``# schedule: fuse(g_sum_rs, mul_1, m_new, mul_2, p_new_slice, p_new)``: the
compiler emits one kernel for the computation and, since a reduce_scatter and an all_gather are
inside, one fused collective (CoCoNet's FusedAllReduce: the update runs inside the collective).

A group is legal when it has no path that leaves it and comes back (that would be a cycle between
the kernel and the rest of the program) and when its communication is one of the fusable shapes:
at most one reducing or point-to-point op (all_reduce, reduce_scatter, reduce, broadcast or send)
followed by any number of all_gathers of values computed inside the group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coconet.errors import ScheduleError
from coconet.ir.group import Group, GroupKind
from coconet.ir.node import Node
from coconet.ir.ops import COMMUNICATION, COMPUTATION, Op
from coconet.ir.program import Program
from coconet.schedule.defer import refuse_deferred
from coconet.schedule.graph import group_members, rewrite

__all__ = ["apply_fuse", "check_fuse", "check_nesting", "check_no_cycle"]


def check_nesting(fused: Iterable[str], chain: Iterable[str], primitive: str) -> None:
    """Refuse a fuse group that lies partly inside an overlapped chain.

    A fused group is one kernel; an overlapped chain runs chunk by chunk. A group wholly inside
    the chain is one kernel per chunk and a group wholly outside it one kernel for the whole
    value, but a group with members on both sides would have to be one kernel that runs both
    per chunk and once: no code can do that, so the schedule is refused here, where it is
    written, and not by the compiler later.
    """
    fused, chain = tuple(fused), tuple(chain)
    inside = [m for m in fused if m in chain]
    if inside and len(inside) < len(fused):
        outside = [m for m in fused if m not in chain]
        raise ScheduleError(
            f"fuse({', '.join(fused)}) lies partly inside the overlapped chain "
            f"overlap({', '.join(chain)}): {', '.join(inside)} inside, {', '.join(outside)} "
            "outside; a fused kernel cannot run both chunk by chunk and once",
            op=primitive,
            hint="fuse a group wholly inside the overlapped chain (one kernel per chunk), or "
            "wholly outside it",
        )


def check_no_cycle(program: Program, members: list[Node], primitive: str) -> None:
    """Refuse a group that some outside node both reads from and feeds (a cycle once grouped)."""
    inside = {n.name for n in members}
    # outside nodes that depend on the group
    tainted: set[str] = set()
    for n in program.nodes:
        if n.name in inside:
            continue
        if any(i.name in inside or i.name in tainted for i in n.inputs):
            tainted.add(n.name)
    for n in members:
        for i in n.inputs:
            if i.name in tainted:
                raise ScheduleError(
                    f"{i.name} is outside the group, reads the group's results and feeds "
                    f"{n.name}, which is inside: the group would depend on itself",
                    op=primitive,
                    loc=n.loc,
                    hint=f"add {i.name} to the group, or split the group in two",
                )


def check_fuse(program: Program, nodes: Iterable[Any]) -> list[Node]:
    members = group_members(program, nodes, "fuse")
    refuse_deferred(program, members, "fuse")
    for n in members:
        if n.op not in COMPUTATION and n.op not in COMMUNICATION and n.op is not Op.SCATTER:
            raise ScheduleError(
                f"{n.name} ({n.op}) cannot be fused",
                op="fuse",
                loc=n.loc,
                hint=f"leave {n.name} out of the group",
            )
    for g in program.groups:
        if g.kind is GroupKind.FUSE:
            clash = sorted(set(g.members) & {n.name for n in members})
            if clash:
                raise ScheduleError(
                    f"{', '.join(clash)} already {'belongs' if len(clash) == 1 else 'belong'} "
                    f"to {g}",
                    op="fuse",
                    hint="a value is fused into one kernel only",
                )
        else:
            check_nesting([n.name for n in members], g.members, "fuse")
    check_no_cycle(program, members, "fuse")
    comms = [n for n in members if n.op in COMMUNICATION]
    leaders = [n for n in comms if n.op is not Op.ALL_GATHER]
    if len(leaders) > 1:
        raise ScheduleError(
            f"two collectives ({', '.join(n.name for n in leaders)}) cannot be fused: a fused "
            "collective has one reducing or point-to-point step",
            op="fuse",
            hint="fuse each collective with its own computation in separate groups",
        )
    if leaders:
        lead = leaders[0]
        reached = {lead.name}
        for n in members:
            if any(i.name in reached for i in n.inputs):
                reached.add(n.name)
        for n in comms:
            if n.op is Op.ALL_GATHER and n.name not in reached:
                raise ScheduleError(
                    f"{n.name} gathers a value that does not come from {lead.name}: the two "
                    "collectives are independent and cannot become one",
                    op="fuse",
                    loc=n.loc,
                    hint=f"fuse {n.name} separately",
                )
    elif len(comms) > 1:
        raise ScheduleError(
            f"{len(comms)} all_gathers ({', '.join(n.name for n in comms)}) with no collective "
            "feeding them cannot be fused into one",
            op="fuse",
            hint="fuse them each with their own computation",
        )
    return members


def apply_fuse(program: Program, nodes: Iterable[Any]) -> Program:
    members = check_fuse(program, nodes)
    group = Group(GroupKind.FUSE, tuple(n.name for n in members))
    return rewrite("fuse", program, {}, groups=(*program.groups, group))
