"""reorder: run computations on slices before an all_gather instead of on whole values after it.

Before (after ``split(g_sum)``)::

    g_sum_rs = reduce_scatter(g)                 # f32[N] Sliced(dim=0)
    g_sum = all_gather(g_sum_rs)                 # f32[N] Replicated
    m_new = add(mul(beta1, m), g_sum)            # f32[N] Replicated
    update(m, m_new)

After ``reorder([mul_1, m_new], g_sum)``::

    g_sum_rs = reduce_scatter(g)                 # f32[N] Sliced(dim=0)
    m_slice = scatter(m)                         # f32[N] Sliced(dim=0)   (no communication)
    mul_1_slice = mul(beta1, m_slice)            # f32[N] Sliced(dim=0)
    m_new_slice = add(mul_1_slice, g_sum_rs)     # f32[N] Sliced(dim=0)
    m_new = all_gather(m_new_slice)              # f32[N] Replicated
    update(m, m_new)

Every computation reads slices: the all_gather's input instead of its output, ``scatter`` of
Replicated values that span the sliced dim, and the sliced versions of the other reordered
computations. A reordered value that is still needed whole (an output, an update, a computation
that is not reordered) is all-gathered under its old name. Reductions over the sliced dim become a
partial reduction plus an all_reduce of the partials: ``norm(x)`` becomes
``sqrt(all_reduce(sum(x_slice * x_slice)))``, so a norm never gathers the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coconet.errors import ScheduleError
from coconet.ir.node import Node
from coconet.ir.ops import RANDOM, REDUCTIONS, Op, ReduceOp
from coconet.ir.opspec import Prop, ops_with
from coconet.ir.program import Program
from coconet.schedule.graph import a_or_an, fresh_name, new_node, resolve, rewrite, value_list
from coconet.schedule.regroup import recheck_groups

__all__ = ["REORDERABLE", "apply_reorder", "check_reorder"]

REORDERABLE = ops_with(Prop.REORDERABLE)


def check_reorder(
    program: Program, computations: Iterable[Any], all_gather: Any
) -> tuple[Node, list[Node]]:
    """(the all_gather, the computations in program order), or a ScheduleError saying why not."""
    ag = resolve(program, all_gather, "reorder")
    if ag.op is not Op.ALL_GATHER:
        hint = "split(...) the all_reduce first" if ag.op is Op.ALL_REDUCE else None
        raise ScheduleError(
            f"{ag.name} is {a_or_an(ag.op)}, not an all_gather",
            op="reorder",
            loc=ag.loc,
            hint=hint or "reorder moves computations before an all_gather",
        )
    refs = value_list(computations, "reorder")
    if not refs:
        raise ScheduleError(
            "no computations to reorder",
            op="reorder",
            hint=f"reorder(s.computations({ag.name!r}), {ag.name!r}) moves what reads it",
        )
    chosen = {resolve(program, r, "reorder").name for r in refs}
    order = [n for n in program.nodes if n.name in chosen]
    for n in order:
        if n.op not in REORDERABLE:
            raise ScheduleError(
                f"{n.name} is {a_or_an(n.op)}; only pointwise computations, reductions and sends "
                "can run on slices",
                op="reorder",
                loc=n.loc,
                hint=f"leave {n.name} out of the list",
            )
    depends = _dependents(program, ag, chosen)
    if not depends:
        raise ScheduleError(
            f"none of the computations reads {ag.name}",
            op="reorder",
            loc=ag.loc,
            hint=f"list computations that use {ag.name} (directly or through each other)",
        )
    for n in order:
        for i in n.inputs:
            if i.type.layout.is_local and i.name not in chosen:
                raise ScheduleError(
                    f"{n.name} reads the Local value {i.name}: a Local value cannot be sliced "
                    "without a reduction",
                    op="reorder",
                    loc=n.loc,
                    hint=f"reduce {i.name} first, or leave {n.name} out",
                )
    # A value that is already Sliced (an earlier reorder moved it before another all_gather, or
    # the program computes it on slices) or Local has no whole form to move: slicing it again
    # would gather a slice of a slice.
    not_whole = [n for n in order if not n.type.layout.is_replicated]
    if not_whole:
        listed = ", ".join(f"{n.name} ({n.type.layout})" for n in not_whole)
        one = len(not_whole) == 1
        raise ScheduleError(
            f"{listed} {'is' if one else 'are'} not whole (Replicated) and already "
            f"{'runs' if one else 'run'} on slices or per rank: reorder moves only computations "
            f"of whole values onto the slices of {ag.name}",
            op="reorder",
            loc=not_whole[0].loc,
            hint=f"leave {', '.join(n.name for n in not_whole)} out; "
            f"s.computations({ag.name!r}) lists only the values that can move",
        )
    return ag, order


def _dependents(program: Program, ag: Node, chosen: set[str]) -> set[str]:
    reached = {ag.name}
    for n in program.nodes:
        if n.name in chosen and any(i.name in reached for i in n.inputs):
            reached.add(n.name)
    return reached - {ag.name}


def apply_reorder(program: Program, computations: Iterable[Any], all_gather: Any) -> Program:
    ag, order = check_reorder(program, computations, all_gather)
    return _Reorder(program, ag, order).run()


class _Reorder:
    def __init__(self, program: Program, ag: Node, order: list[Node]) -> None:
        self.program = program
        self.ag = ag
        self.sliced = ag.inputs[0]  # the value before the gather: Sliced(dim, axis)
        self.dim = self.sliced.type.layout.dim
        self.axis = self.sliced.type.layout.axis
        self.order = order
        self.chosen = {n.name for n in order}
        self.new: dict[str, Node] = {ag.name: self.sliced}  # old name -> its reordered value
        self.scatters: dict[tuple[str, int], Node] = {}
        self.taken: set[str] = set()

    def name(self, base: str) -> str:
        out = fresh_name(self.program, base, self.taken)
        self.taken.add(out)
        return out

    def slice_dim_of(self, v: Node) -> int | None:
        """The dim of Replicated ``v`` that lines up with the gathered dim, if ``v`` spans it."""
        d = self.dim + (v.type.rank - self.ag.type.rank)
        if 0 <= d < v.type.rank and v.type.shape[d] == self.ag.type.shape[self.dim]:
            return d
        return None

    def scatter(self, v: Node, d: int) -> Node:
        key = (v.name, d)
        if key not in self.scatters:
            self.scatters[key] = new_node(
                "reorder",
                Op.SCATTER,
                (v,),
                {"dim": d, "axis": self.axis},
                name=self.name(f"{v.name}_slice"),
                like=v,
            )
        return self.scatters[key]

    def run(self) -> Program:
        for c in self.order:
            self.new[c.name] = self.transform(c)
        mapping: dict[str, Node] = {}
        users = self.program.users()
        outputs = {n.name for n in self.program.outputs}
        for c in self.order:
            v = self.new[c.name]
            live = c.name in outputs or any(u.name not in self.chosen for u in users[c.name])
            if not live:
                continue
            if v.type.layout.is_sliced:
                mapping[c.name] = new_node(
                    "reorder",
                    Op.ALL_GATHER,
                    (v,),
                    {"axis": v.type.layout.axis},
                    name=c.name,
                    like=c,
                )
            else:
                mapping[c.name] = v
        return rewrite("reorder", self.program, mapping, recheck=recheck_groups)

    def transform(self, c: Node) -> Node:
        inputs = [self.new.get(i.name, i) for i in c.inputs]
        # dropout's seed and step are not data: never slice them
        data = range(1) if c.op in RANDOM else range(len(inputs))
        spans = {
            k
            for k in data
            if inputs[k].type.layout.is_replicated
            and inputs[k].type.rank > 0
            and self.slice_dim_of(inputs[k]) is not None
        }
        if not spans and not any(i.type.layout.is_sliced for i in inputs):
            # Nothing to slice (scalars only): the computation stays whole, under its own name.
            if all(a is b for a, b in zip(inputs, c.inputs, strict=True)):
                return c
            return new_node("reorder", c.op, inputs, dict(c.attrs), name=c.name, like=c)
        for k in spans:
            inputs[k] = self.scatter(inputs[k], self.slice_dim_of(inputs[k]))
        if c.op in REDUCTIONS:
            return self.reduction(c, inputs[0])
        return new_node(
            "reorder", c.op, inputs, dict(c.attrs), name=self.name(f"{c.name}_slice"), like=c
        )

    def reduction(self, c: Node, x: Node) -> Node:
        """A reduction of a slice: whole if it keeps the sliced dim, else partial + all_reduce."""
        lay = x.type.layout
        dim = c.attr("dim")
        over_slices = lay.is_sliced and (dim is None or dim % x.type.rank == lay.dim)
        if not over_slices:
            return new_node(
                "reorder", c.op, (x,), dict(c.attrs), name=self.name(f"{c.name}_slice"), like=c
            )
        attrs = dict(c.attrs)
        if c.op is Op.NORM:
            sq = new_node("reorder", Op.MUL, (x, x), name=self.name(f"{c.name}_sq"), like=c)
            part = new_node(
                "reorder", Op.SUM, (sq,), attrs, name=self.name(f"{c.name}_partial"), like=c
            )
            total = new_node(
                "reorder",
                Op.ALL_REDUCE,
                (part,),
                {"reduce_op": ReduceOp.SUM, "axis": lay.axis},
                name=self.name(f"{c.name}_sumsq"),
                like=c,
            )
            return new_node("reorder", Op.SQRT, (total,), name=c.name, like=c)
        reduce_op = ReduceOp.SUM if c.op is Op.SUM else ReduceOp.MAX
        part = new_node("reorder", c.op, (x,), attrs, name=self.name(f"{c.name}_partial"), like=c)
        return new_node(
            "reorder",
            Op.ALL_REDUCE,
            (part,),
            {"reduce_op": reduce_op, "axis": lay.axis},
            name=c.name,
            like=c,
        )
