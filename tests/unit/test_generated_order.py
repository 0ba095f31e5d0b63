"""The generated code runs its steps in an order that works: regressions found by running every
random schedule's generated step on a world of one (``support.generated.run_generated``).

Both were schedules the checks accept, that ``coconet.compile`` compiled and the simulator ran
correctly, but whose generated ``step()`` failed with a NameError on real ranks: the fused
collective's unit was cleared of interleaved steps by moving them before it, also

- the wait of a collective whose start had to move after the unit (LAMB-like: a global sum of
  the sliced update, reduced by an all_reduce outside the group), and
- an earlier group's fused collective that reads a value the unit computes.
"""

from __future__ import annotations

import torch
from support.generated import make_inputs, run_generated

import coconet as cc
from coconet.schedule import Schedule, fuse_RS_C_AG

N, K = cc.Dim("N"), cc.Dim("K")


def _run_both(schedule: Schedule, tmp_path, n: int = 5) -> None:
    compiled = cc.compile(schedule, world=1, cache_dir=tmp_path, fused_kernels=False)
    inputs = make_inputs(schedule.original, 1, n, 1, seed=3)
    outputs, updates = run_generated(compiled, inputs)
    want = cc.simulate(schedule.program, inputs, 1)
    for name, value in outputs.items():
        assert torch.equal(value, want.outputs[name][0]), name
    for name, value in updates.items():
        assert torch.equal(value, want.updates[name][0]), name


def test_a_collective_after_the_fused_unit_is_waited_for_after_its_start(tmp_path):
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    s0 = cc.Tensor("s0", cc.float32, [N], cc.Replicated)
    g_sum = cc.all_reduce(g, name="g_sum")
    clipped = cc.relu(g_sum * s0).named("clipped")
    total = (cc.sum(clipped * clipped) * 0.5).named("total")
    prog = cc.Program("p", [g, s0], {"total": total, "u": cc.update(s0, s0 - clipped)})
    s = fuse_RS_C_AG(prog)
    source = cc.compile(s, world=2, cache_dir=tmp_path).source
    body = source[source.index("def step(") :]
    assert body.index("sum_1_work = comm.all_reduce_start") < body.index("comm.wait(sum_1_work)")
    _run_both(s, tmp_path)


def test_an_earlier_fused_collective_that_reads_the_unit_runs_after_it(tmp_path):
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    s0 = cc.Tensor("s0", cc.float32, [N], cc.Replicated)
    s2 = cc.Tensor("s2", cc.float32, [N], cc.Replicated)
    v0 = cc.abs(cc.all_reduce(g, name="g_sum")).named("v0")
    out = cc.where(cc.ge(v0, v0), s2, s0).named("out_v1")
    prog = cc.Program("p", [g, s0, s2], {"u0": cc.update(s0, v0), "u2": cc.update(s2, v0),
                                         "out_v1": out})  # fmt: skip
    s = Schedule(prog)
    _, ag = s.split("g_sum")
    s.reorder(s.computations(ag), ag)
    s.as_slice(["s0"])
    s.fuse(["v0"])  # the all_gather of v0 alone, reading v0_slice of the group below
    s.fuse(["v0_slice", "ge_1_slice", "s2_slice", "out_v1_slice", "out_v1"])
    _run_both(s, tmp_path)


def test_a_one_pass_gather_is_published_only_when_no_collective_follows():
    """Over shared memory a one-pass unit whose gather only updates an input leaves it in the
    peers' slots for the commit; a collective started after it would wait for those slots
    forever (both ranks stalled until the deadline), so then the gather is copied out. A scalar
    all_reduce over the whole mesh after it (user_ops' global mean) runs over the control
    channel instead and the gather stays published (test_one_pass has a vector one)."""
    from support import dist_programs  # the programs tests/dist runs over shared memory

    from coconet.codegen import emit, forms, lower
    from coconet.codegen.forms import one_pass
    from coconet.options import TransportKind

    shm = {None: TransportKind.SHARED_MEMORY}
    for build, control in ((dist_programs.lion, False), (dist_programs.user_ops, True)):
        plan = lower(build().program)
        assert all(one_pass(u) is not None for u in plan.fused_collectives)
        source = emit(plan, [], forms(plan, shm))
        assert "published=True" in source, build.__name__
        body = source[source.index("def step(") :]
        assert ("all_reduce_control_start" in body) is control, build.__name__
        if control:  # the global mean's all_reduce runs after the unit, off the data group
            assert body.index(".finish(") < body.index("all_reduce_control_start")
            assert "comm.all_reduce_start" not in body
