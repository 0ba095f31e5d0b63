"""Layers point one way: no import cycles, each layer imports only the layers below it, and every
module imports on its own (no reliance on another module having been imported first).

The import edges come from ``tools/import_graph.py`` (run it to see them: ``--layers`` for the
layer graph). The data flow is DSL -> IR -> schedule -> plan (codegen) -> generated code ->
transport (runtime); the simulator reads only the IR.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", _TOOL)
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

BASE = {"errors", "version", "progress", "tracing"}  # leaves every layer may use
# layer -> the layers it may import (besides itself and BASE)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "progress": set(),
    "tracing": set(),
    # the recorded traces' tools (merge, plot): they read files, not the runtime
    "trace": set(),
    "version": set(),
    "random": set(),
    "cache": set(),
    # the options and enums every layer reads (transports, algorithms): they name ops
    "options": {"ir"},
    "ir": {"random"},
    "dsl": {"ir"},
    "ops": {"dsl"},
    "sim": {"ir"},
    # pipeline schedules and their proof (plain data), and the stages run over the runtime's
    # communicator and channels (which transport each link takes: options' TransportKind)
    "pipeline": {"runtime", "options"},
    # reverse mode: an IR -> IR transform reading the op specs' vector-Jacobian rules
    "autodiff": {"ir"},
    "accounting": {"ir"},
    "schedule": {"ir"},
    "codegen": {"ir", "options", "cache"},  # (the kernel packages live in the cache)
    "runtime": {"ir", "codegen", "cache", "options"},
    "compiler": {"ir", "codegen", "schedule", "runtime", "cache", "options"},
    "testing": {"ir", "sim", "compiler", "runtime"},
    # the autotuner: enumerates schedules, predicts plans (codegen), measures compiled steps
    "tune": {
        "ir", "dsl", "accounting", "codegen", "schedule", "compiler", "runtime", "cache",
        "options",
    },
    # fully sharded parameters: blocks laid out in slices, gathered by the runtime's
    # collectives; the optimizer's side of them is optim's (optim.sharded)
    "fsdp": {"ir", "runtime", "options"},
    # (random: the seeds of stochastic rounding's streams, one per bucket)
    "optim": {
        "ir", "dsl", "schedule", "compiler", "runtime", "options", "tune", "random", "fsdp",
    },
    # tensor-parallel layers: DSL programs, their gradients, compiled steps, and the
    # counter-based dropout masks and seeds of the attention they write out (random)
    "nn": {
        "ir", "dsl", "autodiff", "schedule", "compiler", "runtime", "options", "tune", "random",
    },
    "coconet": {
        "ir", "dsl", "ops", "sim", "schedule", "compiler", "accounting", "optim", "autodiff",
    },
    "cli": {
        "ir", "schedule", "compiler", "runtime", "cache", "coconet", "tune", "options", "trace",
    },
}


def test_there_are_no_import_cycles():
    assert import_graph.cycles(import_graph.edges()) == []


# No cycle either through imports made for type checkers (``if TYPE_CHECKING:``): a module that
# names in its annotations a class of a module that imports it takes a Protocol of what it reads
# (``coconet.ir.rules.Operand``) or the class's base (``torch.optim.Optimizer``) instead.
TYPE_ONLY_CYCLES: list[list[str]] = []


def test_type_only_imports_make_no_new_cycles():
    assert sorted(import_graph.cycles(import_graph.edges(type_only=True))) == TYPE_ONLY_CYCLES


def test_every_layer_is_known():
    layers = {import_graph.layer(m) for m in import_graph.modules()}
    assert layers <= set(ALLOWED), f"add {sorted(layers - set(ALLOWED))} to ALLOWED"


def test_layers_point_one_way():
    wrong = sorted(
        f"{a} -> {b}"
        for a, b in import_graph.edges()
        if (la := import_graph.layer(a)) != (lb := import_graph.layer(b))
        and lb not in ALLOWED[la] | BASE
    )
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)


def test_the_simulator_and_generated_code_depend_only_on_the_ir():
    """Generated modules import ``coconet.ir`` only (op meanings, chunk geometry)."""
    from support.examples_loader import load_example

    import coconet as cc

    tp = load_example("tensor_parallel")
    source = cc.compile(tp.SCHEDULES["ol_MM_fuse_RS_C_AG"](tp.program()), world=2).source
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert imports and all(
        line.startswith(("import torch", "from coconet.ir")) for line in imports
    ), imports


@pytest.mark.parametrize("module", sorted(import_graph.modules()))
def test_each_module_imports_alone(module):
    """Forget every coconet module, then import this one first."""
    saved = {k: v for k, v in sys.modules.items() if k == "coconet" or k.startswith("coconet.")}
    for k in saved:
        del sys.modules[k]
    try:
        importlib.import_module(module)
    finally:
        for k in [k for k in sys.modules if k == "coconet" or k.startswith("coconet.")]:
            del sys.modules[k]
        sys.modules.update(saved)


# -- sizes: tinygrad's habit of a line budget, kept where it protects a design --------------------

SRC = Path(__file__).resolve().parents[2] / "src" / "coconet"


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_a_thousand_lines():
    big = {str(p.relative_to(SRC)): _lines(p) for p in SRC.rglob("*.py") if _lines(p) > 1000}
    assert big == {}, "split these along a seam (see DESIGN.md section 3): " + repr(big)


def test_the_optimizer_is_a_facade_over_small_rooms():
    """``coconet.optim``: no file over 600 lines, ``base.py`` (torch's Optimizer surface) at
    most 500, no class over 400 (issue 43: the optimizer split into rooms)."""
    import ast

    optim = SRC / "optim"
    files = {p.name: _lines(p) for p in optim.glob("*.py")}
    assert {k: v for k, v in files.items() if v > 600} == {}
    assert files["base.py"] <= 500, files["base.py"]
    classes = {
        f"{p.name}:{node.name}": node.end_lineno - node.lineno + 1
        for p in optim.glob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert {k: v for k, v in classes.items() if v > 400} == {}


def _private_names(tree) -> set[str]:
    """The private names a module defines: its top-level ones, its classes' attributes and
    methods, and what its methods assign to ``self._x``."""
    import ast

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if private(node.name):
                names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and private(node.attr):
                names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name) and private(t.id)}
    return names


def test_no_optim_module_uses_another_ones_private_names():
    """A room of ``coconet.optim`` is used through its public names only: no module reads or
    imports a private name (``_x``) that another module of the package defines (the checkpoint
    and DDP-hook modules once reached into the optimizer's ``_buckets``, ``_Bucket``, ...)."""
    import ast

    modules = {p.name: ast.parse(p.read_text()) for p in (SRC / "optim").glob("*.py")}
    defined = {name: _private_names(tree) for name, tree in modules.items()}
    wrong = []
    for name, tree in modules.items():
        others = set().union(*(d for n, d in defined.items() if n != name)) - defined[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "coconet.optim"
            ):
                wrong += [f"{name}: imports {a.name}" for a in node.names if a.name in others]
            elif isinstance(node, ast.Attribute) and node.attr in others and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                wrong.append(f"{name}:{node.lineno}: .{node.attr}")
    assert wrong == [], wrong


def test_the_pipeline_sends_only_through_the_communicator():
    """``coconet.pipeline`` is no point-to-point runtime of its own (issue 43): it neither
    imports ``torch.distributed`` nor calls ``isend``/``irecv`` (or ``send``/``recv`` of
    torch.distributed); its stage messages go through ``Communicator.p2p``, whose routing
    (``coconet.runtime.routing``) and fault guard are every collective's. Docstrings may name
    them."""
    import ast

    wrong = []
    for path in sorted((SRC / "pipeline").rglob("*.py")):
        name = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wrong += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name == "torch.distributed"
                          or a.name.startswith("torch.distributed.")]  # fmt: skip
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if module == "torch.distributed" or module.startswith("torch.distributed."):
                    wrong.append(f"{name}:{node.lineno}: from {module} import ...")
                elif module == "torch" and any(a.name == "distributed" for a in node.names):
                    wrong.append(f"{name}:{node.lineno}: from torch import distributed")
            elif isinstance(node, ast.Attribute) and node.attr == "distributed" and (
                isinstance(node.value, ast.Name) and node.value.id == "torch"
            ):
                wrong.append(f"{name}:{node.lineno}: torch.distributed")
            elif isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in ("isend", "irecv", "batch_isend_irecv", "P2POp"):
                    wrong.append(f"{name}:{node.lineno}: {called}(...)")
    assert wrong == [], wrong
