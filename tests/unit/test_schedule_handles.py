"""Handles: the values a primitive returns stay valid through the later primitives.

``rs, ag = s.split("g_sum")`` returns handles. ``reorder`` then removes the all_gather ``g_sum``
and gathers the reordered results instead (``p_new = all_gather(p_new_slice)``): ``ag`` follows
it, so a schedule written only with returned handles (the README's recipe) works whatever the
values are called. A plain string is only ever a name in the current program.
"""

from __future__ import annotations

import json

import pytest
import torch

import coconet as cc
from coconet.ir.group import GroupKind
from coconet.ir.ops import Op
from coconet.schedule import Handle, Schedule

N = cc.Dim("N")


def momentum() -> cc.Program:
    """The README's program."""
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    m = cc.Tensor("m", cc.float32, [N], cc.Replicated)
    lr, beta = cc.Scalar("lr"), cc.Scalar("beta")
    g_sum = cc.all_reduce(g, name="g_sum")
    m_new = (beta * m + g_sum).named("m_new")
    p_new = (p - lr * m_new).named("p_new")
    return cc.Program("momentum", [g, p, m, lr, beta], [cc.update(p, p_new), cc.update(m, m_new)])


def same_results(a: cc.Program, b: cc.Program, world: int = 2, n: int = 7) -> None:
    gen = torch.Generator().manual_seed(n)
    inputs = {
        "g": [torch.randn(n, generator=gen) for _ in range(world)],
        "p": torch.randn(n, generator=gen),
        "m": torch.randn(n, generator=gen),
        "lr": 0.1,
        "beta": 0.9,
    }
    want, got = cc.simulate(a, inputs, world), cc.simulate(b, inputs, world)
    for name in want.updates:
        assert torch.equal(want.updated(name), got.updated(name)), name


def test_split_returns_handles_that_are_the_names():
    s = Schedule(momentum())
    rs, ag = s.split("g_sum")
    assert (rs, ag) == ("g_sum_rs", "g_sum")
    assert isinstance(rs, Handle) and isinstance(ag, Handle)
    assert s.steps[-1].nodes == ("g_sum",) and type(s.steps[-1].nodes[0]) is str


def test_the_readme_recipe_with_returned_handles_only():
    s = Schedule(momentum())
    rs, ag = s.split("g_sum")
    s.reorder(s.computations(ag), ag)
    s.as_slice(["m"])
    s.fuse([rs, *s.computations(rs), ag])  # ag: the all_gather that now gathers p_new
    assert str(s.steps[-1]) == (
        "fuse([g_sum_rs, mul_1_slice, m_new_slice, mul_2_slice, p_new_slice, p_new])"
    )
    (group,) = s.program.groups
    assert group.kind is GroupKind.FUSE and "p_new" in group.members
    assert s.program.node("p_new").op is Op.ALL_GATHER
    same_results(momentum(), s.program)
    # The JSON names the values, not the handles: it replays onto a fresh program.
    again = Schedule.from_json(momentum(), s.to_json())
    assert again.program == s.program and again.digest == s.digest
    assert json.loads(s.to_json())["steps"][-1]["nodes"][-1] == "p_new"


def test_after_reorder_the_all_gather_handle_stands_for_every_gather_it_became():
    s = Schedule(momentum())
    rs, ag = s.split("g_sum")
    s.reorder(s.computations(ag), ag)
    assert "g_sum" not in {n.name for n in s.program.nodes}
    # Two values are still needed whole: the all_gather became two.
    s.fuse([rs, *s.computations(rs), ag])
    assert s.steps[-1].nodes[-2:] == ("p_new", "m_new")
    same_results(momentum(), s.program)


def test_a_handle_for_several_values_is_refused_where_one_is_needed():
    s = Schedule(momentum())
    _, ag = s.split("g_sum")
    s.reorder(s.computations(ag), ag)
    with pytest.raises(cc.ScheduleError) as info:
        s.computations(ag)
    msg = str(info.value)
    assert "g_sum now stands for 2 values (p_new, m_new)" in msg
    assert "step 2, reorder(computations(g_sum), g_sum), replaced it" in msg
    assert "pass one of them, e.g. 'p_new'" in msg


def test_a_handle_whose_value_is_gone():
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    z = cc.Tensor("z", cc.float32, [N], cc.Replicated)
    prog = cc.Program("copy", [g, z], [cc.update(z, cc.all_reduce(g, name="g_sum"))])
    s = Schedule(prog)
    rs, ag = s.split("g_sum")
    s.as_slice(["z"])  # z keeps its slice: nothing gathers g_sum any more
    with pytest.raises(cc.ScheduleError, match=r"g_sum is gone: step 2, as_slice\(\[z\]\), "):
        s.downstream(ag)
    # In a list it stands for no value: the group is the reduce_scatter alone.
    s.fuse([rs, ag])
    assert s.program.groups[0].members == ("g_sum_rs",)


def test_a_plain_string_is_a_name_in_the_current_program():
    s = Schedule(momentum())
    _, ag = s.split("g_sum")
    s.reorder(s.computations(ag), ag)
    with pytest.raises(cc.ScheduleError, match="has no value named 'g_sum'"):
        s.computations("g_sum")


def test_a_refused_primitive_leaves_the_handles_as_they_were():
    s = Schedule(momentum())
    rs, ag = s.split("g_sum")
    with pytest.raises(cc.ScheduleError):
        s.reorder(["p_new", "g_sum_rs"], ag)  # a reduce_scatter cannot run on slices
    assert s.computations(ag) == ["mul_1", "m_new", "mul_2", "p_new"]  # still g_sum
    s.reorder(s.computations(ag), ag)
    assert len(s.steps) == 2
