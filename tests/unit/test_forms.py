"""The lowering forms (``coconet.codegen.forms``): one registry per transport, one decision that
the emitter and the cost model both read, so what the code does and what the tuner predicts
cannot disagree."""

from __future__ import annotations

import pytest
from support.examples_loader import load_example

import coconet as cc
from coconet.codegen import lower
from coconet.codegen.emit import EMISSIONS, emit
from coconet.codegen.forms import (
    REGISTRY,
    Form,
    forms,
    loop_one_pass,
    missing_transports,
    one_pass,
    reads_in_place,
)
from coconet.ir.ops import Op
from coconet.options import TransportKind
from coconet.tune.candidates import Candidate
from coconet.tune.cost import Curve, MachineModel, predict

# (example, schedule) pairs of the paper, each with the forms shared memory gives it
PAPER = [
    ("sgd", "AR_C"),
    ("adam", "AR_C"),
    ("adam", "RS_C_AG"),
    ("adam", "fuse_RS_C_AG"),
    ("adamw", "fuse_RS_C_AG"),
    ("lamb", "fuse_RS_C_AG"),
    ("lamb", "AR_C"),
    ("tensor_parallel", "ol_MM_fuse_RS_C_AG"),
    ("tensor_parallel", "MM_RS_C_AG"),
]


def _scheduled(example: str, schedule: str):
    mod = load_example(example)
    return mod.SCHEDULES[schedule](mod.program())


def test_every_transport_has_a_registry_entry_and_an_emission_for_its_forms():
    assert missing_transports() == []
    for kind, entry in REGISTRY.items():
        has_forms = any(
            (entry.fused_collective, entry.chunk_loop, entry.all_reduce, entry.publishes)
        )
        assert (kind in EMISSIONS) == has_forms, kind


@pytest.mark.parametrize(("example", "schedule"), PAPER)
def test_torch_distributed_runs_every_unit_plainly(example, schedule):
    plan = lower(_scheduled(example, schedule).program)
    f = forms(plan, TransportKind.TORCH_DISTRIBUTED)
    assert not f.units and not f.loops and not f.in_place and not f.published
    assert all(f.of(s) is Form.PLAIN for s in plan.body)


@pytest.mark.parametrize(("example", "schedule"), PAPER)
def test_shared_memory_takes_every_form_the_matchers_find(example, schedule):
    plan = lower(_scheduled(example, schedule).program)
    f = forms(plan, TransportKind.SHARED_MEMORY)
    assert set(f.units) == {u.name for u in plan.fused_collectives if one_pass(u) is not None}
    assert set(f.loops) == {lp.name for lp in plan.loops if loop_one_pass(lp) is not None}
    assert set(f.in_place) == {r.all_reduce.name for r in reads_in_place(plan)}
    # by axis or for every axis: the same decision
    assert forms(plan, {None: TransportKind.SHARED_MEMORY}).units.keys() == f.units.keys()


@pytest.mark.parametrize(("example", "schedule"), PAPER)
def test_the_emitter_writes_what_the_forms_say(example, schedule):
    target = _scheduled(example, schedule)
    plan = lower(target.program)
    f = forms(plan, TransportKind.SHARED_MEMORY)
    source = cc.compile(target, world=2, transport="shared memory").source
    body = source[source.index("def step(") :]
    assert body.count("published=True") == len(f.published)
    assert body.count(".reduce_in_place(") == len(f.in_place)
    assert body.count("_channel = comm.one_pass(") == len(f.units) + len(f.loops)
    for k in f.one_pass_kernels:
        assert f"_kernel_{k}_one_pass" in source
    for k in f.kernels_in_place:
        assert f"_kernel_{k}_by_parts" in source


def _model() -> MachineModel:
    """A machine where every collective costs 1 ms + 1 ns a byte and memory 0.1 ns a byte."""
    line = Curve(1e-3, 1e-9)
    collectives = {
        (t, op, None, False): line
        for t in TransportKind
        for op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER)
    }
    return MachineModel(
        description="test",
        world=2,
        collectives=collectives,
        memory=Curve(0.0, 1e-10),
        flops=1e12,
        op_overhead=1e-5,
        control={t: 1e-4 for t in TransportKind},
    )


@pytest.mark.parametrize(("example", "schedule"), PAPER)
def test_the_cost_model_predicts_the_forms_the_emitter_writes(example, schedule):
    mod = load_example(example)
    target = mod.SCHEDULES[schedule](mod.program())
    plan = lower(target.program)
    sizes = {d: 1 << 16 for d in _dims(target.program)}
    for kind in TransportKind:
        cand = Candidate(mod.program(), target, kind)
        f = forms(plan, kind)
        parts = [p.what for p in predict(cand, sizes, _model(), 2).parts]
        assert sum("read in place" in p for p in parts) == len(f.in_place), (kind, parts)
        assert sum(": one pass (" in p for p in parts) == len(f.units), (kind, parts)
        # a published gather's copy is the commit's: no separate commit of its input
        committed = {p.removeprefix("commit ") for p in parts if p.startswith("commit ")}
        for u in target.program.updates:
            if u.inputs[1].name in f.published:
                assert u.inputs[0].name not in committed, (kind, u)


