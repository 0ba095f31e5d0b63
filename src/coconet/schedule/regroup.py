"""Checking a program's fused groups and overlapped chains again after a rewrite of their nodes.

``split``, ``reorder`` and ``as_slice`` rewrite nodes that earlier ``fuse`` and ``overlap`` steps
may have grouped; each passes ``recheck_groups`` to ``graph.rewrite``. It lives here, above
``fuse`` and ``overlap``, so that ``graph`` (which both of them use) imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping

from coconet.errors import ScheduleError
from coconet.ir.group import Group, GroupKind
from coconet.ir.program import Program
from coconet.schedule.defer import check_defer
from coconet.schedule.fuse import check_fuse
from coconet.schedule.overlap import check_overlap

__all__ = ["recheck_groups"]


def recheck_groups(primitive: str, program: Program, was: Mapping[Group, Group]) -> None:
    """A rewrite of grouped nodes must leave each fused group and overlapped chain legal.

    ``reorder`` after ``overlap`` can, for instance, turn a chain into nodes with an outside value
    between them, which no longer run chunk by chunk; such a rewrite is refused.
    """
    for g in program.groups:
        others = [h for h in program.groups if h is not g]
        bare = Program.from_nodes(
            program.name, program.inputs, program.outputs, program.updates, groups=others
        )
        try:
            if g.kind is GroupKind.FUSE:
                check_fuse(bare, g.members)
            elif g.kind is GroupKind.DEFER:
                _, chain = check_defer(bare, g.members[0])
                if {n.name for n in chain} != set(g.members[1:]):
                    raise ScheduleError(
                        f"its landing would become {[n.name for n in chain]}",
                        op=primitive,
                    )
            else:
                check_overlap(bare, g.members, g.chunks)
        except ScheduleError as e:
            raise ScheduleError(
                f"the rewrite would break {was.get(g, g)}: {e.message}",
                op=primitive,
                hint="apply fuse and overlap after split, reorder and as_slice",
            ) from None
