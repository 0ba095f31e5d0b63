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

BASE = {"errors", "version", "progress"}  # leaves every layer may use
# layer -> the layers it may import (besides itself and BASE)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "progress": set(),
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
    "codegen": {"ir", "options"},
    "runtime": {"ir", "codegen", "cache", "options"},
    "compiler": {"ir", "codegen", "schedule", "runtime", "cache", "options"},
    "testing": {"ir", "sim", "compiler", "runtime"},
    # the autotuner: enumerates schedules, predicts plans (codegen), measures compiled steps
    "tune": {
        "ir", "dsl", "accounting", "codegen", "schedule", "compiler", "runtime", "cache",
        "options",
    },
    "optim": {"ir", "dsl", "schedule", "compiler", "runtime", "options", "tune"},
    # tensor-parallel layers: DSL programs, their gradients, compiled steps, and the
    # counter-based dropout masks and seeds of the attention they write out (random)
    "nn": {
        "ir", "dsl", "autodiff", "schedule", "compiler", "runtime", "options", "tune", "random",
    },
    "coconet": {
        "ir", "dsl", "ops", "sim", "schedule", "compiler", "accounting", "optim", "autodiff",
    },
    "cli": {"ir", "schedule", "compiler", "runtime", "cache", "coconet", "tune", "options"},
}


def test_there_are_no_import_cycles():
    assert import_graph.cycles(import_graph.edges()) == []


# Cycles that exist only through imports made for type checkers (``if TYPE_CHECKING:``), each
# a module that names in its annotations the class of the module that calls it. They never run;
# breaking them would mean a Protocol restating each class. No other may appear.
TYPE_ONLY_CYCLES = [
    ["coconet.ir.node", "coconet.ir.rules"],  # the typing rules take Nodes; Node runs them
    ["coconet.optim.base", "coconet.optim.checkpoint", "coconet.optim.ddp"],  # take the optimizer
    ["coconet.tune.explain", "coconet.tune.tuner"],  # explain() reads a TuneResult
]


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
