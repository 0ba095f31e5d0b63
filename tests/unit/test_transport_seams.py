"""The transports stay behind their seams (issue 43.4).

- The Communicator names its transports in construction only (``__init__``, ``_build``): after
  it, it asks a group's transport what it can do (``coconet.runtime.transport.Transport``:
  ``algorithms``, ``rank_ordered``, ``one_pass``, ``symmetric_memory``, ``signal_groups``,
  ``close``), never which transport it is.
- The generic emitter (``coconet.codegen.emit``) is the default lowering and names no
  shared-memory form: a transport's forms are written by its ``Emission`` overrides
  (``coconet.codegen.lowering``), registered by transport in ``coconet.codegen.emissions``.

Read from the source (``ast``), so a new method that reaches for ``self.shm`` fails here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import torch

import coconet.runtime.comm as comm_module
from coconet.codegen.emissions import EMISSIONS
from coconet.codegen.forms import REGISTRY
from coconet.codegen.lowering import Emission
from coconet.ir.ops import Op
from coconet.options import Algorithm, TransportKind
from coconet.runtime.hierarchy import HierarchicalTransport
from coconet.runtime.shmem import SharedMemoryTransport
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import Group, Transport

TRANSPORT_CLASSES = {
    "SharedMemoryTransport", "TorchDistributedTransport", "HierarchicalTransport", "ShmGroup",
    "HierGroup", "OnePassTransport",
}  # fmt: skip
TRANSPORT_ATTRIBUTES = {"shm", "torch", "hier"}
CONSTRUCTION = {"__init__", "_build"}
# (``coconet.codegen`` re-exports the function ``emit`` under the module's name)
emit_module = importlib.import_module("coconet.codegen.emit")


def _tree(module) -> ast.Module:
    return ast.parse(Path(module.__file__).read_text())


def _without_docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (left out of the text checks)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


def _names(node: ast.AST) -> list[tuple[int, str]]:
    """(line, identifier) of every name, attribute, import and definition under ``node``."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.append((n.lineno, n.id))
        elif isinstance(n, ast.Attribute):
            out.append((n.lineno, n.attr))
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.append((n.lineno, n.name))
        elif isinstance(n, ast.ImportFrom):
            out += [(n.lineno, part) for part in (n.module or "").split(".")]
            out += [(n.lineno, a.name) for a in n.names]
    return out


def test_the_communicator_names_no_transport_after_construction():
    tree = _tree(comm_module)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name in CONSTRUCTION:
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id in TRANSPORT_CLASSES:
                found.append(f"{node.name}, line {n.lineno}: {n.id}")
            if isinstance(n, ast.Attribute) and n.attr in TRANSPORT_ATTRIBUTES:
                found.append(f"{node.name}, line {n.lineno}: .{n.attr}")
            # asking a transport's kind which it is: TransportKind.SHARED_MEMORY and the like
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and (
                n.value.id == "TransportKind"
            ):
                found.append(f"{node.name}, line {n.lineno}: TransportKind.{n.attr}")
    assert found == [], "\n".join(found)
    # nor outside any function (a class attribute, a module-level table)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    inside = {id(x) for f in functions for x in ast.walk(f)}
    loose = [
        (n.lineno, n.id)
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id in TRANSPORT_CLASSES and id(n) not in inside
    ]
    assert loose == [], loose


def test_the_communicator_is_small_and_keeps_no_control_bits():
    """The control channel's bit packing (a scalar's bits in a word per rank, a gather of
    floats) is ``ControlChannel``'s; algorithm measuring is ``AlgorithmChoice``'s."""
    tree = _tree(comm_module)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Communicator"]
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]
    for gone in ("_control_reduce", "_algorithm", "_check_fixed_algorithms", "_share_table"):
        assert gone not in methods
    text = Path(comm_module.__file__).read_text()
    for packing in ("byteorder", "CONTROL_WORDS", "measure_choice", "run_for_measurement"):
        assert packing not in text, packing


