"""List the import edges between coconet's modules, and any cycles among them.

    python tools/import_graph.py            # every edge, "a -> b", then the cycles (if any)
    python tools/import_graph.py --layers   # edges between top-level layers only
    python tools/import_graph.py --with-type-only   # also the imports under TYPE_CHECKING

Imports are read from the source (``ast``), at module level and inside functions alike, so an
import hidden in a function to dodge a cycle still counts. ``TYPE_CHECKING`` imports are left out
(they never run) unless ``--with-type-only`` asks for them, and so are edges from a module to
its own parent packages (Python runs those first for any importer). tests/unit/test_layers.py
asserts that there are no cycles, that the type-only ones are the known few, and that the layers
point one way.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(src: Path = SRC) -> dict[str, Path]:
    """Module name -> file, for every module of the coconet package."""
    out = {}
    for path in sorted((src / "coconet").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            node.body = []  # walk skips what was cleared
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def edges(src: Path = SRC, type_only: bool = False) -> set[tuple[str, str]]:
    """(importer, imported) pairs between coconet modules (``type_only``: with the imports made
    for type checkers alone, under ``if TYPE_CHECKING:``)."""
    mods = modules(src)
    out = set()
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        # clear TYPE_CHECKING blocks first (ast.walk is breadth-first: parents before children)
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _is_type_checking(node) and not type_only:
                node.body = []
        for target in _imports(tree, name, path.name == "__init__.py"):
            # Importing a submodule runs its parent packages first, whoever imports it: an edge
            # to one's own parent package is implied by Python, not a dependency of the code.
            if target in mods and target != name and not name.startswith(target + "."):
                out.add((name, target))
    return out


def cycles(graph: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    succ: dict[str, list[str]] = {}
    for a, b in graph:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str:
    """``coconet.ir.rules`` -> ``ir``; ``coconet.compiler`` -> ``compiler``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "coconet"


def main(argv: list[str]) -> int:
    graph = edges(type_only="--with-type-only" in argv)
    if "--layers" in argv:
        pairs = sorted({(layer(a), layer(b)) for a, b in graph if layer(a) != layer(b)})
    else:
        pairs = sorted(graph)
    for a, b in pairs:
        print(f"{a} -> {b}")
    found = cycles(graph)
    for c in found:
        print("cycle: " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
