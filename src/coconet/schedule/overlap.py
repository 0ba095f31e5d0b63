"""overlap: run a producer-consumer chain chunk by chunk, so communication overlaps computation.

Before (the sequence-parallel tensor-parallel layer)::

    partial = matmul(x, w)                 # f32[B, H] Local
    out_rs = reduce_scatter(partial)       # f32[B, H] Sliced(dim=0)
    y_slice = add(out_rs, bias)            # f32[B, H] Sliced(dim=0)
    y = all_gather(y_slice)                # f32[B, H] Replicated

After ``overlap([partial, out_rs, y_slice, y], chunks=4)`` the nodes are unchanged and the program
carries ``# schedule: overlap(partial, out_rs, y_slice, y, chunks=4)``: the chain runs in 4 chunks
of rows (dim 0), and while chunk i's reduce_scatter is in flight, chunk i+1's matmul computes.

Chunk c of a value is defined so that every op of the chain gives exactly its unchunked result:
- a value Sliced on dim 0: part c of each rank's own rows (``slice_bounds(rows, chunks, c)``);
- a whole value (Local or Replicated) with N rows: the union over the ranks i of the axis of part c
  of rank i's block of rows. A reduce_scatter of that chunk hands rank i exactly part c of its
  block, and an all_gather of the parts rebuilds it, uneven sizes included.
Operands from outside the chain that have the same rows are chunked the same way; others (weights,
biases, scalars) are used whole. The simulator runs overlapped groups chunk by chunk with this
definition, which is what proves a chunked schedule equal to the unchunked program.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coconet.errors import ScheduleError
from coconet.ir.group import Group, GroupKind
from coconet.ir.node import Node
from coconet.ir.ops import COMMUNICATION, REDUCTIONS, Op
from coconet.ir.opspec import Prop, ops_with
from coconet.ir.program import Program
from coconet.schedule.defer import refuse_deferred
from coconet.schedule.fuse import check_nesting, check_no_cycle
from coconet.schedule.graph import group_members, rewrite

__all__ = ["apply_overlap", "check_overlap"]

_ROWWISE = ops_with(Prop.ROWWISE)

# The most chunks a chain may run in. Each chunk is one collective and one kernel call per member
# (a fixed cost of tens of microseconds), so far more chunks than that cost more than any overlap
# saves: 100000 chunks of a 64-element chain made a step take 20 s.
MAX_CHUNKS = 1024


def check_overlap(program: Program, nodes: Iterable[Any], chunks: int) -> list[Node]:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
        raise ScheduleError(
            f"chunks must be an int >= 2, got {chunks!r}",
            op="overlap",
            hint="overlap(nodes, chunks=4)",
        )
    if chunks > MAX_CHUNKS:
        raise ScheduleError(
            f"chunks={chunks} is more than {MAX_CHUNKS}: each chunk costs one collective and one "
            "kernel call per member, far more than overlapping them could save",
            op="overlap",
            hint="a few chunks (2-16) are enough to overlap communication with computation",
        )
    members = group_members(program, nodes, "overlap")
    refuse_deferred(program, members, "overlap")
    if len(members) < 2:
        raise ScheduleError(
            "overlap needs a chain of at least two nodes (a producer and a consumer), got "
            f"{[n.name for n in members]}",
            op="overlap",
            hint="overlap(['g_sum', 'm_new'], chunks=4): a collective and what reads it",
        )
    if not any(n.op in COMMUNICATION for n in members):
        raise ScheduleError(
            "the chain has no communication: there is nothing to overlap",
            op="overlap",
            hint="fuse(...) groups computations; overlap needs a collective or a send",
        )
    for g in program.groups:
        if g.kind is GroupKind.OVERLAP and set(g.members) & {n.name for n in members}:
            raise ScheduleError(
                f"{g} already overlaps some of these nodes",
                op="overlap",
                hint="a value runs in one overlapped chain only",
            )
        if g.kind is GroupKind.FUSE:
            check_nesting(g.members, [n.name for n in members], "overlap")
    check_no_cycle(program, members, "overlap")
    inside = {n.name for n in members}
    for n in members[1:]:
        if not any(i.name in inside for i in n.inputs):
            raise ScheduleError(
                f"{n.name} reads nothing from the rest of the chain: it is not a consumer",
                op="overlap",
                loc=n.loc,
                hint="overlap a producer-consumer chain, each node reading the one before",
            )
    rows = members[0].type.shape[0] if members[0].type.rank else None
    if rows == 1:
        raise ScheduleError(
            f"{members[0].name} has a single row ({members[0].describe()}): there is nothing to "
            "cut into chunks",
            op="overlap",
            loc=members[0].loc,
            hint="overlap a chain whose values have many rows",
        )
    if isinstance(rows, int) and chunks > rows:
        raise ScheduleError(
            f"chunks={chunks} but {members[0].name} has only {rows} rows: some chunks would be "
            "empty",
            op="overlap",
            loc=members[0].loc,
            hint=f"chunks <= {rows}",
        )
    slicing_axes = {
        n.type.layout.axis for n in members if n.type.layout.is_sliced and n.type.layout.dim == 0
    }
    if len(slicing_axes) > 1:
        raise ScheduleError(
            f"the chain is sliced over several axes {sorted(map(str, slicing_axes))}",
            op="overlap",
            hint="overlap a chain whose values are sliced over one mesh axis",
        )
    for n in members:
        why = _not_rowwise(n, rows)
        if why:
            raise ScheduleError(
                f"{n.name} cannot run in chunks of rows: {why}",
                op="overlap",
                loc=n.loc,
                hint=f"leave {n.name} out of the overlapped chain",
            )
    return members


def _not_rowwise(n: Node, rows) -> str | None:
    ty = n.type
    if n.op not in _ROWWISE:
        return f"{n.op} is not computed row by row"
    if ty.rank == 0 or ty.shape[0] != rows:
        return (
            f"its rows ({ty.shape[0] if ty.rank else 'a scalar'}) differ from the chain's ({rows})"
        )
    # reduce_scatter and scatter always give a Sliced value; all_gather a Replicated one, whose
    # input's dim is checked below.
    if n.op in (Op.REDUCE_SCATTER, Op.SCATTER) and ty.layout.dim != 0:
        return "it slices a dim other than 0"
    if n.op is Op.ALL_GATHER and n.inputs[0].type.layout.dim != 0:
        return "it gathers a dim other than 0"
    if n.op in REDUCTIONS:
        dim = n.attr("dim")
        if dim is None or dim % n.inputs[0].type.rank == 0:
            return "it reduces over the rows"
    if n.op is Op.MATMUL and n.inputs[0].type.rank < 2:
        return "its rows are the contraction dim"
    return None


def apply_overlap(program: Program, nodes: Iterable[Any], chunks: int) -> Program:
    members = check_overlap(program, nodes, chunks)
    group = Group(GroupKind.OVERLAP, tuple(n.name for n in members), chunks)
    return rewrite("overlap", program, {}, groups=(*program.groups, group))
