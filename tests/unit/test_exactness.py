"""coconet.sim.exactness: which schedules are bitwise equal to their program by construction.

The rules are also checked bit for bit on every random schedule of the property tests
(test_schedule_property.py): whatever these rules call exact is compared with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
from support.examples_loader import load_example

import coconet as cc
from coconet.schedule import Schedule
from coconet.sim import reassociations

# Which paper schedules re-associate a sum (the rest only move data or run correctly rounded
# pointwise maths on slices).
REASSOCIATING = {
    ("lamb", "RS_C_AG"): ("p_norm_partial", "dir_norm_partial"),
    ("lamb", "fuse_RS_C_AG"): ("p_norm_partial", "dir_norm_partial"),
    ("tensor_parallel", "ol_MM_fuse_RS_C_AG"): ("partial",),
}


def _cases():
    for name in ("sgd", "adam", "adamw", "lamb", "tensor_parallel", "pipeline_parallel"):
        for schedule in load_example(name).SCHEDULES:
            yield name, schedule


@pytest.mark.parametrize(("name", "schedule"), list(_cases()))
def test_paper_schedules(name, schedule):
    mod = load_example(name)
    program = mod.program()
    reasons = reassociations(program, mod.SCHEDULES[schedule](program).program)
    named = tuple(r.split()[1] for r in reasons)
    assert named == REASSOCIATING.get((name, schedule), ()), reasons


def test_a_program_is_exact_against_itself():
    program = load_example("lamb").program()
    assert reassociations(program, program) == ()


def _gelu_program():
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    g_sum = cc.all_reduce(g, name="g_sum")
    p_new = (p - cc.gelu(g_sum).named("act")).named("p_new")
    return cc.Program("gelu_step", [g, p], [cc.update(p, p_new)])


def test_a_transcendental_op_on_slices_is_reported():
    program = _gelu_program()
    s = Schedule(program)
    _, ag = s.split("g_sum")
    s.reorder(s.computations(ag), ag)
    (reason,) = reassociations(program, s.program)
    assert reason.startswith("gelu act_slice is new") and "Sliced(dim=0)" in reason


def test_an_overlapped_chain_is_reported_only_for_shape_sensitive_ops():
    program = _gelu_program()
    s = Schedule(program)
    rs, ag = s.split("g_sum")
    s.overlap([rs, *s.downstream(rs)], 2)
    reasons = reassociations(program, s.program)
    assert reasons and all(r.split()[0] == "gelu" for r in reasons), reasons
    assert "chunks" in reasons[0]


def test_what_the_rules_call_exact_is_bitwise_equal_for_the_paper_schedules():
    """Every paper schedule with no reported reason is bitwise equal to its program on 3 ranks
    with uneven sizes, in the simulator (tests/dist checks the distributed runs the same way)."""
    for name, schedule in _cases():
        if (name, schedule) in REASSOCIATING or name == "pipeline_parallel":
            continue
        mod = load_example(name)
        program = mod.program()
        sched = mod.SCHEDULES[schedule](program)
        if name == "tensor_parallel":
            inputs = mod.make_inputs(3, 7, seed=2)
        else:
            inputs = mod.make_inputs(3, 7, seed=2, step=2)
        want = cc.simulate(program, inputs, 3)
        got = cc.simulate(sched.program, inputs, 3)
        for k in want.outputs:
            assert torch.equal(torch.as_tensor(got.output(k)), torch.as_tensor(want.output(k)))
        for k in want.updates:
            assert torch.equal(got.updated(k), want.updated(k)), (name, schedule, k)
