"""Graph helpers the schedule primitives share: rewriting a program, walking users, fresh names."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from coconet.errors import DSLError, ScheduleError, UnknownNameError
from coconet.ir.group import Group
from coconet.ir.node import Node, make_node
from coconet.ir.ops import LEAVES, Op
from coconet.ir.program import Program

# (primitive, rewritten program, new group -> old group) -> None, or a ScheduleError
Recheck = Callable[[str, Program, Mapping[Group, Group]], None]

__all__ = [
    "a_or_an",
    "downstream",
    "fresh_name",
    "group_members",
    "new_node",
    "resolve",
    "rewrite",
    "value_list",
]


def a_or_an(word: Any) -> str:
    """``"an input"``, ``"an all_reduce"``, ``"a div"``: the op as messages name it."""
    text = str(word)
    return f"{'an' if text[:1] in 'aeiou' else 'a'} {text}"


def value_list(values: Any, primitive: str) -> list[Any]:
    """``values`` (names, nodes or Tensors) as a list; a lone name or Tensor is refused, since
    iterating ``"m_new"`` would look up the values ``m``, ``_``, ``n``, ..."""
    lone = isinstance(values, str) or isinstance(getattr(values, "node", values), Node)
    if lone or not isinstance(values, Iterable):
        raise ScheduleError(
            f"{primitive} takes a list of values, got {type(values).__name__} {values!r}",
            op=primitive,
            hint=f"wrap it in a list: {primitive}([{values!r}, ...])",
        )
    return list(values)


def resolve(program: Program, ref: Any, primitive: str) -> Node:
    """The program's node for a name, a node or a DSL handle, or a ScheduleError saying why not."""
    try:
        return program.node(ref)
    except UnknownNameError as e:
        names = ", ".join(n.name for n in program.nodes[:40])
        raise ScheduleError(
            e.message,
            op=primitive,
            hint=f"refer to values by name or by the Tensor that built them; values: {names}",
        ) from None


def fresh_name(program: Program, base: str, taken: set[str] | None = None) -> str:
    """``base`` if unused in ``program`` and ``taken``, else ``base_2``, ``base_3``..."""
    used = {n.name for n in program.nodes} | (taken or set())
    if base not in used:
        return base
    k = 2
    while f"{base}_{k}" in used:
        k += 1
    return f"{base}_{k}"


def new_node(primitive: str, op, inputs, attrs=None, *, name: str, like: Node | None = None):
    """A node made by a schedule primitive, pointing at the user's line of the node it came from.

    A typing error here means the primitive's check missed a case: report it as a ScheduleError.
    """
    try:
        return make_node(op, tuple(inputs), attrs, name=name, loc=like.loc if like else None)
    except DSLError as e:
        raise ScheduleError(
            f"the rewrite would build an ill-typed value: {e.message}",
            op=primitive,
            details=e.details,
            hint=e.hint,
        ) from None


def group_members(program: Program, nodes: Iterable[Any], primitive: str) -> list[Node]:
    """The nodes named by ``nodes``, in program order; leaves and updates cannot be grouped."""
    refs = value_list(nodes, primitive)
    if not refs:
        raise ScheduleError(
            "no nodes given",
            op=primitive,
            hint=f"name the values to group: {primitive}(['a', 'b'])",
        )
    chosen = {resolve(program, r, primitive).name for r in refs}
    members = [n for n in program.nodes if n.name in chosen]
    for n in members:
        if n.op in LEAVES or n.op is Op.UPDATE:
            raise ScheduleError(
                f"{n.name} is {a_or_an(n.op)}: only computations and communication can be "
                "grouped",
                op=primitive,
                loc=n.loc,
                hint=f"leave {n.name} out of the group",
            )
    return members


def downstream(program: Program, start: Node) -> list[Node]:
    """Every node that depends on ``start`` (not ``start`` itself), in program order."""
    reached = {start.name}
    out = []
    for n in program.nodes:
        if any(i.name in reached for i in n.inputs):
            reached.add(n.name)
            out.append(n)
    return out


def rewrite(
    primitive: str,
    program: Program,
    mapping: Mapping[str, Node],
    *,
    inputs: Iterable[Node] | None = None,
    groups: Iterable[Group] | None = None,
    recheck: Recheck | None = None,
) -> Program:
    """The program with each value named in ``mapping`` replaced by the given node.

    Replacement nodes may refer to nodes of the old program (also ones that are themselves
    replaced or whose operands change): everything is re-linked bottom-up, and each node whose
    operands changed is rebuilt with its op's rule, so types (layouts) follow the rewrite.
    ``recheck(primitive, program, was)`` then checks the program's groups again (``was``: each
    new group -> the group it was before the rewrite); the primitives that rewrite grouped
    nodes pass ``coconet.schedule.regroup.recheck_groups``.
    """
    memo: dict[int, Node] = {}
    old = {id(n) for n in program.nodes}
    active: set[int] = set()

    def remap(node: Node) -> Node:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:  # pragma: no cover - a primitive built a cyclic replacement
            raise ScheduleError(f"the rewrite makes {node.name} depend on itself", op=primitive)
        active.add(key)
        if key in old and node.name in mapping and mapping[node.name] is not node:
            result = remap(mapping[node.name])
        else:
            new_inputs = tuple(remap(i) for i in node.inputs)
            if all(a is b for a, b in zip(new_inputs, node.inputs, strict=True)):
                result = node
            else:
                try:
                    result = make_node(
                        node.op, new_inputs, dict(node.attrs), name=node.name, loc=node.loc
                    )
                except DSLError as e:
                    raise ScheduleError(
                        f"after the rewrite, {node.name} no longer type-checks: {e.message}",
                        op=primitive,
                        loc=node.loc,
                        details=e.details,
                        hint=e.hint,
                    ) from None
        active.discard(key)
        memo[key] = result
        return result

    new_inputs = [remap(n) for n in (inputs if inputs is not None else program.inputs)]
    outputs = [remap(n) for n in program.outputs]
    updates = [remap(n) for n in program.updates]
    kept_groups = program.groups if groups is None else tuple(groups)
    try:
        result = Program.from_nodes(program.name, new_inputs, outputs, updates)
    except DSLError as e:
        raise ScheduleError(
            f"the rewritten program is invalid: {e.message}", op=primitive, hint=e.hint
        ) from None
    live_groups, was = [], {}
    for g in kept_groups:
        # Members in the new program order (a rewrite may move them).
        members = tuple(n.name for n in result.nodes if n.name in g.members)
        if members:
            live_groups.append(replace(g, members=members))
            was[live_groups[-1]] = g
    final = Program.from_nodes(
        result.name, result.inputs, result.outputs, result.updates, groups=live_groups
    )
    if recheck is not None:
        recheck(primitive, final, was)
    return final
