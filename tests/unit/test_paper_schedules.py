"""Every paper schedule of every example equals the unscheduled program in the simulator.

Tolerances (``tests/support/tolerances.py``): a schedule is checked bit for bit unless
``coconet.sim.exactness.reassociations`` names a sum it re-associates. The schedules of SGD,
Adam and AdamW only move data and run the same elementwise maths on slices, and the simulator's
reduce_scatter adds the ranks' values in the same order as its all_reduce, so results are
bit-identical. LAMB's reorder turns ``norm(x)`` into ``sqrt(all_reduce(sum(x_slice * x_slice)))``
and the overlapped layer schedule runs its matmul chunk by chunk: rtol 1e-5. Those are also
checked bit-exactly on integer-valued data (every sum exact in any order, every chunk of the
overlapped matmul too).
"""

from __future__ import annotations

import pytest
import torch
from support.examples_loader import load_example

import coconet as cc
from coconet.accounting import account
from coconet.ir.group import GroupKind
from coconet.schedule import (
    AR_C,
    AR_P2P_C,
    RS_C_AG,
    RS_P2P_C_AG,
    Schedule,
    fuse_RS_C_AG,
)
from coconet.sim.exactness import reassociations

OPTIMIZERS = ("sgd", "adam", "adamw", "lamb")
OPTIMIZER_SCHEDULES = ("AR_C", "RS_C_AG", "fuse_RS_C_AG")
LAYER_SCHEDULES = ("MM_AR_C", "MM_RS_C_AG", "ol_MM_fuse_RS_C_AG")
PIPELINE_SCHEDULES = ("AR_P2P_C", "RS_P2P_C_AG", "ol_RS_fuse_P2P_C_AG")


def test_examples_name_the_paper_schedules():
    for name in OPTIMIZERS:
        assert tuple(load_example(name).SCHEDULES) == OPTIMIZER_SCHEDULES
    assert tuple(load_example("tensor_parallel").SCHEDULES) == LAYER_SCHEDULES
    assert tuple(load_example("pipeline_parallel").SCHEDULES) == PIPELINE_SCHEDULES


def assert_same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", OPTIMIZER_SCHEDULES)
@pytest.mark.parametrize("example", OPTIMIZERS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("size", [12, 7, 2])  # 7 and 2 do not divide by every world size
def test_optimizer_schedules_equal_the_program(example, schedule, world, size):
    mod = load_example(example)
    prog = mod.program()
    sched = mod.SCHEDULES[schedule](prog)
    exact = not reassociations(prog, sched.program)
    assert exact == (example != "lamb" or schedule == "AR_C")  # LAMB's partial norms
    state = mod.make_inputs(world, size, seed=world + size, step=1)
    got_state = dict(state)
    for step in (1, 2, 3):  # several steps: the sliced state carries over between them
        state["step"] = got_state["step"] = step
        want = cc.simulate(prog, state, world)
        got = cc.simulate(sched.program, got_state, world)
        for name in want.updates:
            assert_same(want.updated(name), got.updated(name), exact)
            state[name] = want.updated(name)
            got_state[name] = got.updated(name)


@pytest.mark.parametrize("example", OPTIMIZERS)
def test_rs_c_ag_keeps_state_sliced_and_reads_no_whole_state(example):
    mod = load_example(example)
    sched = mod.SCHEDULES["fuse_RS_C_AG"](mod.program())
    prog = sched.program
    for name in mod.STATE:
        assert prog.input(name).type.layout == cc.Sliced(0)
    ops = [n.op.value for n in prog.nodes]
    assert "all_reduce" not in ops or example == "lamb"  # LAMB: only the partial-norm reductions
    assert ops.count("reduce_scatter") == 1
    assert ops.count("all_gather") == 1  # the parameters; the state is never gathered
    fused = [g for g in prog.groups if g.kind is GroupKind.FUSE]
    assert fused and "g_sum_rs" in fused[0].members


def test_lamb_norms_become_partial_sums_not_gathers():
    prog = RS_C_AG(load_example("lamb").program(), ("m", "v")).program
    for norm_name in ("p_norm", "dir_norm"):
        node = prog.node(norm_name)
        assert node.op.value == "sqrt"
        (total,) = node.inputs
        assert total.op.value == "all_reduce" and total.type.rank == 0
        (partial,) = total.inputs
        assert partial.op.value == "sum" and partial.inputs[0].op.value == "mul"
        assert partial.inputs[0].inputs[0].type.layout.is_sliced
    assert [n.op.value for n in prog.nodes].count("all_gather") == 1


def layer_inputs(mod, integer: bool, batch: int, size: int):
    inputs = mod.make_inputs(4, size, seed=batch, batch=batch, out_features=5)
    if integer:
        gen = torch.Generator().manual_seed(batch * 31 + size)
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor):
                inputs[k] = torch.randint(-3, 4, v.shape, generator=gen).float()
    return inputs


