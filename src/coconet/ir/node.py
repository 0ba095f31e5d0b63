"""The IR node: one immutable value of a program.

A node is an op applied to input nodes with static attributes. Its type (dtype, global shape,
layout) is inferred by the op's rule when the node is built, so a node that exists is well typed.
Nodes compare by identity; programs compare structurally (see ``Program``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from coconet.errors import SourceLoc
from coconet.ir.ops import Op
from coconet.ir.rules import infer_type  # (the rules read a Node as an Operand: no cycle)
from coconet.ir.types import TensorType

__all__ = ["Node", "make_node"]

Attrs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, eq=False)
class Node:
    op: Op
    inputs: tuple[Node, ...]
    type: TensorType
    attrs: Attrs = ()
    name: str | None = None
    loc: SourceLoc | None = None

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def renamed(self, name: str | None) -> Node:
        return replace(self, name=name)

    def describe(self) -> str:
        """How errors name this value: ``m: f32[N] Replicated`` or ``mul: f32[N] Local``."""
        label = self.name or (repr(self.attr("value")) if self.op is Op.CONST else str(self.op))
        return f"{label}: {self.type}"

    def __repr__(self) -> str:
        return f"Node({self.op}, name={self.name!r}, type={self.type})"


def make_node(
    op: Op,
    inputs: tuple[Node, ...],
    attrs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    loc: SourceLoc | None = None,
) -> Node:
    """Build a node, inferring and checking its type with the op's rule.

    A rule violation becomes the matching ``DSLError`` subclass carrying the op, the operands and
    the user's line ``loc``.
    """
    frozen = tuple(sorted((attrs or {}).items()))
    ty = infer_type(op, inputs, dict(frozen), loc)
    return Node(op, tuple(inputs), ty, frozen, name, loc)
