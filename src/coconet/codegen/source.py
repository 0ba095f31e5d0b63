"""Small helpers for writing Python source: calls wrapped to a width, comment blocks, and the
code that names a dtype or a value's geometry. Shared by the generic emitter
(``coconet.codegen.emit``) and the per-transport emission modules beside it."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence

from coconet.ir.node import Node
from coconet.ir.types import DType

__all__ = ["INDENT", "GeoRef", "call", "comment_lines", "dtype", "env_geo", "env_ref", "short"]

INDENT = "    "

GeoRef = Callable[[Node, str], str]  # (node, "shapes"|"offsets"|"bounds"|"parts") -> code


def call(target: str, fn: str, args: Sequence[str], width: int = 96) -> list[str]:
    """``target = fn(args)`` (``fn(args)`` without a target) on one line, or with the arguments
    wrapped when that is too long."""
    head = f"{target} = {fn}(" if target else f"{fn}("
    line = f"{head}{', '.join(args)})"
    if len(line) <= width:
        return [line]
    wrapped = textwrap.wrap(", ".join(args), width - len(INDENT), break_long_words=False)
    return [head, *[INDENT + w for w in wrapped], ")"]


def comment_lines(text: str, prefix: str = "# ", width: int = 96) -> list[str]:
    return [prefix + w for w in textwrap.wrap(text, width, subsequent_indent="  ")] or [prefix]


def short(group) -> str:
    """A group as ``fuse([a, b, c])``, long member lists elided."""
    m = group.members
    names = ", ".join(m) if len(m) <= 6 else f"{', '.join(m[:3])}, ..., {m[-1]} ({len(m)} values)"
    return f"{group.kind.value}([{names}])"


def env_ref(n: Node, field: str) -> str:
    return f"env.{field}[{n.name!r}]"


def env_geo(n: Node, field: str) -> str | None:
    """Geometry outside chunk loops: no explicit rows (blocks are contiguous)."""
    return None if field == "rows" else env_ref(n, field)


def dtype(d: DType) -> str:
    return f"torch.{d.torch}".replace("torch.torch.", "torch.")
