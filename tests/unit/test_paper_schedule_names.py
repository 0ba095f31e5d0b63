"""The paper's schedules work whatever the program's values are called.

They find the all_reduce to schedule (the program's only one when ``all_reduce=None``) and then
use only the names the primitives return, never names rebuilt by convention (``g_sum_rs``).
"""

from __future__ import annotations

import pytest
import torch

import coconet as cc
from coconet.ir.group import GroupKind
from coconet.ir.ops import Op
from coconet.schedule import (
    AR_C,
    MM_AR_C,
    MM_RS_C_AG,
    RS_C_AG,
    fuse_RS_C_AG,
    ol_MM_fuse_RS_C_AG,
)

N = cc.Dim("N")
B, H, H2 = cc.Dim("B"), cc.Dim("H"), cc.Dim("H2")


def sgd(all_reduce: str = "grads", extra: str | None = None) -> cc.Program:
    """Momentum SGD with its all_reduce called ``all_reduce``; ``extra`` names a value that
    scales the gradient (``g_sum_rs`` below: the name split would pick by convention)."""
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    buf = cc.Tensor("buf", cc.float32, [N], cc.Replicated)
    lr = cc.Scalar("lr")
    grad = cc.all_reduce(g, name=all_reduce)
    if extra is not None:
        grad = (grad * 0.5).named(extra)
    buf_new = (0.9 * buf + grad).named("buf_new")
    p_new = (p - lr * buf_new).named("p_new")
    return cc.Program("sgd", [g, p, buf, lr], [cc.update(p, p_new), cc.update(buf, buf_new)])


def layer(all_reduce: str = "y_sum") -> cc.Program:
    x = cc.Tensor("x", cc.float32, [B, H], cc.Sliced(1))
    w = cc.Tensor("w", cc.float32, [H, H2], cc.Sliced(0))
    b = cc.Tensor("b", cc.float32, [H2], cc.Replicated)
    total = cc.all_reduce(cc.matmul(x, w).named("partial"), name=all_reduce)
    return cc.Program("layer", [x, w, b], {"y": (total + b).named("y")})


def two_all_reduces() -> cc.Program:
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    h = cc.Tensor("h", cc.float32, [N], cc.Local)
    a, b = cc.all_reduce(g, name="a"), cc.all_reduce(h, name="b")
    return cc.Program("two", [g, h], {"c": (a + 1.0).named("c"), "d": (b * 2.0).named("d")})


def assert_sgd_equal(a: cc.Program, b: cc.Program) -> None:
    for world in (2, 3):
        gen = torch.Generator().manual_seed(world)
        inputs = {
            "g": [torch.randn(7, generator=gen) for _ in range(world)],
            "p": torch.randn(7, generator=gen),
            "buf": torch.randn(7, generator=gen),
            "lr": 0.1,
        }
        want, got = cc.simulate(a, inputs, world), cc.simulate(b, inputs, world)
        for name in want.updates:
            assert torch.equal(want.updated(name), got.updated(name)), name


OPTIMIZER = {
    "AR_C": AR_C,
    "RS_C_AG": lambda prog, **kw: RS_C_AG(prog, ("buf",), **kw),
    "fuse_RS_C_AG": lambda prog, **kw: fuse_RS_C_AG(prog, ("buf",), **kw),
}
LAYER = {"MM_AR_C": MM_AR_C, "MM_RS_C_AG": MM_RS_C_AG, "ol_MM_fuse_RS_C_AG": ol_MM_fuse_RS_C_AG}


@pytest.mark.parametrize("name", sorted(OPTIMIZER))
def test_a_program_that_already_has_a_value_named_like_the_reduce_scatter(name):
    prog = sgd("g_sum", extra="g_sum_rs")
    s = OPTIMIZER[name](prog)
    assert_sgd_equal(prog, s.program)
    if name != "AR_C":
        # The reduce_scatter got a fresh name; the schedule used the one split returned.
        assert s.program.node("g_sum_rs_2").op is Op.REDUCE_SCATTER
    if name == "fuse_RS_C_AG":
        (group,) = [g for g in s.program.groups if g.kind is GroupKind.FUSE]
        assert {"g_sum_rs_2", "g_sum_rs_slice", "p_new"} <= set(group.members)


@pytest.mark.parametrize("name", sorted(OPTIMIZER))
def test_optimizer_schedules_find_the_only_all_reduce(name):
    prog = sgd("grads")
    s = OPTIMIZER[name](prog)
    assert s.to_json() == OPTIMIZER[name](prog, all_reduce="grads").to_json()
    assert_sgd_equal(prog, s.program)


@pytest.mark.parametrize("name", sorted(LAYER))
def test_layer_schedules_find_the_only_all_reduce(name):
    prog = layer("y_sum")
    s = LAYER[name](prog)
    assert s.to_json() == LAYER[name](prog, all_reduce="y_sum").to_json()
    inputs = {"x": torch.randn(6, 4), "w": torch.randn(4, 5), "b": torch.randn(5)}
    want = cc.simulate(prog, inputs, 2).output("y")
    got = cc.simulate(s.program, inputs, 2).output("y")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make", [AR_C, RS_C_AG, fuse_RS_C_AG, MM_AR_C, MM_RS_C_AG, ol_MM_fuse_RS_C_AG]
)
def test_several_all_reduces_need_the_parameter(make):
    with pytest.raises(cc.ScheduleError) as info:
        make(two_all_reduces())
    msg = str(info.value)
    assert f"{make.__name__}: program two has 2 all_reduces (a, b)" in msg
    assert (
        f"name it with the all_reduce= parameter, e.g. {make.__name__}(program, all_reduce='a')"
        in msg
    )


@pytest.mark.parametrize("make", [AR_C, RS_C_AG, fuse_RS_C_AG, MM_AR_C, MM_RS_C_AG])
def test_the_named_all_reduce_is_scheduled(make):
    s = make(two_all_reduces(), all_reduce="b")
    touched = {n for step in s.steps for n in step.nodes}
    assert touched & {"b", "b_rs", "d", "d_slice"} and not touched & {"a", "a_rs", "c"}


def test_a_wrong_all_reduce_name_lists_the_candidates():
    with pytest.raises(cc.ScheduleError) as info:
        RS_C_AG(sgd("grads"), ("buf",), all_reduce="g_sum")
    msg = str(info.value)
    assert "RS_C_AG: all_reduce='g_sum': program sgd has no value named 'g_sum'" in msg
    assert "the all_reduces of sgd: grads" in msg
    with pytest.raises(cc.ScheduleError, match="buf_new is an add, not an all_reduce"):
        AR_C(sgd("grads"), all_reduce="buf_new")


def test_a_program_without_an_all_reduce():
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    prog = cc.Program("local", [p], {"q": (p * 2.0).named("q")})
    with pytest.raises(cc.ScheduleError, match="program local has no all_reduce of a tensor"):
        MM_AR_C(prog)
