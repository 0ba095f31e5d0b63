"""A Program: the nodes of one distributed step, named, ordered, verified and printable.

Building a Program walks the graph back from its outputs and updates, gives every node a unique
name (the user's, or ``<op>_<k>``), re-creates the nodes with those names in topological order and
verifies the result. Two programs are equal when their printed forms are equal, so a schedule
replayed from JSON gives a program equal to the one it was recorded on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from coconet.errors import DSLError, UnknownNameError
from coconet.ir.group import Group, GroupKind
from coconet.ir.node import Node
from coconet.ir.ops import LEAVES, Op
from coconet.ir.rules import infer_type
from coconet.ir.types import Dim

__all__ = ["Program", "format_attr"]


def _node_of(x: Any) -> Node:
    node = getattr(x, "node", x)
    if not isinstance(node, Node):
        raise DSLError(
            f"expected a coconet Tensor, got {type(x).__name__}: {x!r}",
            hint="program inputs and outputs are Tensors built with the coconet DSL",
        )
    return node


def _values(what: str, values: Any, program: Any) -> list[Any]:
    """``values`` as a list, refusing a lone Tensor or string (a list of one was meant)."""
    lone = isinstance(getattr(values, "node", values), Node) or isinstance(values, str)
    if lone or not isinstance(values, Iterable):
        example = "[x]" if what == "inputs" else "[y], or {'y': y}"
        raise DSLError(
            f"program {program}: {what} must be a list of Tensors, got {type(values).__name__} "
            f"{values!r}",
            op="Program",
            hint=f"wrap it in a list: Program(name, inputs, outputs) with {what}={example}",
        )
    return list(values)


def _not_groups(program: str, value: Any) -> DSLError:
    return DSLError(
        f"program {program}: groups is a list of coconet Groups, got {value!r}",
        op="Program",
        hint="groups come from schedule primitives: Schedule(program).fuse([...])",
    )


def format_attr(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if hasattr(value, "value") and hasattr(value, "name") and not isinstance(value, str):
        return str(value.value)  # enums
    if isinstance(value, tuple):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    return str(value)


class Program:
    """One step of a distributed program.

    ``inputs`` are the tensors and scalars the step reads; ``outputs`` the values it returns (a
    list, or a dict to name them) and the ``update(...)`` results, the new values of inputs.
    """

    def __init__(
        self,
        name: str,
        inputs: Iterable[Any],
        outputs: Iterable[Any] | Mapping[str, Any],
        *,
        groups: Iterable[Group] = (),
    ) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise DSLError(
                f"program name must be an identifier, got {name!r}",
                op="Program",
                hint='name it like a Python function: Program("adam", inputs, outputs)',
            )
        self.name = name
        overrides: dict[int, str] = {}
        if isinstance(outputs, Mapping):
            for key in outputs:
                if not isinstance(key, str) or not key.isidentifier():
                    raise DSLError(
                        f"program {name}: output names are identifiers, got {key!r}",
                        op="Program",
                        hint="key the outputs by name: {'loss': loss}",
                    )
            outs = [_node_of(v) for v in outputs.values()]
            keyed: dict[int, str] = {}
            for key, n in zip(outputs, outs, strict=True):
                if n.op is not Op.UPDATE and keyed.setdefault(id(n), key) != key:
                    # one value has one name: the first key would vanish from the outputs
                    raise DSLError(
                        f"program {name}: outputs {keyed[id(n)]!r} and {key!r} are the same "
                        f"value ({n.describe()})",
                        loc=n.loc,
                        hint=f"return it once, or a computed copy under {key!r}",
                    )
                if n.op is Op.INPUT and key != n.name:
                    raise DSLError(
                        f"program {name}: output {key!r} is the input {n.name!r}; an input is "
                        "returned under its own name",
                        loc=n.loc,
                        hint=f"use the key {n.name!r}, or return a computed copy",
                    )
                if n.op is not Op.UPDATE:
                    overrides[id(n)] = key
        else:
            outs = [_node_of(v) for v in _values("outputs", outputs, name)]
        ins = [_node_of(v) for v in _values("inputs", inputs, name)]
        for n in ins:
            if n.op is not Op.INPUT:
                raise DSLError(
                    f"program {name}: inputs must be tensors declared with Tensor(...) or "
                    f"Scalar(...), got a computed value ({n.describe()})",
                    loc=n.loc,
                )
        self._key: str | None = None
        self._build(ins, outs, overrides)
        if not isinstance(groups, Iterable) or isinstance(groups, Group):
            raise _not_groups(name, groups)
        self.groups: tuple[Group, ...] = tuple(groups)
        for g in self.groups:
            if not isinstance(g, Group):
                raise _not_groups(name, g)
        self.verify()

    # -- construction ---------------------------------------------------------------------------

    def _build(self, ins: list[Node], outs: list[Node], overrides: dict[int, str]) -> None:
        order = _topo_order(ins, outs)
        declared = {id(n) for n in ins}
        for n in order:
            if n.op is Op.INPUT and id(n) not in declared:
                raise DSLError(
                    f"program {self.name}: tensor {n.name!r} is used but not among the inputs",
                    loc=n.loc,
                    hint=f"add {n.name} to Program({self.name!r}, inputs=[...])",
                )
        names = _assign_names(order, overrides)
        rebuilt: dict[int, Node] = {}
        for n in order:
            new_inputs = tuple(rebuilt[id(i)] for i in n.inputs)
            rebuilt[id(n)] = replace(n, inputs=new_inputs, name=names[id(n)])
        self.nodes: tuple[Node, ...] = tuple(rebuilt[id(n)] for n in order)
        self.inputs: tuple[Node, ...] = tuple(rebuilt[id(n)] for n in ins)
        self.outputs: tuple[Node, ...] = tuple(
            rebuilt[id(n)] for n in outs if n.op is not Op.UPDATE
        )
        self.updates: tuple[Node, ...] = tuple(rebuilt[id(n)] for n in outs if n.op is Op.UPDATE)
        # DSL handles (the user's nodes) -> this program's nodes; kept alive so ids stay unique.
        self._handles = {id(n): (n, rebuilt[id(n)]) for n in order}
        self._by_name = {n.name: n for n in self.nodes}

    @classmethod
    def from_nodes(
        cls,
        name: str,
        inputs: Iterable[Node],
        outputs: Iterable[Node],
        updates: Iterable[Node],
        groups: Iterable[Group] = (),
    ) -> Program:
        """A program from already-named nodes (what schedule primitives produce)."""
        return cls(name, list(inputs), [*outputs, *updates], groups=groups)

    def verify(self) -> None:
        """Re-check every node's type with its op's rule and the program-level invariants."""
        seen_inputs: dict[str, Node] = {}
        for n in self.inputs:
            # Two different inputs with one name are caught when names are assigned.
            if n.name in seen_inputs:
                raise DSLError(
                    f"program {self.name}: {n.name!r} is listed twice among the inputs",
                    loc=n.loc,
                    hint="list each input once",
                )
            seen_inputs[n.name] = n
        for n in self.nodes:
            if n.op is Op.INPUT:
                continue
            ty = infer_type(n.op, n.inputs, dict(n.attrs), n.loc)
            if ty != n.type:
                raise DSLError(
                    f"program {self.name}: node {n.name} has type {n.type} but its rule gives {ty}",
                    loc=n.loc,
                )
        targets: dict[str, Node] = {}
        input_ids = {id(n) for n in self.inputs}
        for u in self.updates:
            target = u.inputs[0]
            if id(target) not in input_ids:
                raise DSLError(f"program {self.name}: update of {target.name}, not an input")
            if target.name in targets:
                raise DSLError(
                    f"program {self.name}: {target.name} is updated twice",
                    loc=u.loc,
                    hint="a tensor gets one new value per step; combine the expressions",
                )
            targets[target.name] = u
        grouped: set[str] = set()
        for g in self.groups:
            for m in g.members:
                if m not in self._by_name or self._by_name[m].op in LEAVES:
                    raise DSLError(f"program {self.name}: {g} names {m!r}, not a computed value")
                if g.kind is GroupKind.FUSE and m in grouped:
                    raise DSLError(f"program {self.name}: {m} is in two fused groups")
            if g.kind is GroupKind.FUSE:
                grouped.update(g.members)
        if not self.outputs and not self.updates:
            raise DSLError(f"program {self.name} has no outputs and no updates: it does nothing")
        # A size (x / N) is bound from the inputs' shapes when the step runs: N must be one.
        bound = {d.name for n in self.inputs for d in n.type.shape if isinstance(d, Dim)}
        for n in self.nodes:
            if n.op is Op.SIZE:
                free = [d.name for d in n.attr("dims") if isinstance(d, Dim)]
                unbound = [d for d in free if d not in bound]
                if unbound:
                    raise DSLError(
                        f"program {self.name}: the size {', '.join(unbound)} is not a size of any "
                        "input, so nothing binds it when the step runs",
                        op="size",
                        loc=n.loc,
                        hint=f"the inputs' sizes are {sorted(bound) or 'fixed ints'}; divide by "
                        "one of them",
                    )

    # -- lookup ---------------------------------------------------------------------------------

    def node(self, ref: Any) -> Node:
        """This program's node for a name, one of its nodes, or a DSL handle that built it."""
        if isinstance(ref, str):
            if ref not in self._by_name:
                raise UnknownNameError(
                    f"program {self.name} has no value named {ref!r}",
                    op="Program.node",
                    hint=self._names_hint(),
                )
            return self._by_name[ref]
        node = getattr(ref, "node", ref)
        if isinstance(node, Node):
            if node.name in self._by_name and self._by_name[node.name] is node:
                return node
            if id(node) in self._handles:
                return self._handles[id(node)][1]
        raise UnknownNameError(
            f"{ref!r} is not a value of program {self.name}",
            op="Program.node",
            hint="refer to a value by its name, or by a Tensor this program was built from; "
            + self._names_hint(),
        )

    def _names_hint(self, limit: int = 40) -> str:
        names = [n.name for n in self.nodes]
        more = f", ... ({len(names)} values)" if len(names) > limit else ""
        return "its values are " + ", ".join(names[:limit]) + more

    def users(self) -> dict[str, list[Node]]:
        """name -> the nodes that read it."""
        out: dict[str, list[Node]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i.name].append(n)
        return out

    def input(self, name: str) -> Node:
        for n in self.inputs:
            if n.name == name:
                return n
        raise UnknownNameError(
            f"program {self.name} has no input named {name!r}",
            op="Program.input",
            hint=f"its inputs are {[n.name for n in self.inputs]}",
        )

    @property
    def mesh_axes(self) -> frozenset[str]:
        """The named mesh axes the program's collectives and layouts use."""
        axes = set()
        for n in self.nodes:
            if n.attr("axis") is not None:
                axes.add(n.attr("axis"))
            if n.type.layout.axis is not None:
                axes.add(n.type.layout.axis)
        return frozenset(axes)

    # -- printing, equality, hashing ------------------------------------------------------------

    def _arg(self, n: Node) -> str:
        if n.op is Op.CONST:
            return format_attr(n.attr("value"))
        if n.op is Op.SIZE:  # x / N prints as div(x, N)
            return "*".join(str(d) for d in n.attr("dims")) or "1"
        if n.op in (Op.WORLD_SIZE, Op.AXIS_INDEX):
            axis = n.attr("axis")
            return f"{n.op}({axis})" if axis is not None else f"{n.op}()"
        return n.name

    def format_node(self, n: Node) -> str:
        args = [self._arg(i) for i in n.inputs]
        # Attributes at their "nothing special" value (axis=None: the whole world) are left out.
        args += [f"{k}={format_attr(v)}" for k, v in n.attrs if v is not None and v is not False]
        if n.op is Op.UPDATE:
            return f"update({', '.join(args)})"
        return f"{n.name} = {n.op}({', '.join(args)})"

    def __str__(self) -> str:
        params = ", ".join(f"{n.name}: {n.type}" for n in self.inputs)
        lines = [f"program {self.name}({params}):"]
        body = [(self.format_node(n), str(n.type)) for n in self.nodes if n.op not in LEAVES]
        width = max((len(s) for s, _ in body), default=0)
        for stmt, ty in body:
            lines.append(f"  {stmt.ljust(width)}  # {ty}")
        if self.outputs:
            lines.append("  return " + ", ".join(n.name for n in self.outputs))
        for g in self.groups:
            lines.append(f"  # schedule: {g}")
        return "\n".join(lines)

    __repr__ = __str__

    def structural_key(self) -> str:
        # A program never changes after construction: print it once (runtimes hash it per step).
        if self._key is None:
            self._key = str(self)
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Program) and self.structural_key() == other.structural_key()

    def __hash__(self) -> int:
        return hash(self.structural_key())

    def digest(self) -> str:
        """A stable hex digest of the program's structure (for caches and cross-rank checks)."""
        return hashlib.sha256(self.structural_key().encode()).hexdigest()[:16]


