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


def test_a_kernels_reductions_come_after_the_elementwise_work_they_do_not_feed():
    """Inductor fuses a reduction into the loop of the elementwise work traced before it and
    gives one traced first a loop of its own (a second read of the inputs), so every kernel
    lists its reductions as late as their readers allow: still a valid order of the same
    nodes. The speculative clip's step: its sum of squares after the update's last node."""
    from coconet.codegen import lower
    from coconet.codegen.plan import Kernel
    from coconet.ir.opspec import Lowering, spec
    from coconet.ir.types import DType
    from coconet.optim import programs
    from coconet.optim.programs import Clip
    from coconet.schedule import fuse_RS_C_AG

    checked = 0
    cases = [(programs.adam, c) for c in (Clip.SPECULATIVE, Clip.IN_STEP, Clip.OFF)]
    cases += [(programs.lamb, c) for c in (Clip.GIVEN, Clip.OFF)]  # (LAMB's factor is given)
    for build, clip in cases:
        plan = lower(fuse_RS_C_AG(build(DType.float32, clip), state=("m", "v")).program)
        found = [s for s in plan.steps if isinstance(s, Kernel)]
        for unit in plan.fused_collectives:
            found += [s for s in unit.steps if isinstance(s, Kernel)]
        kernels = list({k.name: k for k in found}.values())
        for k in kernels:
            seen: set[str] = set()
            members = {n.name for n in k.nodes}
            for i, n in enumerate(k.nodes):  # a valid order: inputs first
                assert all(x.name in seen or x.name not in members for x in n.inputs)
                seen.add(n.name)
                if spec(n.op).lowering is Lowering.REDUCTION:
                    # nothing elementwise after it could have come before it: each waits,
                    # through the kernel's nodes, for it or a reduction after it
                    for later in k.nodes[i + 1 :]:
                        if spec(later.op).lowering is Lowering.REDUCTION:
                            continue
                        assert _depends_on_reduction(later, k.nodes[i:], members), (
                            n.name, later.name)
            checked += 1
        if build is programs.adam and clip is Clip.SPECULATIVE:
            (k,) = [k for k in kernels if any(n.name == "p_new_slice" for n in k.nodes)]
            names = [n.name for n in k.nodes]
            assert names.index("grad_sumsq_partial") > names.index("p_new_slice")
    assert checked


def _depends_on_reduction(n, among, members) -> bool:
    """Whether ``n`` reads (through the kernel's own nodes) a reduction among ``among``."""
    from coconet.ir.opspec import Lowering, spec

    reductions = {b.name for b in among if spec(b.op).lowering is Lowering.REDUCTION}
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        for i in x.inputs:
            if i.name in reductions:
                return True
            if i.name in members and i.name not in seen:
                seen.add(i.name)
                stack.append(i)
    return False
