"""coconet.tune without processes: the enumeration, candidates, the cost model and explain().

- enumeration: every paper schedule of the examples is among the candidates (structurally) and
  named after it; every enumerated schedule is legal, compiles (code generation only) and
  computes what the unscheduled program computes in the simulator; no two candidates are the
  same program; illegal recipes are recorded with their ``ScheduleError``;
- ``Candidate`` JSON round trip (with fixed algorithms);
- ``Curve.fit`` recovers a fake transport's alpha and beta from noisy points, the curve passes
  through its points, ``MachineModel`` survives JSON;
- ``predict`` with a hand-made machine: fusion never costs, bigger sizes never predict faster,
  shared memory's one-pass fused collective beats torch.distributed when its curves are faster,
  the parts sum to the total, overlap never predicts slower;
- ``TuneResult.explain()`` and ``to_json()`` on a hand-built result (Rows and Measurements made
  directly).
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples_loader import load_example

import coconet as cc
from coconet.errors import ScheduleError
from coconet.ir.ops import Op
from coconet.options import Algorithm, TransportKind
from coconet.schedule import paper
from coconet.sim.exactness import reassociations
from coconet.tune import Candidate, Curve, MachineModel, enumerate_candidates, predict
from coconet.tune.candidates import Rejection, enumerate_schedules
from coconet.tune.measure import Measurement
from coconet.tune.tuner import Row, TuneResult, candidate_rows, tune

pytestmark = pytest.mark.timeout(60)

SHM, TD = TransportKind.SHARED_MEMORY, TransportKind.TORCH_DISTRIBUTED
ADAM_STATE = ("m", "v")
PIPE_MESH = cc.Mesh(pp=2, tp=2)  # a pipeline needs two stages; 2 tensor-parallel ranks in each


def _keys(enumeration) -> set[str]:
    return {
        (s.program if s is not None else enumeration.program).structural_key()
        for s in enumeration.schedules
    }


def _names(enumeration) -> list[str]:
    return [s.name if s is not None else "unscheduled" for s in enumeration.schedules]


# -- enumeration ----------------------------------------------------------------------------------


def test_adam_candidates_include_the_paper_schedules_and_the_program():
    prog = load_example("adam").program()
    found = enumerate_schedules(prog, state=ADAM_STATE)
    assert found.schedules[0] is None and found.recipes[0] == "none"
    keys = _keys(found)
    assert prog.structural_key() in keys
    for s in (
        paper.AR_C(prog),
        paper.RS_C_AG(prog, ADAM_STATE),
        paper.fuse_RS_C_AG(prog, ADAM_STATE),
    ):
        assert s.program.structural_key() in keys, s.name
    assert {"AR_C", "RS_C_AG", "fuse_RS_C_AG"} <= set(_names(found))
    assert len(found.schedules) == len(found.recipes)


def test_tensor_parallel_candidates_include_the_paper_schedules():
    prog = load_example("tensor_parallel").program()
    found = enumerate_schedules(prog)
    keys = _keys(found)
    for s in (paper.MM_AR_C(prog), paper.MM_RS_C_AG(prog), paper.ol_MM_fuse_RS_C_AG(prog, 4)):
        assert s.program.structural_key() in keys, s.name
    names = set(_names(found))
    assert {"MM_AR_C", "MM_RS_C_AG"} <= names
    assert {f"ol_MM_fuse_RS_C_AG({k})" for k in (2, 4, 8)} <= names


def test_pipeline_candidates_include_the_paper_schedules():
    prog = load_example("pipeline_parallel").program()
    found = enumerate_schedules(prog)
    keys = _keys(found)
    for s in (paper.AR_P2P_C(prog), paper.RS_P2P_C_AG(prog), paper.ol_RS_fuse_P2P_C_AG(prog, 4)):
        assert s.program.structural_key() in keys, s.name
    names = set(_names(found))
    assert {"AR_P2P_C", "RS_P2P_C_AG"} <= names
    assert {f"ol_RS_fuse_P2P_C_AG({k})" for k in (2, 4, 8)} <= names


@pytest.mark.parametrize(
    ("example", "state"),
    [
        ("sgd", ("buf",)),
        ("adam", ADAM_STATE),
        ("lamb", ADAM_STATE),
        ("tensor_parallel", ()),
        ("pipeline_parallel", ()),
    ],
)
def test_every_paper_schedule_of_an_example_is_named_among_the_candidates(example, state):
    mod = load_example(example)
    found = enumerate_schedules(mod.program(), chunks=(2, 4), state=state)
    names = set(_names(found))
    for sname in mod.SCHEDULES:
        want = {f"{sname}({k})" for k in (2, 4)} if sname.startswith("ol_") else {sname}
        assert want <= names, (sname, sorted(names))


def _compare(a, b, exact: bool) -> None:
    if isinstance(a, torch.Tensor):
        a, b = [a], [b]
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        if exact:
            assert torch.equal(x, y), (x - y).abs().max()
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _same_in_the_simulator(prog, sched, inputs, world, steps=1) -> None:
    exact = not reassociations(prog, sched)
    want_in, got_in = dict(inputs), dict(inputs)
    for step in range(1, steps + 1):
        if "step" in want_in and prog.input("step").type.dtype == cc.float32:
            want_in["step"] = got_in["step"] = float(step)
        want = cc.simulate(prog, want_in, world)
        got = cc.simulate(sched, got_in, world)
        for name in want.outputs:
            _compare(want.output(name), got.output(name), exact)
        for name in want.updates:
            _compare(want.updated(name), got.updated(name), exact)
            want_in[name], got_in[name] = want.updated(name), got.updated(name)


def _optimizer_inputs(example):
    return load_example(example).make_inputs(2, 7, seed=3, step=1)  # 7: uneven over 2 ranks


def _layer_inputs(_example):
    return load_example("tensor_parallel").make_inputs(2, 6, seed=1, batch=5, out_features=3)


def _pipe_inputs(_example):
    mod = load_example("pipeline_parallel")
    return mod.program_inputs(mod.make_inputs(PIPE_MESH, 6, seed=2, batch=3, out_features=5))


@pytest.mark.parametrize(
    ("example", "state", "inputs", "world"),
    [
        ("adam", ADAM_STATE, _optimizer_inputs, 2),
        ("sgd", ("buf",), _optimizer_inputs, 2),
        ("tensor_parallel", (), _layer_inputs, 2),
        ("pipeline_parallel", (), _pipe_inputs, PIPE_MESH),
    ],
)
def test_every_enumerated_schedule_is_legal_compiles_and_means_the_program(
    example, state, inputs, world
):
    prog = load_example(example).program()
    found = enumerate_schedules(prog, chunks=(2, 4), state=state)
    values = inputs(example)
    assert len(found.schedules) > 3
    for s in found.schedules[1:]:
        s.program.verify()
        cc.compile(s, world=world)  # code generation only
        _same_in_the_simulator(prog, s.program, values, world, steps=2)


def test_no_two_candidates_are_the_same_program():
    for example, state in (("adam", ADAM_STATE), ("adam", ()), ("tensor_parallel", ())):
        found = enumerate_schedules(load_example(example).program(), state=state)
        keys = [
            (s.program if s is not None else found.program).structural_key()
            for s in found.schedules
        ]
        assert len(keys) == len(set(keys)), example
        # a duplicate names a candidate that is in the list
        assert set(found.duplicates.values()) <= set(_names(found))


def test_candidates_cross_schedules_and_transports():
    prog = load_example("adam").program()
    cands, found = enumerate_candidates(prog, [SHM, TD], state=ADAM_STATE)
    assert len(cands) == 2 * len(found.schedules)
    assert cands[0].schedule is None and cands[0].name == "unscheduled"
    keys = [c.key for c in cands]
    assert len(keys) == len(set(keys))
    assert {c.transport for c in cands} == {SHM, TD}
    for c in cands:
        assert c.target is (c.schedule if c.schedule is not None else prog)
        assert c.label.startswith(c.name) and c.transport.value in c.label


def test_a_program_without_an_all_reduce_has_only_itself():
    x = cc.Tensor("x", cc.float32, [cc.Dim("N")], cc.Replicated)
    prog = cc.Program("scale", [x], {"y": (x * 2.0).named("y")})
    found = enumerate_schedules(prog, state=())
    assert found.schedules == [None] and found.recipes == ["none"]
    assert not found.rejected and not found.duplicates
    cands, _ = enumerate_candidates(prog, [SHM, TD])
    assert [c.name for c in cands] == ["unscheduled", "unscheduled"]


def test_rejections_carry_the_primitives_error():
    found = enumerate_schedules(load_example("adam").program(), state=ADAM_STATE)
    assert found.rejected
    for j in found.rejected:
        assert isinstance(j, Rejection) and isinstance(j.error, ScheduleError)
        assert j.error.message and str(j).startswith(f"{j.recipe}: illegal: ")
    overlap = [j for j in found.rejected if j.recipe.startswith("split+reorder+fuse_collective+")]
    assert {j.recipe for j in overlap} == {
        f"split+reorder+fuse_collective+overlap({k})" for k in (2, 4, 8)
    }
    for j in overlap:
        assert "not a matmul" in j.error.message and j.error.op == "overlap"
    # Without state, as_slice has nothing to slice: rejected, naming what to pass.
    bare = enumerate_schedules(load_example("adam").program())
    sliced = [j for j in bare.rejected if "as_slice" in j.recipe]
    assert sliced and all("no optimizer state" in j.error.message for j in sliced)


def test_state_must_name_inputs():
    with pytest.raises(ScheduleError, match="p_not_an_input"):
        enumerate_schedules(load_example("adam").program(), state=("p_not_an_input",))


# -- candidates serialise ------------------------------------------------------------------------


def test_candidates_round_trip_through_json():
    prog = load_example("adam").program()
    cands, _ = enumerate_candidates(prog, [SHM, TD], state=ADAM_STATE)
    picked = [c for c in cands if c.name in ("unscheduled", "AR_C", "fuse_RS_C_AG")]
    picked += [
        c.with_algorithms({Op.ALL_REDUCE: Algorithm.ALL_TO_ALL, Op.ALL_GATHER: Algorithm.NATIVE})
        for c in picked
        if c.transport is TD
    ]
    assert len(picked) == 9
    for c in picked:
        back = Candidate.from_json(prog, c.to_json())
        assert back.key == c.key and back.label == c.label
        assert back.recipe == c.recipe and back.algorithms == c.algorithms
        assert str(back) == str(c)
    with pytest.raises(ScheduleError):
        Candidate.from_json(prog, json.dumps({"format": "something else"}))


def test_candidate_algorithms_are_sorted_and_shown():
    prog = load_example("adam").program()
    c = enumerate_candidates(prog, [TD])[0][0]
    a = c.with_algorithms({Op.REDUCE_SCATTER: Algorithm.NATIVE, Op.ALL_GATHER: Algorithm.NATIVE})
    b = c.with_algorithms({Op.ALL_GATHER: Algorithm.NATIVE, Op.REDUCE_SCATTER: Algorithm.NATIVE})
    assert a.key == b.key and a.key != c.key
    assert "all_gather=native" in a.label and "reduce_scatter=native" in a.label


def test_parent_recipe():
    prog = load_example("adam").program()
    cands, _ = enumerate_candidates(prog, [SHM], state=ADAM_STATE)
    by = {c.recipe: c for c in cands}
    assert by["none"].parent_recipe is None
    assert by["fuse"].parent_recipe == "none"
    assert by["split+reorder+as_slice"].parent_recipe == "split+reorder"
    assert by["split+reorder+as_slice"].last_rewrite == "as_slice"


# -- curves ---------------------------------------------------------------------------------------

noise = st.floats(min_value=-0.03, max_value=0.03, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    alpha=st.floats(min_value=1e-6, max_value=1e-3),
    beta=st.floats(min_value=1e-11, max_value=1e-8),
    noises=st.lists(noise, min_size=9, max_size=9),
)
def test_curve_fit_recovers_a_fake_transports_alpha_and_beta(alpha, beta, noises):
    # Sizes from where latency dominates to where bandwidth does (both can be identified).
    cross = alpha / beta
    sizes = [cross * 10.0 ** (k / 2) for k in range(-4, 5)]
    points = [(b, (alpha + beta * b) * (1 + e)) for b, e in zip(sizes, noises, strict=True)]
    curve = Curve.fit(points)
    assert curve.alpha == pytest.approx(alpha, rel=0.10)
    assert curve.beta == pytest.approx(beta, rel=0.10)
    assert curve.bandwidth == pytest.approx(1 / beta, rel=0.12)


@settings(max_examples=40, deadline=None)
@given(
    times=st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=2, max_size=6),
    frac=st.floats(min_value=0.0, max_value=1.0),
)
def test_curve_passes_through_its_points_and_between_them(times, frac):
    sizes = [float(1 << (10 + 3 * i)) for i in range(len(times))]
    curve = Curve.fit(list(zip(sizes, times, strict=True)))
    for b, t in zip(sizes, times, strict=True):
        assert curve(b) == pytest.approx(t, rel=1e-12)
    for (b0, t0), (b1, t1) in zip(curve.points, curve.points[1:], strict=False):
        mid = curve(b0 + frac * (b1 - b0))
        assert min(t0, t1) * (1 - 1e-12) <= mid <= max(t0, t1) * (1 + 1e-12)
    far = sizes[-1] * 4
    assert curve(far) == pytest.approx(times[-1] + curve.beta * (far - sizes[-1]))
    assert curve.alpha >= 0 and curve.beta >= 0


def test_a_line_alone_and_one_point():
    line = Curve(2e-6, 1e-9)
    assert line(1000) == pytest.approx(2e-6 + 1e-6)
    one = Curve.fit([(1000.0, 1e-3)])
    assert one.alpha == 0 and one(2000) == pytest.approx(2e-3)


# -- a hand-made machine --------------------------------------------------------------------------


def _line(alpha: float, beta: float) -> Curve:
    sizes = [float(1 << k) for k in (16, 20, 23, 26)]
    return Curve.fit([(b, alpha + beta * b) for b in sizes])


def machine(shm_speedup: float = 4.0, overlap: float = 0.0) -> MachineModel:
    collectives = {}
    for op, beta in ((Op.ALL_REDUCE, 2e-9), (Op.REDUCE_SCATTER, 1e-9), (Op.ALL_GATHER, 1e-9)):
        collectives[(TD, op, Algorithm.NATIVE, False)] = _line(50e-6, beta)
        collectives[(TD, op, Algorithm.ALL_TO_ALL, False)] = _line(80e-6, 1.5 * beta)
        collectives[(SHM, op, None, False)] = _line(10e-6 / shm_speedup, beta / shm_speedup)
    collectives[(SHM, Op.ALL_REDUCE, None, True)] = _line(5e-6, 1e-9 / shm_speedup)
    return MachineModel(
        description="hand-made",
        world=2,
        collectives=collectives,
        memory=_line(2e-6, 1e-10),
        flops=5e10,
        control={TD: 40e-6, SHM: 8e-6},
        op_overhead=5e-6,
        overlap=overlap,
    )


def test_machine_model_round_trips_through_json():
    model = machine(overlap=0.5)
    doc = json.loads(json.dumps(model.to_json()))
    back = MachineModel.from_json(doc)
    assert back == model
    assert back.collective(Op.ALL_REDUCE, TD, 1 << 20, 2) == model.collective(
        Op.ALL_REDUCE, TD, 1 << 20, 2
    )


def test_the_machine_picks_the_fastest_algorithm_and_falls_back():
    model = machine()
    seconds, algo = model.collective(Op.ALL_REDUCE, TD, 1 << 20, 2)
    assert algo is Algorithm.NATIVE
    fixed, algo2 = model.collective(Op.ALL_REDUCE, TD, 1 << 20, 2, Algorithm.ALL_TO_ALL)
    assert algo2 is Algorithm.ALL_TO_ALL and fixed > seconds
    assert model.collective(Op.ALL_REDUCE, TD, 1 << 20, 1) == (0.0, None)  # one rank: free
    # a send is not calibrated: like an all_gather of the tensor
    assert model.collective(Op.SEND, SHM, 4096, 2) == model.collective(Op.ALL_GATHER, SHM, 4096, 2)


@functools.cache
def _adam_candidates(transports=(SHM, TD)):
    prog = load_example("adam").program()
    return tuple(enumerate_candidates(prog, list(transports), state=ADAM_STATE)[0])


def _by_name(cands, transport=SHM):
    return {c.name: c for c in cands if c.transport is transport}


@pytest.mark.parametrize("transport", [SHM, TD])
@pytest.mark.parametrize("n", [1 << 12, 1 << 16, 1 << 22])
def test_fusing_is_predicted_no_slower_than_the_program(transport, n):
    model = machine()
    by = _by_name(_adam_candidates(), transport)
    unscheduled = predict(by["unscheduled"], {"N": n}, model, 2)
    fused = predict(by["AR_C"], {"N": n}, model, 2)
    assert fused.ms <= unscheduled.ms


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=1 << 24),
    factor=st.integers(min_value=2, max_value=64),
)
def test_a_bigger_size_never_predicts_faster(n, factor):
    model = machine()
    for c in _adam_candidates():
        small = predict(c, {"N": n}, model, 2).ms
        big = predict(c, {"N": n * factor}, model, 2).ms
        assert big >= small * (1 - 1e-12), c.label


@pytest.mark.parametrize("n", [1 << 14, 1 << 20, 1 << 24])
def test_shared_memory_fused_collective_beats_torch_distributed(n):
    model = machine(shm_speedup=4.0)
    cands = _adam_candidates()
    shm = _by_name(cands, SHM)["fuse_RS_C_AG"]
    td = _by_name(cands, TD)["fuse_RS_C_AG"]
    assert predict(shm, {"N": n}, model, 2).ms < predict(td, {"N": n}, model, 2).ms


@pytest.mark.parametrize("example", ["adam", "tensor_parallel", "pipeline_parallel"])
def test_prediction_parts_sum_to_the_total(example):
    mod = load_example(example)
    prog = mod.program()
    state = getattr(mod, "STATE", ())
    cands, _ = enumerate_candidates(prog, [SHM, TD], state=state)
    if example == "adam":
        sizes, mesh = {"N": 1 << 16}, 2
    else:
        sizes = {"B": 64, "H": 256, "H2": 128}
        mesh = PIPE_MESH if example == "pipeline_parallel" else 2
    model = machine()
    for c in cands:
        p = predict(c, sizes, model, mesh)
        assert p.parts and all(part.seconds >= 0 for part in p.parts)
        assert p.ms == pytest.approx(1e3 * sum(part.seconds for part in p.parts), rel=1e-12)
        assert p.ms == pytest.approx(1e3 * sum(p.by_kind().values()), rel=1e-12)
        assert set(p.by_kind()) <= {"compute", "communication", "commit", "control"}
        assert math.isfinite(p.ms) and p.ms > 0
        if c.transport is TD:
            assert all(isinstance(a, Algorithm) for a in p.algorithms.values())


@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_overlap_never_predicts_slower(chunks):
    prog = load_example("tensor_parallel").program()
    cands, _ = enumerate_candidates(prog, [SHM, TD], chunks=(chunks,))
    overlapped = [c for c in cands if "overlap" in c.recipe]
    assert {c.name for c in overlapped} >= {f"ol_MM_fuse_RS_C_AG({chunks})"}
    sizes = {"B": 256, "H": 1024, "H2": 1024}
    for c in overlapped:
        serial = predict(c, sizes, machine(overlap=0.0), 2).ms
        hidden = predict(c, sizes, machine(overlap=1.0), 2).ms
        assert hidden <= serial, c.label
    assert any(
        predict(c, sizes, machine(overlap=1.0), 2).ms < predict(c, sizes, machine(), 2).ms
        for c in overlapped
    )


def _all_to_all_faster() -> MachineModel:
    """``machine()`` whose all_to_all algorithms beat the native ones on torch.distributed."""
    model = machine()
    for op, beta in ((Op.ALL_REDUCE, 2e-9), (Op.REDUCE_SCATTER, 1e-9), (Op.ALL_GATHER, 1e-9)):
        model.collectives[(TD, op, Algorithm.ALL_TO_ALL, False)] = _line(20e-6, 0.5 * beta)
    return model


def test_torch_distributed_rows_add_the_native_algorithms_when_the_model_chose_others():
    model = _all_to_all_faster()
    cands = list(_adam_candidates())
    rows = candidate_rows(cands, lambda c: predict(c, {"N": 1 << 20}, model, 2))
    shm = [r for r in rows if r.candidate.transport is SHM]
    td = [r for r in rows if r.candidate.transport is TD]
    assert len(shm) == len(cands) // 2 and all(r.candidate.algorithms == () for r in shm)
    assert len(td) == 2 * (len(cands) // 2)  # every schedule communicates: two variants each
    by_schedule: dict = {}
    for r in td:
        by_schedule.setdefault(r.candidate.recipe, []).append(r)
    for recipe, (chosen, native) in by_schedule.items():
        assert {a for _, a in chosen.candidate.algorithms} == {Algorithm.ALL_TO_ALL}, recipe
        assert {a for _, a in native.candidate.algorithms} == {Algorithm.NATIVE}, recipe
        assert [op for op, _ in chosen.candidate.algorithms] == [
            op for op, _ in native.candidate.algorithms
        ]
        assert chosen.predicted_ms < native.predicted_ms, recipe  # the model's choice is its best
    assert len({r.candidate.key for r in rows}) == len(rows)  # all distinct candidates


def test_no_native_variant_when_the_model_chose_native_or_algorithms_are_left_open():
    cands = list(_adam_candidates())
    model = machine()  # native is the fastest everywhere
    rows = candidate_rows(cands, lambda c: predict(c, {"N": 1 << 20}, model, 2))
    assert len(rows) == len(cands)
    fast = _all_to_all_faster()
    rows = candidate_rows(cands, lambda c: predict(c, {"N": 1 << 20}, fast, 2), False)
    assert [r.candidate for r in rows] == cands  # the communicator chooses: one row each


def test_explain_counts_and_compares_the_native_variants():
    model = _all_to_all_faster()
    prog = load_example("adam").program()
    cands, found = enumerate_candidates(prog, [SHM, TD], state=ADAM_STATE)
    rows = candidate_rows(cands, lambda c: predict(c, {"N": 4096}, model, 2))
    rows[0].measured = Measurement(rows[0].candidate, 1.0, [1.0])
    result = TuneResult(prog, {"N": 4096}, 2, rows, found, model.description)
    text = result.explain()
    n = len(found.schedules)
    assert f"{len(rows)} candidates ({n} schedules x 2 transport(s), and {n} with " in text
    assert (
        "native algorithms instead of all_reduce=all_to_all (unscheduled, torch.distributed)"
        in text
    )


# -- explain() and to_json() on a hand-built result ---------------------------------------------


def _result() -> TuneResult:
    prog = load_example("adam").program()
    cands, found = enumerate_candidates(prog, [SHM, TD], state=ADAM_STATE)
    model = machine()
    rows = [Row(c, p.ms, p.parts) for c in cands for p in [predict(c, {"N": 4096}, model, 2)]]
    by = {(r.candidate.name, r.candidate.transport): r for r in rows}
    winner = by[("fuse_RS_C_AG", SHM)]
    runner_up = by[("AR_C", SHM)]
    slower = by[("unscheduled", SHM)]
    failed = by[("RS_C_AG", TD)]
    timed_out = by[("AR_C", TD)]
    winner.measured = Measurement(winner.candidate, 1.0, [1.0, 1.1, 0.9])
    runner_up.measured = Measurement(runner_up.candidate, 1.6, [1.6])
    slower.measured = Measurement(slower.candidate, 2.5, [2.5])
    failed.measured = Measurement(
        failed.candidate, None, error="rank 1: RuntimeError: deliberately broken"
    )
    timed_out.measured = Measurement(
        timed_out.candidate, None, error="timed out: warm-up took more than 60 s", timed_out=True
    )
    return TuneResult(prog, {"N": 4096}, 2, rows, found, model.description, {"top": 3})


def test_explain_says_why_the_winner_won_and_the_others_lost():
    result = _result()
    assert result.winner.name == "fuse_RS_C_AG" and result.winner.transport is SHM
    text = result.explain()
    assert result.winner.label in text
    assert f"winner: {result.winner.label}" in text
    assert "faster than the runner-up" in text and "AR_C [shared memory]" in text
    assert "0.60 ms (38%) faster than the runner-up" in text
    rejected = result.enumeration.rejected[0]
    assert f"{rejected.recipe}: illegal: {rejected.error.message}" in text
    assert "unscheduled [shared memory]: legal, slower by 1.50 ms measured (150%)" in text
    assert "RS_C_AG [torch.distributed]: rank 1: RuntimeError: deliberately broken" in text
    assert "failed" in text
    assert "timed out" in text
    assert "predicted slower by" in text and "not measured" in text
    assert "what each rewrite was predicted to save" in text
    assert "prediction: mean error" in text


def test_explain_of_a_single_measured_candidate():
    result = _result()
    for r in result.rows:
        if r.candidate.name != "fuse_RS_C_AG" or r.candidate.transport is not SHM:
            r.measured = None
    assert "no other candidate ran" in result.explain()


def test_no_candidate_ran_is_an_error():
    result = _result()
    for r in result.rows:
        r.measured = Measurement(r.candidate, None, error="rank 0: boom") if r.measured else None
    with pytest.raises(cc.errors.ConfigError, match="every measured one failed"):
        _ = result.winner


def test_to_json_has_the_documented_keys_and_reads_back():
    result = _result()
    doc = json.loads(json.dumps(result.to_json()))
    assert set(doc) == {
        "program",
        "world_size",
        "sizes",
        "machine",
        "options",
        "candidates",
        "rejected",
        "duplicates",
        "winner",
        "rematch",
        "seconds",
    }
    assert doc["rematch"] is None
    assert doc["program"] == "adam" and doc["world_size"] == 2
    assert doc["winner"] == str(result.winner)
    assert len(doc["candidates"]) == len(result.rows)
    for entry, row in zip(doc["candidates"], result.rows, strict=True):
        assert {"schedule", "predicted_ms", "measured_ms"} <= set(entry)
        assert entry["schedule"] == str(row.candidate)
        assert entry["measured_ms"] == row.measured_ms
    assert [j["recipe"] for j in doc["rejected"]] == [j.recipe for j in result.enumeration.rejected]
    back = TuneResult.from_json(result.program, doc, result.enumeration)
    assert back.cached and str(back.winner) == str(result.winner)
    assert [r.measured_ms for r in back.rows] == [r.measured_ms for r in result.rows]
    assert [r.candidate.key for r in back.rows] == [r.candidate.key for r in result.rows]
    timed = [r for r in back.rows if r.measured is not None and r.measured.timed_out]
    assert len(timed) == 1
    assert "(from the cache, read in " in back.explain()


def test_explain_carries_the_calibrations_drift_as_an_uncertainty():
    """With one calibration kept, the drift is unknown and explain says how to learn it; with
    earlier ones, the winner's prediction under each (newest first) gives its span, and the
    mean error over the measured under each earlier calibration stands beside this one's. The
    earlier predictions go through the JSON and back."""
    result = _result()
    assert "calibration drift: unknown" in result.explain()
    for r in result.rows:  # two earlier calibrations: 20% faster and 10% slower than this one
        r.earlier_ms = [0.8 * r.predicted_ms, 1.1 * r.predicted_ms]
    winner = result.winner_row
    winner.earlier_ms[1] = None  # one that cannot predict the winner is left out of its span
    text = result.explain()
    lo, hi = 0.8 * winner.predicted_ms, winner.predicted_ms
    assert f"2 earlier calibration(s) kept: the winner's prediction spans {lo:.2f}-{hi:.2f} ms" \
        in text, text
    assert f"+/-{(hi - lo) / (hi + lo):.0%}" in text
    errs = [abs(0.8 * r.predicted_ms - r.measured_ms) / r.measured_ms
            for r in result.measured if r.measured_ms is not None]  # fmt: skip
    assert f"earlier calibration #1 (newest first): mean error {sum(errs) / len(errs):.0%}" \
        f" over the {len(errs)} measured" in text
    assert "earlier calibration #2 (newest first)" in text  # (the others could predict)
    doc = json.loads(json.dumps(result.to_json()))
    back = TuneResult.from_json(result.program, doc, result.enumeration)
    assert [r.earlier_ms for r in back.rows] == [r.earlier_ms for r in result.rows]


def test_a_machine_keeps_its_earlier_calibrations_newest_first():
    """What a cached machine document keeps of its earlier calibrations: the valid entries,
    newest first, at most EARLIER_KEPT; a document written before they were kept has none."""
    from coconet.tune.tuner import EARLIER_KEPT, earlier_calibrations

    model = machine()
    docs = [dict(model.to_json(), conditions={"at": float(i)}) for i in range(EARLIER_KEPT + 2)]
    assert earlier_calibrations(None) == earlier_calibrations(model.to_json()) == []
    kept = earlier_calibrations({"earlier": [docs[0], {"description": "damaged"}, *docs[1:]]})
    assert [d["conditions"]["at"] for d in kept] == [float(i) for i in range(EARLIER_KEPT)]


def _rematched(first_ms: list[float], second_ms: list[float]) -> TuneResult:
    """``_result()`` whose two best (fuse_RS_C_AG 1.0 ms, AR_C 1.6 ms) met in a rematch."""
    from coconet.tune.measure import Rematch

    result = _result()
    first, second = (r.candidate for r in result.measured[:2])
    result.rematch = Rematch(first, second, first_ms, second_ms)
    return result


def test_a_rematch_the_runner_up_wins_overturns_the_first_round():
    result = _rematched([2.0, 2.2, 1.9], [1.5, 1.4, 1.6])
    assert result.rematch.overturned
    assert result.winner.name == "AR_C" and result.winner.transport is SHM
    text = result.explain()
    assert f"winner: {result.winner.label}" in text
    assert "deciding round, their steps interleaved (3 each)" in text
    assert "1.50 ms against 2.00 ms for fuse_RS_C_AG [shared memory]" in text
    assert "it overturned the first round" in text
    assert "slower than fuse_RS_C_AG [shared memory] (1.00 ms) in the first round" in text
    assert "fuse_RS_C_AG [shared memory]: legal, lost the deciding round: 2.00 ms" in text
    assert "slower by -" not in text
    rows = [line for line in text.splitlines() if line.lstrip().startswith("1 ")]
    assert rows and "AR_C [shared memory]" in rows[0] and "winner" in rows[0]


def test_a_rematch_the_first_round_winner_wins_keeps_it():
    result = _rematched([1.0, 1.1, 0.9], [1.5, 1.4, 1.6])
    assert not result.rematch.overturned
    assert result.winner.name == "fuse_RS_C_AG"
    text = result.explain()
    assert "1.00 ms against 1.50 ms for AR_C [shared memory]" in text
    assert "overturned" not in text
    assert "AR_C [shared memory]: legal, lost the deciding round: 1.50 ms against 1.00" in text


def test_a_rematch_reads_back_from_json():
    result = _rematched([2.0, 2.2, 1.9], [1.5, 1.4, 1.6])
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["winner"] == str(result.winner)
    assert doc["rematch"]["first_ms"] == [2.0, 2.2, 1.9]
    back = TuneResult.from_json(result.program, doc, result.enumeration)
    assert back.rematch is not None and back.rematch.medians == (2.0, 1.5)
    assert str(back.rematch.first) == str(result.rematch.first)
    assert str(back.winner) == str(result.winner)


def test_rematch_within_must_be_a_fraction():
    prog = load_example("adam").program()
    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(cc.errors.ConfigError, match="rematch_within"):
            tune(prog, object(), {"N": 64}, rematch_within=bad)


def test_measurement_inputs_fit_integer_scalars():
    from types import SimpleNamespace

    from coconet.ir.mesh import Mesh
    from coconet.tune.measure import program_inputs

    prog = load_example("tensor_parallel").program()
    cand = enumerate_candidates(prog, [TD])[0][0]
    comm = SimpleNamespace(mesh=Mesh.world(2), rank=0, device=torch.device("cpu"))
    values = program_inputs(cand.scheduled, {"B": 4, "H": 8, "H2": 4}, comm, {}, seed=0)
    assert values["x"].shape == (4, 4)
    for name in ("seed", "step"):
        assert float(values[name]).is_integer(), (name, values[name])


def test_a_curve_never_predicts_a_smaller_message_slower():
    # A noisy calibration (within 3% of a line) whose first point lies below the fitted line.
    points = [
        (65536.0, 0.0004040973807483084),
        (1048576.0, 0.006741491880206626),
        (8388608.0, 0.053778701770214),
        (67108864.0, 0.4319964241211237),
    ]
    curve = Curve.fit(points)
    first = points[0][0]
    for b in (0.999 * first, 0.5 * first, 0.1 * first):
        assert curve(b) <= curve(first), (b, curve(b), curve(first))


def test_explain_never_says_slower_by_a_negative_amount():
    result = _result()
    for r in result.rows:
        r.measured = None
    # The baseline wins (it is always measured), the best predicted was measured slower, the
    # second best predicted was not measured.
    by = sorted(result.rows, key=lambda r: r.predicted_ms)
    best_predicted, baseline = by[1], next(r for r in by if r.candidate.schedule is None)
    assert baseline.predicted_ms > best_predicted.predicted_ms
    baseline.measured = Measurement(baseline.candidate, 1.0, [1.0])
    by[0].measured = Measurement(by[0].candidate, 2.0, [2.0])
    assert result.winner_row is baseline
    assert best_predicted.predicted_ms < result.winner_row.predicted_ms
    text = result.explain()
    assert "slower by -" not in text


@pytest.mark.parametrize(
    ("example", "state"),
    [("tensor_parallel", ()), ("pipeline_parallel", ()), ("lamb", ADAM_STATE)],
)
def test_every_candidate_of_an_example_round_trips_through_json(example, state):
    prog = load_example(example).program()
    cands, _ = enumerate_candidates(prog, [SHM, TD], state=state)
    for c in cands:
        back = Candidate.from_json(prog, c.to_json())
        assert back.key == c.key and back.label == c.label, c.label
