"""The schedules of fully sharded parameters (``coconet.fsdp``) in the simulator:
``fuse_RS_C`` (the paper's ``fuse(RS, C, AG)`` with the parameters sliced, so no all_gather)
equals the unscheduled step, and ``optim.sharded.on_slices`` (the clipped update of each
rank's slice, run after the global norm) equals the step of averaged gradients whole."""

from __future__ import annotations

import pytest
import torch
from support.examples_loader import load_example

import coconet as cc
from coconet.accounting import account
from coconet.errors import ScheduleError
from coconet.optim import programs
from coconet.optim.programs import Clip
from coconet.optim.sharded import on_slices
from coconet.schedule import fuse_RS_C
from coconet.sim.exactness import reassociations

OPTIMIZERS = ("sgd", "adam", "adamw")


@pytest.mark.parametrize("example", OPTIMIZERS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("size", [12, 7, 2])  # 7 and 2 do not divide by every world size
def test_fuse_rs_c_equals_the_program(example, world, size):
    mod = load_example(example)
    prog = mod.program()
    sched = fuse_RS_C(prog, state=("p", *mod.STATE))
    assert not reassociations(prog, sched.program)  # bit for bit
    state = mod.make_inputs(world, size, seed=world + size, step=1)
    got_state = dict(state)
    for step in (1, 2, 3):  # the sliced parameters and state carry over between steps
        state["step"] = got_state["step"] = step
        want = cc.simulate(prog, state, world)
        got = cc.simulate(sched.program, got_state, world)
        for name in want.updates:
            assert torch.equal(want.updated(name), got.updated(name)), (name, step)
            state[name] = want.updated(name)
            got_state[name] = got.updated(name)


@pytest.mark.parametrize("example", OPTIMIZERS)
def test_fuse_rs_c_stores_the_parameters_sliced_and_gathers_nothing(example):
    mod = load_example(example)
    prog = fuse_RS_C(mod.program(), state=("p", *mod.STATE)).program
    for name in ("p", *mod.STATE):
        assert prog.input(name).type.layout == cc.Sliced(0)
    ops = [n.op.value for n in prog.nodes]
    assert ops.count("reduce_scatter") == 1 and "all_gather" not in ops
    acc = account(prog, 4, {"N": 1200})
    assert acc.persistent_by_input["p"] == (4 * 300,) * 4  # a quarter each


def test_fuse_rs_c_needs_the_parameters_in_state():
    with pytest.raises(ScheduleError, match="state= must name them") as e:
        fuse_RS_C(load_example("adam").program(), state=("m", "v"))
    assert "fuse_RS_C_AG" in e.value.hint


@pytest.mark.parametrize("make", [programs.adam, programs.sgd, programs.sgd_momentum])
@pytest.mark.parametrize("world", [1, 3])
def test_on_slices_updates_each_slice_as_the_whole(make, world):
    prog = make(clip=Clip.GIVEN, averaged=True)
    sliced = on_slices(prog).program
    assert all(t.type.layout == cc.Sliced(0) for t in sliced.inputs if t.type.rank)
    assert not [n for n in sliced.nodes if n.op.value in ("all_reduce", "all_gather")]
    gen = torch.Generator().manual_seed(world)
    inputs = {}
    for t in prog.inputs:
        if t.type.rank:  # (positive: Adam's second moment is)
            inputs[t.name] = torch.rand(11, generator=gen) + 0.1
        else:
            inputs[t.name] = float(torch.rand((), generator=gen)) + 0.5
    want = cc.simulate(prog, inputs, 1)
    got = cc.simulate(sliced, inputs, world)
    for name in want.updates:
        assert torch.equal(want.updated(name), got.updated(name)), name