def _dims(program) -> set[str]:
    return {s.name for n in program.nodes for s in n.type.shape if isinstance(s, cc.Dim)}


def test_a_gather_followed_by_a_collective_is_not_published_in_the_prediction_either():
    """The emitter copies a one-pass gather out when a collective follows it in the step (its
    slots would hold the group's epoch open); the cost model then counts the commit's copy too
    (it once counted every one-pass gather as published). A scalar all_reduce over the whole
    mesh (a norm computed in the same pass) runs over the control channel instead
    (``Form.CONTROL``) and leaves the gather published."""
    from coconet.schedule import fuse_RS_C_AG

    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    h = cc.Tensor("h", cc.float32, [N], cc.Local)
    w = cc.Tensor("w", cc.float32, [N], cc.Replicated)
    w_new = (w - cc.all_reduce(g, name="g_sum")).named("w_new")
    followed = cc.Program(
        "followed", [g, h, w],
        {"h_sum": cc.all_reduce(h * w_new, name="h_sum"), "u": cc.update(w, w_new)},
    )
    scalar = cc.Program(
        "scalar", [g, w], {"total": (w_new * w_new).sum(), "u": cc.update(w, w_new)}
    )
    alone = cc.Program("alone", [g, w], [cc.update(w, w_new)])
    for program, published in ((followed, False), (scalar, True), (alone, True)):
        target = fuse_RS_C_AG(program, all_reduce="g_sum")
        f = forms(lower(target.program), TransportKind.SHARED_MEMORY)
        assert bool(f.published) is published, program.name
        assert bool(f.control) is (program is scalar), (program.name, f.control)
        cand = Candidate(program, target, TransportKind.SHARED_MEMORY)
        parts = [p.what for p in predict(cand, {"N": 1 << 16}, _model(), 2).parts]
        assert ("commit w" in parts) is not published, (program.name, parts)
    # over torch.distributed nothing is published, so nothing rides the control channel
    f = forms(lower(fuse_RS_C_AG(scalar).program), TransportKind.TORCH_DISTRIBUTED)
    assert not f.published and not f.control


@pytest.mark.parametrize(("example", "schedule"), PAPER)
def test_a_published_gather_names_the_input_it_is_committed_into(example, schedule):
    """What a host replica flips (``coconet.runtime.replica``): the one update target of each
    published gather, emitted as the module's ``REPLICA_INPUTS`` and passed to the channel."""
    target = _scheduled(example, schedule)
    plan = lower(target.program)
    f = forms(plan, TransportKind.SHARED_MEMORY)
    program = target.program
    flips = set()
    for name in f.published:
        into = f.commit_target(program.node(name))
        assert into is not None and into.op is Op.INPUT, name
        assert any(u.inputs[0] is into and u.inputs[1].name == name for u in program.updates)
        flips.add(into.name)
    for u in program.updates:  # an update that is not a published gather flips nothing
        if u.inputs[1].name not in f.published:
            assert f.commit_target(u.inputs[1]) is None
    source = emit(plan, [], f)
    listed = f"REPLICA_INPUTS = ({', '.join(repr(n) for n in sorted(flips))}"
    assert (listed in source) is bool(flips), source[:2000]
    if flips:
        assert "gather_into=" in source or "into=" in source
    # torch.distributed publishes nothing: nothing to flip
    assert "REPLICA_INPUTS" not in emit(plan, [], forms(plan, TransportKind.TORCH_DISTRIBUTED))


@pytest.mark.parametrize(("example", "schedule"), [("adam", "fuse_RS_C_AG"),
                                                    ("lamb", "fuse_RS_C_AG")])
def test_the_cost_model_predicts_no_gather_into_a_host_replica(example, schedule):
    mod = load_example(example)
    target = mod.SCHEDULES[schedule](mod.program())
    cand = Candidate(mod.program(), target, TransportKind.SHARED_MEMORY)
    sizes = {"N": 1 << 20}
    per_rank = predict(cand, sizes, _model(), 2)
    shared = predict(cand, sizes, _model(), 2, replicas=("p",))
    gathers = [p.what for p in per_rank.parts if ": gather p_new" in p.what]
    assert gathers, per_rank.parts
    assert not [p for p in shared.parts if ": gather p_new" in p.what], shared.parts
    assert shared.ms < per_rank.ms
    # the same parts otherwise
    assert {p.what for p in per_rank.parts} - {p.what for p in shared.parts} == set(gathers)
