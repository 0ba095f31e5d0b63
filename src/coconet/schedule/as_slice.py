"""as_slice: store Replicated persistent state sliced, so each rank keeps 1/world of it.

Before (after ``reorder``, state read through ``scatter`` and written back through an all_gather)::

    program adam(..., m: f32[N] Replicated, ...):
      m_slice = scatter(m)                       # f32[N] Sliced(dim=0)
      m_new_slice = add(mul(beta1, m_slice), g)  # f32[N] Sliced(dim=0)
      m_new = all_gather(m_new_slice)            # f32[N] Replicated
      update(m, m_new)

After ``as_slice(m)``::

    program adam(..., m: f32[N] Sliced(dim=0), ...):
      m_new_slice = add(mul(beta1, m), g)        # f32[N] Sliced(dim=0)
      update(m, m_new_slice)

The input's layout becomes Sliced: each rank passes (and keeps) only its slice. The scatters
disappear and so does the all_gather of the new value (when nothing else reads it whole).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coconet.errors import ScheduleError
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.program import Program
from coconet.ir.types import Sliced, format_shape
from coconet.schedule.graph import new_node, resolve, rewrite, value_list
from coconet.schedule.regroup import recheck_groups

__all__ = ["apply_as_slice", "check_as_slice"]


def check_as_slice(program: Program, tensors: Iterable[Any]) -> list[tuple[Node, int, str | None]]:
    """For each tensor: (input node, sliced dim, axis), or a ScheduleError saying what blocks it."""
    refs = value_list(tensors, "as_slice")
    if not refs:
        raise ScheduleError(
            "no tensors to slice", op="as_slice", hint="name the state inputs: as_slice(['m', 'v'])"
        )
    users = program.users()
    plans = []
    for ref in refs:
        t = resolve(program, ref, "as_slice")
        if t.op is not Op.INPUT:
            raise ScheduleError(
                f"{t.name} is computed by {t.op}, not a program input",
                op="as_slice",
                loc=t.loc,
                hint="as_slice applies to persistent inputs such as optimizer state",
            )
        if not t.type.layout.is_replicated:
            raise ScheduleError(
                f"{t.name} is {t.type.layout}, not Replicated",
                op="as_slice",
                loc=t.loc,
                hint="as_slice stores a Replicated input sliced; this one is not Replicated",
            )
        geometry: set[tuple[int, str | None]] = set()
        for u in users[t.name]:
            if u.op is Op.SCATTER:
                geometry.add((u.type.layout.dim, u.type.layout.axis))
            elif u.op is Op.UPDATE and u.inputs[0] is t:
                new = u.inputs[1]
                if new.op is not Op.ALL_GATHER:
                    raise ScheduleError(
                        f"the new value of {t.name} ({new.name}) is computed whole, not gathered "
                        "from slices",
                        op="as_slice",
                        loc=new.loc,
                        hint=f"reorder the computation of {new.name} before the all_gather first",
                    )
                if new.type.shape != t.type.shape:
                    # A broadcast new value: its slices are not slices of the tensor.
                    raise ScheduleError(
                        f"the new value of {t.name} ({new.describe()}) is broadcast to "
                        f"{t.name}'s shape {format_shape(t.type.shape)}: its slices are not "
                        f"{t.name}'s slices",
                        op="as_slice",
                        loc=new.loc,
                        hint=f"update {t.name} with a value of its own shape",
                    )
                lay = new.inputs[0].type.layout
                geometry.add((lay.dim, lay.axis))
            else:
                raise ScheduleError(
                    f"{u.name} ({u.op}) reads {t.name} whole",
                    op="as_slice",
                    loc=u.loc,
                    hint=f"reorder {u.name} onto slices first, so it reads scatter({t.name})",
                )
        for u in program.updates:
            if u.inputs[0] is t and u.inputs[1].op is Op.ALL_GATHER:
                lay = u.inputs[1].inputs[0].type.layout
                geometry.add((lay.dim, lay.axis))
        if len(geometry) != 1:
            found = ", ".join(f"dim={d} axis={a}" for d, a in sorted(geometry, key=str)) or "none"
            raise ScheduleError(
                f"{t.name} must be read and written in one slicing; found: {found}",
                op="as_slice",
                loc=t.loc,
            )
        ((dim, axis),) = geometry
        plans.append((t, dim, axis))
    return plans


def apply_as_slice(program: Program, tensors: Iterable[Any]) -> Program:
    plans = check_as_slice(program, tensors)
    mapping: dict[str, Node] = {}
    users = program.users()
    for t, dim, axis in plans:
        attrs = {"dtype": t.type.dtype, "shape": t.type.shape, "layout": Sliced(dim, axis)}
        sliced = new_node("as_slice", Op.INPUT, (), attrs, name=t.name, like=t)
        mapping[t.name] = sliced
        for u in users[t.name]:
            if u.op is Op.SCATTER:
                mapping[u.name] = sliced
        for u in program.updates:
            if u.inputs[0] is t:
                gathered = u.inputs[1]
                mapping[u.name] = new_node(
                    "as_slice", Op.UPDATE, (sliced, gathered.inputs[0]), name=u.name, like=u
                )
    return rewrite("as_slice", program, mapping, recheck=recheck_groups)
