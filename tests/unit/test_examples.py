"""Every example runs as a script and passes its own check; every example has the shared API."""

import subprocess
import sys

import pytest
import torch
from support.examples_loader import EXAMPLES, load_example

import coconet as cc

NAMES = ["sgd", "adam", "adamw", "lamb", "tensor_parallel"]

# the named nodes each program promises to schedules: name -> op
NAMED = {
    "sgd": {"g_sum": "all_reduce", "d_p": None, "buf_new": None, "p_new": None},
    "adam": {"g_sum": "all_reduce", "d_p": None, "m_new": None, "v_new": None, "p_new": None},
    "adamw": {
        "g_sum": "all_reduce",
        "p_decayed": None,
        "m_new": None,
        "v_new": None,
        "p_new": None,
    },
    "lamb": {
        "g_sum": "all_reduce",
        "m_new": None,
        "v_new": None,
        "direction": None,
        "p_norm": "norm",
        "dir_norm": "norm",
        "trust_ratio": "where",
        "p_new": None,
    },
    "tensor_parallel": {"partial": "matmul", "out_sum": "all_reduce", "dropped": "dropout"},
}


@pytest.fixture(scope="module")
def runs():
    """Start every example at once (each spends most of its time importing torch)."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLES / f"{name}.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in NAMES
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", NAMES)
def test_example_runs(runs, name):
    out, _ = runs[name].communicate(timeout=120)
    assert runs[name].returncode == 0, out
    lines = [line for line in out.splitlines() if line.startswith(f"{name} ")]
    assert [line.split()[1] for line in lines] == ["world=2", "world=4"], out
    assert all(line.endswith("ok") and "max rel err" in line for line in lines), out


@pytest.mark.parametrize("name", NAMES)
def test_example_api(name):
    example = load_example(name)
    for attr in ("program", "make_inputs", "reference", "check", "main"):
        assert callable(getattr(example, attr)), attr
    assert isinstance(example.TOLERANCE, float)
    prog = example.program()
    assert isinstance(prog, cc.Program)
    for node_name, op in NAMED[name].items():
        node = prog.node(node_name)
        assert op is None or node.op.value == op, (node_name, node.op)
    inputs = example.make_inputs(2, 8)
    assert set(inputs) == {n.name for n in prog.inputs}
    result = cc.simulate(prog, inputs, 2)
    expected = example.reference(inputs)
    assert set(expected) <= set(result.updates) | set(result.outputs)


@pytest.mark.parametrize("name", NAMES)
def test_example_in_bfloat16(name):
    """The dtype option builds a low-precision program that runs (tolerances are float32's)."""
    example = load_example(name)
    prog = example.program(dtype=cc.bfloat16)
    result = cc.simulate(prog, example.make_inputs(2, 8, dtype=torch.bfloat16), 2)
    for values in (*result.updates.values(), *result.outputs.values()):
        assert values[0].dtype == torch.bfloat16
        assert torch.isfinite(values[0]).all()