@pytest.mark.parametrize("schedule", LAYER_SCHEDULES)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch", [8, 7, 3])
@pytest.mark.parametrize("integer", [True, False])
def test_tensor_parallel_schedules_equal_the_program(schedule, world, batch, integer):
    mod = load_example("tensor_parallel")
    prog = mod.program(p=0.25)
    chunks = {"chunks": 3} if schedule.startswith("ol_") else {}
    sched = mod.SCHEDULES[schedule](prog, **chunks)
    inputs = layer_inputs(mod, integer, batch, size=6)
    want = cc.simulate(prog, inputs, world).output("out")
    got = cc.simulate(sched.program, inputs, world).output("out")
    assert_same(want, got, exact=integer or not reassociations(prog, sched.program))


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
@pytest.mark.parametrize("mesh", [cc.Mesh(pp=2, tp=2), cc.Mesh(pp=2, tp=3), cc.Mesh(pp=3, tp=2)])
@pytest.mark.parametrize("size", [16, 7])
def test_pipeline_schedules_equal_the_program(schedule, mesh, size):
    mod = load_example("pipeline_parallel")
    prog = mod.program()
    chunks = {"chunks": 2} if schedule.startswith("ol_") else {}
    sched = mod.SCHEDULES[schedule](prog, **chunks)
    inputs = mod.program_inputs(mod.make_inputs(mesh, size, batch=5))
    want = cc.simulate(prog, inputs, mesh).output("out")
    got = cc.simulate(sched.program, inputs, mesh).output("out")
    exact = not reassociations(prog, sched.program)  # the pipeline schedules only move data
    for a, b in zip(want, got, strict=True):
        assert_same(a, b, exact=exact)
    expect = mod.reference(mod.make_inputs(mesh, size, batch=5))
    assert mod.max_relative_error(got, mesh, expect) <= mod.TOLERANCE


def all_schedules():
    for name in (*OPTIMIZERS, "tensor_parallel", "pipeline_parallel"):
        mod = load_example(name)
        for sname, make in mod.SCHEDULES.items():
            yield f"{name}:{sname}", lambda m=make, mod=mod: m(mod.program())


@pytest.mark.parametrize(
    "make", [m for _, m in all_schedules()], ids=[n for n, _ in all_schedules()]
)
def test_paper_schedules_are_short_replayable_and_printable(make):
    sched = make()
    assert 1 <= len(sched.steps) <= 6
    replayed = Schedule.from_json(sched.original, sched.to_json())
    assert replayed.program == sched.program
    assert replayed.program.digest() == sched.program.digest()
    text = str(sched)
    assert text.splitlines()[0] == f"schedule {sched.name} of {sched.original.name}:"
    assert len(text.splitlines()) == len(sched.steps) + 1
    sched.program.verify()


def test_rs_c_ag_schedule_prints_as_a_few_lines():
    sched = fuse_RS_C_AG(load_example("sgd").program(), ("buf",))
    assert str(sched) == (
        "schedule fuse_RS_C_AG of sgd:\n"
        "  split(g_sum)\n"
        "  reorder(computations(g_sum), g_sum)\n"
        "  as_slice([buf])\n"
        "  fuse([g_sum_rs, eq_1, mul_1_slice, d_p_slice, ..., p_new_slice, p_new (12 values)])"
    )
    # The JSON form names every value, so it replays exactly.
    assert "buf_new_slice" in sched.to_json()


# -- accounting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_as_slice_cuts_adam_state_by_the_world_size(world):
    prog = load_example("adam").program()
    n = 1200  # divisible by 2, 3, 4
    before = account(AR_C(prog).program, world, {"N": n})
    after = account(RS_C_AG(prog, ("m", "v")).program, world, {"N": n})
    for name in ("m", "v"):
        assert before.persistent_by_input[name] == (4 * n,) * world
        assert after.persistent_by_input[name] == (4 * n // world,) * world
    assert after.persistent_by_input["p"] == (4 * n,) * world  # parameters stay whole


def test_as_slice_with_uneven_sizes_keeps_every_element_once():
    prog = RS_C_AG(load_example("adam").program(), ("m", "v")).program
    acc = account(prog, 4, {"N": 10})
    assert acc.persistent_by_input["m"] == (12, 12, 8, 8)
    assert sum(acc.persistent_by_input["m"]) == 4 * 10


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1200, 10])
def test_split_sends_what_the_all_reduce_sends(world, n):
    prog = load_example("adam").program()
    ar = account(prog, world, {"N": n})
    split = Schedule(prog)
    split.split("g_sum")
    rs_ag = account(split.program, world, {"N": n})
    assert ar.sent_bytes == rs_ag.sent_bytes
    # With the state sliced, RS_C_AG gathers only the parameters: the same bytes again.
    assert account(RS_C_AG(prog, ("m", "v")).program, world, {"N": n}).sent_bytes == ar.sent_bytes
    assert ar.sent_by_node["g_sum"] == tuple(
        a + b
        for a, b in zip(rs_ag.sent_by_node["g_sum_rs"], rs_ag.sent_by_node["g_sum"], strict=True)
    )


def test_sliced_pipeline_send_moves_one_tp_th_of_the_data():
    prog = load_example("pipeline_parallel").program()
    mesh = cc.Mesh(pp=2, tp=4)
    sizes = {"B": 8, "H": 16, "H2": 10}
    whole = account(AR_P2P_C(prog).program, mesh, sizes).sent_by_node["recv"]
    sliced = account(RS_P2P_C_AG(prog).program, mesh, sizes).sent_by_node["recv_slice"]
    stage0 = [r for r in range(mesh.size) if mesh.coords(r)["pp"] == 0]
    for r in stage0:
        assert whole[r] == 8 * 10 * 4
        assert sliced[r] == whole[r] // 4
    assert all(sliced[r] == 0 for r in range(mesh.size) if r not in stage0)  # last stage
