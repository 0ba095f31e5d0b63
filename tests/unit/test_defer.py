"""``defer``: a collective started at the end of one step and waited for at the next call's
start (``coconet.schedule.defer``). What it accepts and what it refuses (each refusal naming
both lines: the collective's and the reader's), what the lowering makes of it, its JSON record,
and the compiled step against the simulator on a world of one in this process (the ranks' runs
are tests/dist/test_dist_defer.py's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import defer_workers as w

import coconet as cc
from coconet import runtime
from coconet.codegen.plan import lower
from coconet.errors import ScheduleError
from coconet.ir.group import GroupKind
from coconet.ir.ops import Op
from coconet.options import CommOptions
from coconet.schedule import Schedule

N = cc.Dim("N")
HERE = __file__.rsplit("/", 1)[-1]


def _state():
    x = cc.Tensor("x", cc.float32, [N], cc.Local)
    a = cc.Tensor("a", cc.float32, [N], cc.Replicated)
    b = cc.Tensor("b", cc.float32, [N], cc.Replicated)
    return x, a, b


def test_the_sync_program_defers_its_average_and_lands_it_in_a():
    s = w.deferred()
    assert str(s).splitlines()[-1].strip() == "defer(a_new_sum)"
    (group,) = s.program.groups
    assert group.kind is GroupKind.DEFER and group.members == ("a_new_sum", "a_new")
    assert "# schedule: defer(a_new_sum, a_new)" in str(s.program)
    plan = lower(s.program)
    (d,) = plan.deferred
    assert d.collective.name == "a_new_sum" and d.lands_in == ("a",)
    assert d.snapshot  # x_new is also x's update: the collective gets a copy of its own
    in_step = {getattr(st_, "node", None) and st_.node.name for st_ in plan.steps}
    assert not in_step & {"a_new_sum", "a_new", "update_4"}
    src = cc.compile(s, world=2).source
    assert "'a_new_sum': x_new.clone()" in src
    assert "DEFERRED = {'a_new_sum': ('a',)}" in src
    assert "a_new_sum = comm.wait(works['a_new_sum'])" in src.split("def land(")[1]
    assert "'a':" not in src.split("def step(")[1].split("def start_deferred")[0].split(
        "return")[-1].split("}, {")[1]


def test_a_fresh_operand_used_only_there_is_not_copied():
    x, a, _ = _state()
    s = Schedule(cc.Program("p", [x, a], [cc.update(a, cc.all_reduce(x * 2.0, name="c"))]))
    s.defer("c")
    (d,) = lower(s.program).deferred
    assert not d.snapshot and d.chain == ()


def test_the_json_record_replays_and_refuses_two_collectives():
    s = w.deferred()
    again = Schedule.from_json(w.sync_program(), s.to_json())
    assert again.program == s.program
    doc = json.loads(s.to_json())
    doc["steps"][0]["nodes"] = ["a_new_sum", "x_new"]
    with pytest.raises(ScheduleError, match="takes exactly one collective"):
        Schedule.from_json(w.sync_program(), json.dumps(doc))


def test_a_reader_in_the_same_step_is_refused_naming_both_lines():
    x, a, _ = _state()
    s = cc.Tensor("s", cc.float32, [N], cc.Sliced(0))
    c = cc.reduce_scatter(x, name="c")
    y = cc.all_gather(c, name="y")  # a collective of this step reads c before its wait
    p = cc.Program("p", [x, a, s], [cc.update(s, c), cc.update(a, y)])
    with pytest.raises(ScheduleError) as e:
        Schedule(p).defer("c")
    text = str(e.value)
    assert "y (" in text and "reads c (" in text and "before its wait" in text
    assert text.count(HERE) >= 2  # both lines, in this file
    # a computation that reads it is the landing's, and so must land: here it is an output
    c2 = cc.all_reduce(x, name="c2")
    y2 = (c2 * 2.0).named("y2")
    p2 = cc.Program("p", [x, a], {"y2": y2, "u": cc.update(a, c2)})
    with pytest.raises(ScheduleError) as e:
        Schedule(p2).defer("c2")
    assert "y2 (" in str(e.value) and "is an output of the step" in str(e.value)


def test_an_output_that_depends_on_it_is_refused():
    x, a, _ = _state()
    c = cc.all_reduce(x, name="c")
    p = cc.Program("p", [x, a], {"c": c, "u": cc.update(a, c + 1.0)})
    with pytest.raises(ScheduleError, match="is an output of the step"):
        Schedule(p).defer("c")


def test_a_landing_that_reads_an_input_is_refused_naming_both_lines():
    x, a, b = _state()
    c = cc.all_reduce(x, name="c")
    mixed = (c + b).named("mixed")  # b: the next call's landing would read b as it is then
    p = cc.Program("p", [x, a, b], [cc.update(a, mixed)])
    with pytest.raises(ScheduleError) as e:
        Schedule(p).defer("c")
    text = str(e.value)
    assert "mixed (" in text and "reads b (" in text and "with the deferred c (" in text


def test_two_collectives_landing_in_one_buffer_are_refused():
    """Overlapping averages that would share a buffer: each reads the other before its wait."""
    x, a, _ = _state()
    c1 = cc.all_reduce(x, name="c1")
    c2 = cc.all_reduce(x * 2.0, name="c2")
    p = cc.Program("p", [x, a], [cc.update(a, (c1 + c2).named("both"))])
    for c, other in (("c1", "c2"), ("c2", "c1")):
        with pytest.raises(ScheduleError) as e:
            Schedule(p).defer(c)
        assert f"reads {other} (" in str(e.value) and f"deferred {c} (" in str(e.value)


def test_refusals_of_what_is_not_a_deferrable_collective():
    s = w.deferred()
    with pytest.raises(ScheduleError, match="not a collective"):
        s.defer("x_new")
    with pytest.raises(ScheduleError, match="already deferred"):
        s.defer("a_new_sum")
    with pytest.raises(ScheduleError, match="is in defer"):
        s.fuse(["a_new_sum", "a_new"])
    with pytest.raises(ScheduleError, match="is in defer"):
        s.overlap(["x_new", "a_new_sum"], chunks=2)
    fused = Schedule(w.sync_program())
    fused.fuse(["a_new_sum", "a_new"])
    with pytest.raises(ScheduleError, match="already in fuse"):
        fused.defer("a_new_sum")


def test_split_then_defer_the_all_gather_and_defer_then_split():
    """The reduce_scatter stays in the step and the all_gather lands at the next call: the
    fully sharded parameters' gather moved across the step boundary. A split after defer
    keeps the group on the all_gather, which took the all_reduce's name."""
    s = Schedule(w.sync_program())
    _, ag = s.split("a_new_sum")
    s.defer(ag)
    (d,) = lower(s.program).deferred
    assert d.collective.op is Op.ALL_GATHER
    assert d.collective.name == "a_new_sum" and d.lands_in == ("a",)
    s2 = w.deferred()
    s2.split("a_new_sum")
    (d2,) = lower(s2.program).deferred
    assert d2.collective.name == "a_new_sum" and d2.collective.inputs[0].name == "a_new_sum_rs"