# What shared memory's forms are called, in code and in the code they write.
SHM_FORM_NAMES = {
    "OnePass", "ReadInPlace", "one_pass", "loop_one_pass", "reads_in_place", "in_place",
    "kernels_in_place", "one_pass_kernels", "published", "is_published", "commit_target",
    "SharedMemoryEmission", "emit_shm", "ONE_PASS", "READ_IN_PLACE", "PUBLISHED", "TransportKind",
    "SHARED_MEMORY", "HIERARCHICAL", "TORCH_DISTRIBUTED", "OnePassChannel",
}  # fmt: skip
SHM_FORM_TEXT = ("one_pass", "reduce_in_place", "REPLICA_INPUTS", "_by_parts", "shared memory")


def test_the_generic_emitter_names_no_shared_memory_form():
    tree = _tree(emit_module)
    found = [f"line {line}: {name}" for line, name in _names(tree) if name in SHM_FORM_NAMES]
    docstrings = _without_docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            found += [f"line {n.lineno}: {w!r}" for w in SHM_FORM_TEXT if w in n.value]
    assert found == [], "\n".join(found)


def test_the_emissions_are_typed_overrides_registered_by_transport():
    """(``tests/unit/test_forms.py`` checks that every transport with forms has one.)"""
    assert EMISSIONS
    for kind, make in EMISSIONS.items():
        assert isinstance(make, type) and issubclass(make, Emission), kind
        assert make.kind is kind and kind in REGISTRY


def test_the_default_emission_overrides_nothing():
    e = Emission.__new__(Emission)
    assert e.declarations() == []
    assert e.kernel_def(None) is None and e.step_lines(None, None) is None
    assert e.fused_collective_lines(None, []) is None and e.chunk_loop(None) is None


class _Bare(Transport):
    """A transport that can do nothing beyond the ops: ``Transport``'s defaults."""

    kind = TransportKind.TORCH_DISTRIBUTED


def test_each_transport_says_what_it_can_do():
    gloo, shm = TorchDistributedTransport(), SharedMemoryTransport()
    hier = HierarchicalTransport(shm, gloo)
    group = Group(None, (0, 1), 0, None)
    # algorithms to choose among: torch.distributed's alone
    assert Algorithm.ALL_TO_ALL in gloo.algorithms(Op.ALL_REDUCE)
    assert shm.algorithms(Op.ALL_REDUCE) == () and hier.algorithms(Op.ALL_REDUCE) == ()
    assert _Bare().algorithms(Op.ALL_REDUCE) == ()
    # forms of its own and memory every peer maps: shared memory's
    assert shm.one_pass and shm.symmetric_memory
    assert not any((gloo.one_pass, gloo.symmetric_memory, hier.one_pass, hier.symmetric_memory))
    # rank-ordered sums: where they run (the hierarchical transport's are over hosts)
    assert gloo.rank_ordered(group) == (gloo, group) and shm.rank_ordered(group) == (shm, group)

    class Flat:  # what HierGroup holds of the group's flat form
        flat = Group(None, (0, 1), 0, "the process group")
        local = Group(None, (0,), 0, None)  # a host of one: no shared memory inside

        def close(self) -> None:
            self.closed = True

    h = Flat()
    hier_group = Group(None, (0, 1), 0, h)
    assert hier.rank_ordered(hier_group) == (gloo, Flat.flat)
    # the groups a peer's abort word must end, and what is handed back
    assert gloo.signal_groups(group) == [] and hier.signal_groups(hier_group) == []
    assert shm.signal_groups(group) == [group]
    gloo.close(group)  # nothing to hand back
    hier.close(hier_group)
    assert h.closed
    bare = _Bare()
    try:
        bare.symmetric_tensor(group, (2,), torch.float32)
    except NotImplementedError as e:
        assert "maps no memory" in str(e)
    else:
        raise AssertionError("a transport without symmetric memory made a symmetric tensor")
