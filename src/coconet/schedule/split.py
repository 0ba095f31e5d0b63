"""split: an all_reduce becomes a reduce_scatter followed by an all_gather.

Before::

    g_sum = all_reduce(g)                      # f32[N] Replicated

After ``split(g_sum)``::

    g_sum_rs = reduce_scatter(g, dim=0)        # f32[N] Sliced(dim=0)
    g_sum = all_gather(g_sum_rs)               # f32[N] Replicated

The all_gather keeps the all_reduce's name: it is the same value, so every user reads it unchanged.
Each rank sends the same number of bytes as before (ring RS + AG = ring AR); what the split buys is
a point between the two collectives where computation can run on slices (see ``reorder``).
"""

from __future__ import annotations

from typing import Any

from coconet.errors import ScheduleError
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.program import Program
from coconet.schedule.graph import a_or_an, fresh_name, new_node, resolve, rewrite
from coconet.schedule.regroup import recheck_groups

__all__ = ["apply_split", "check_split"]


def check_split(program: Program, all_reduce: Any, dim: int = 0) -> Node:
    """The all_reduce node to split, or a ScheduleError naming what blocks it."""
    node = resolve(program, all_reduce, "split")
    if node.op is not Op.ALL_REDUCE:
        mean_of = node.inputs[0] if node.op is Op.DIV else None
        if mean_of is not None and mean_of.op is Op.ALL_REDUCE:
            # all_reduce(x, ReduceOp.MEAN, name=n): n is the division, n_sum the all_reduce
            hint = f"split its all_reduce: split({mean_of.name!r})"
        else:
            hint = "split applies to all_reduce values only"
        raise ScheduleError(
            f"{node.name} is {a_or_an(node.op)}, not an all_reduce",
            op="split",
            loc=node.loc,
            hint=hint,
        )
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ScheduleError(
            f"split's dim must be an int, got {dim!r}",
            op="split",
            loc=node.loc,
            hint=f"split({node.name!r}, dim=0) slices the first dim",
        )
    rank = node.type.rank
    if rank == 0:
        raise ScheduleError(
            f"{node.name} is a scalar all_reduce: there is nothing to slice",
            op="split",
            loc=node.loc,
            hint="keep scalar all_reduces whole",
        )
    if not -rank <= dim < rank:
        raise ScheduleError(
            f"dim={dim} is out of range for {node.describe()}",
            op="split",
            loc=node.loc,
            hint=f"a dim of {node.name} is from {-rank} to {rank - 1}",
        )
    return node


def apply_split(program: Program, all_reduce: Any, dim: int = 0) -> tuple[Program, list[str]]:
    """The program with ``all_reduce`` split, and the names [reduce_scatter, all_gather]."""
    node = check_split(program, all_reduce, dim)
    rs_name = fresh_name(program, f"{node.name}_rs")
    rs = new_node(
        "split",
        Op.REDUCE_SCATTER,
        node.inputs,
        {
            "reduce_op": node.attr("reduce_op"),
            "axis": node.attr("axis"),
            "dim": dim % node.type.rank,
        },
        name=rs_name,
        like=node,
    )
    ag = new_node(
        "split", Op.ALL_GATHER, (rs,), {"axis": node.attr("axis")}, name=node.name, like=node
    )
    return rewrite("split", program, {node.name: ag}, recheck=recheck_groups), [rs_name, node.name]
