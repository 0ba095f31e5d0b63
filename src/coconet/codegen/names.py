"""Collision-free Python names for the values of a generated module.

Program value names are identifiers, but an identifier is not always a usable local name: ``lambda``
is a keyword, ``int`` would shadow a builtin the generated code calls, ``torch`` would shadow the
module. The generated module keeps its own helpers under names that start with ``_``; value names
never do (a user name such as ``_x`` becomes ``v_x``), so helpers and values cannot collide.
"""

from __future__ import annotations

import builtins
import keyword

__all__ = ["RESERVED", "Namer"]

# Names the generated module and its ``step`` function use for themselves.
_MODULE_NAMES = frozenset(
    {"torch", "Op", "ReduceOp", "comm", "env", "kernels", "step", "KERNELS", "INPUTS"}
)
RESERVED = (
    frozenset(keyword.kwlist)
    | frozenset(getattr(keyword, "softkwlist", ()))
    | frozenset(dir(builtins))
    | _MODULE_NAMES
)


class Namer:
    """Hands out unique identifiers, preferring the wanted name when it is free."""

    def __init__(self, reserved: frozenset[str] = RESERVED) -> None:
        self._taken: set[str] = set(reserved)

    def claim(self, wanted: str) -> str:
        base = wanted if wanted.isidentifier() else "v"
        if base.startswith("_"):
            base = "v" + base
        if base not in self._taken:
            self._taken.add(base)
            return base
        stem = base if base.endswith("_") else base + "_"
        if stem not in self._taken:
            self._taken.add(stem)
            return stem
        k = 2
        while f"{stem}{k}" in self._taken:
            k += 1
        name = f"{stem}{k}"
        self._taken.add(name)
        return name