def _topo_order(ins: list[Node], outs: list[Node]) -> list[Node]:
    """Inputs first in their declared order, then every node after its operands (iterative DFS)."""
    order: list[Node] = list(ins)
    done = {id(n) for n in ins}
    for root in outs:
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, i = stack.pop()
            if id(node) in done:
                continue
            if i < len(node.inputs):
                stack.append((node, i + 1))
                child = node.inputs[i]
                if id(child) not in done:
                    stack.append((child, 0))
            else:
                done.add(id(node))
                order.append(node)
    return order


def _assign_names(order: list[Node], overrides: dict[int, str]) -> dict[int, str]:
    """User names where given (they must be unique), else ``<op>_<k>`` numbered per op."""
    names: dict[int, str] = {}
    taken: dict[str, Node] = {}
    for n in order:
        given = overrides.get(id(n), n.name)
        if given is not None and n.op is not Op.UPDATE:
            if not given.isidentifier():
                raise DSLError(f"value name {given!r} is not an identifier", loc=n.loc)
            other = taken.get(given)
            if other is not None and other is not n:
                raise DSLError(
                    f"two different values are named {given!r}",
                    loc=n.loc,
                    details=[
                        f"first: {other.describe()} at {other.loc}",
                        f"second: {n.describe()} at {n.loc}",
                    ],
                    hint="give each value its own name",
                )
            taken[given] = n
            names[id(n)] = given
    counters: dict[Op, int] = {}
    for n in order:
        if id(n) in names:
            continue
        while True:
            counters[n.op] = counters.get(n.op, 0) + 1
            candidate = f"{n.op.value}_{counters[n.op]}"
            if candidate not in taken:
                break
        taken[candidate] = n
        names[id(n)] = candidate
    return names