# -- the compiled step on a world of one, against the simulator --------------------------------


@pytest.fixture(scope="module")
def comm():
    c = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    yield c
    runtime.shutdown(c)


@settings(max_examples=8, deadline=None)
@given(calls=st.integers(1, 5), land_after=st.integers(0, 4), split=st.booleans())
def test_one_rank_follows_the_simulator_call_by_call(comm, calls, land_after, split):
    got = w.run(comm, calls, land_after, split)
    want = w.simulated(1, calls)
    for row, ref in zip(got["rows"], want, strict=True):
        assert np.array_equal(row["x"], ref["x"][0])
        for k in ("z", "v"):
            assert np.array_equal(row[k], ref[k])
        if row["a"] is not None:
            assert np.array_equal(row["a"], ref["a"])
    assert got["in_flight"] == [True] * calls  # each call leaves its average in flight
    assert got["rows"][-1]["a"] is not None


def test_wait_deferred_with_nothing_in_flight_does_nothing(comm):
    step = cc.compile(w.deferred(), comm=comm)
    assert not step.deferred_in_flight
    step.wait_deferred()
    state = {"x": torch.ones(4), "z": torch.zeros(4), "v": torch.zeros(4), "a": torch.zeros(4),
             "pull": 0.5, "momentum": 0.0}
    step(**state)
    assert step.deferred_in_flight and torch.equal(state["a"], torch.zeros(4))
    step.wait_deferred()
    assert not step.deferred_in_flight
    assert torch.equal(state["a"], torch.full((4,), 0.5))  # the pulled model, averaged (1 rank)
