"""Error messages: class, op, the values involved, the user's own file and line, and the hint.

Every bad op below is written on the line right after ``line = _next_line()``, so each test knows
the line its error must point at.
"""

from __future__ import annotations

import sys

import pytest
import torch

import coconet as cc
from coconet import (
    Dim,
    Local,
    Mesh,
    Program,
    ReduceOp,
    Replicated,
    Scalar,
    Sliced,
    Tensor,
    float16,
    float32,
    int32,
    simulate,
)
from coconet.errors import SourceLoc

N, M, B, H, K = Dim("N"), Dim("M"), Dim("B"), Dim("H"), Dim("K")


def _next_line() -> int:
    """The line after the caller's current line: where the bad op is written."""
    return sys._getframe(1).f_lineno + 1


def check(
    info: pytest.ExceptionInfo,
    cls: type,
    *,
    line: int,
    op: str | None,
    has: tuple[str, ...] = (),
    hint: str | None = None,
) -> str:
    """Assert the error's class, op, location, contents and hint; returns the message."""
    e = info.value
    assert type(e) is cls, f"{type(e).__name__}: {e}"
    assert isinstance(e, cc.CoconetError)
    msg = str(e)
    assert e.op == op
    if op is not None:
        assert msg.startswith(f"{op}: ")
    assert e.loc == SourceLoc(__file__, line), msg
    assert f"  at {__file__}:{line}\n" in msg
    for fragment in has:
        assert fragment in msg, f"{fragment!r} not in\n{msg}"
    if hint is None:
        assert e.hint is None
    else:
        assert f"  hint: {hint}" in msg, f"hint {hint!r} not in\n{msg}"
    return msg


# ---------------------------------------------------------------------------------------------
# layout errors


def test_replicated_plus_sliced_asks_for_scatter():
    x = Tensor("x", float32, [B, H], Sliced(0))
    w = Tensor("w", float32, [B, H], Replicated)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        _ = x + w
    msg = check(
        info,
        cc.LayoutError,
        line=line,
        op="add",
        has=(
            "cannot combine a Replicated operand (w: f32[B, H] Replicated) with a Sliced one "
            "(x: f32[B, H] Sliced(dim=0))",
            "operand 0: x: f32[B, H] Sliced(dim=0)",
            "operand 1: w: f32[B, H] Replicated",
        ),
        hint="wrap the Replicated operand in scatter(...) to take this rank's slice of it",
    )
    # the user's source line is quoted under the location
    assert "\n    _ = x + w\n" in msg


def test_all_reduce_of_replicated():
    p = Tensor("p", float32, [N], Replicated)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        cc.all_reduce(p)
    check(
        info,
        cc.LayoutError,
        line=line,
        op="all_reduce",
        has=(
            "all_reduce expects a Local input; this tensor is already Replicated",
            "operand 0: p: f32[N] Replicated",
        ),
        hint="drop the all_reduce: every rank already holds the same value",
    )


def test_local_times_sliced():
    g = Tensor("g", float32, [N], Local)
    s = Tensor("s", float32, [N], Sliced(0))
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        _ = g * s
    check(
        info,
        cc.LayoutError,
        line=line,
        op="mul",
        has=("cannot combine a Local operand (g: f32[N] Local)", "(s: f32[N] Sliced(dim=0))"),
        hint="reduce the Local operand first: reduce_scatter(...) gives a Sliced value, "
        "all_reduce(...) a Replicated one",
    )


def test_norm_over_the_sliced_dim():
    s = Tensor("s", float32, [N, M], Sliced(1))
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        cc.norm(s, dim=1)
    check(
        info,
        cc.LayoutError,
        line=line,
        op="norm",
        has=("norm over the sliced dim 1", "operand 0: s: f32[N, M] Sliced(dim=1)"),
        hint="write sqrt(all_reduce(sum(x * x))): partial sums of squares add up",
    )


def test_matmul_sliced_on_contraction_dim_alone():
    x = Tensor("x", float32, [B, K], Sliced(1))
    w = Tensor("w", float32, [K, N], Replicated)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        _ = x @ w
    check(
        info,
        cc.LayoutError,
        line=line,
        op="matmul",
        has=(
            "x is sliced on the contraction dim but w is not",
            "operand 0: x: f32[B, K] Sliced(dim=1)",
            "operand 1: w: f32[K, N] Replicated",
        ),
        hint="slice w on dim 0 as well (scatter(w, dim=0)) to get partial sums",
    )


def test_all_gather_of_local():
    g = Tensor("g", float32, [N], Local)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        cc.all_gather(g)
    check(
        info,
        cc.LayoutError,
        line=line,
        op="all_gather",
        has=("all_gather expects a Sliced input; this tensor is Local", "g: f32[N] Local"),
        hint="all_reduce(...) combines Local values",
    )


def test_scatter_of_local():
    g = Tensor("g", float16, [N, M], Local)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        cc.scatter(g, dim=1)
    check(
        info,
        cc.LayoutError,
        line=line,
        op="scatter",
        has=("scatter expects a Replicated input; this tensor is Local", "g: f16[N, M] Local"),
        hint="reduce_scatter(...) gives this rank's slice of the sum of Local values",
    )


def test_send_of_world_replicated():
    a = Tensor("a", float32, [B, H], Replicated)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        cc.send(a, axis="pp")
    check(
        info,
        cc.LayoutError,
        line=line,
        op="send",
        has=("send along 'pp' of a value that is Replicated", "a: f32[B, H] Replicated"),
        hint="send values that are Local, or Replicated over another mesh axis than 'pp'",
    )


def test_update_with_a_local_value():
    p = Tensor("p", float32, [N], Replicated)
    g = Tensor("g", float32, [N], Local)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        cc.update(p, p - g)
    check(
        info,
        cc.LayoutError,
        line=line,
        op="update",
        has=(
            "the new value of p is Local, the tensor is Replicated",
            "operand 0: p: f32[N] Replicated",
            "operand 1: sub: f32[N] Local",
        ),
        hint="all_reduce(...) or broadcast(...) the new value so every rank stores the same",
    )


def test_update_of_a_sliced_tensor_with_a_whole_value():
    s = Tensor("s", float32, [N], Sliced(0))
    p = Tensor("p", float32, [N], Replicated)
    with pytest.raises(cc.LayoutError) as info:
        line = _next_line()
        cc.update(s, p * 2.0)
    check(
        info,
        cc.LayoutError,
        line=line,
        op="update",
        has=("the new value of s is Replicated, the tensor is Sliced(dim=0)",),
        hint="scatter(...) the new value to keep this rank's slice of it",
    )


# ---------------------------------------------------------------------------------------------
# shape errors


def test_shapes_that_do_not_broadcast():
    a = Tensor("a", float32, [N, M], Replicated)
    b = Tensor("b", float32, [M, N], Replicated)
    with pytest.raises(cc.ShapeError) as info:
        line = _next_line()
        _ = a - b
    check(
        info,
        cc.ShapeError,
        line=line,
        op="sub",
        has=("shapes do not broadcast: [N, M] vs [M, N] (dim 0 of the result: N vs M)",),
        hint="sizes must be equal (the same Dim or the same int) or 1",
    )


def test_sliced_operand_broadcast_along_its_slice():
    row = Tensor("row", float32, [1, H], Sliced(0))
    x = Tensor("x", float32, [B, H], Replicated)
    with pytest.raises(cc.ShapeError) as info:
        line = _next_line()
        _ = row + x
    check(
        info,
        cc.ShapeError,
        line=line,
        op="add",
        has=(
            "the Sliced operand row: f32[1, H] Sliced(dim=0) is broadcast along its sliced dim 0",
        ),
        hint="slice a dim that the result keeps at full size",
    )


def test_matmul_inner_sizes():
    x = Tensor("x", float32, [B, K], Replicated)
    w = Tensor("w", float32, [N, M], Replicated)
    with pytest.raises(cc.ShapeError) as info:
        line = _next_line()
        cc.matmul(x, w)
    check(
        info,
        cc.ShapeError,
        line=line,
        op="matmul",
        has=("inner sizes differ: [B, K] @ [N, M] (K vs N)",),
    )


def test_reduce_scatter_of_a_scalar():
    loss = Tensor("loss", float32, [], Local)
    with pytest.raises(cc.ShapeError) as info:
        line = _next_line()
        cc.reduce_scatter(loss)
    check(
        info,
        cc.ShapeError,
        line=line,
        op="reduce_scatter",
        has=("cannot reduce_scatter a scalar", "loss: f32[] Local"),
        hint="use all_reduce",
    )


def test_update_with_the_wrong_shape():
    p = Tensor("p", float32, [N], Replicated)
    q = Tensor("q", float32, [N, M], Replicated)
    with pytest.raises(cc.ShapeError) as info:
        line = _next_line()
        cc.update(p, q)
    check(
        info,
        cc.ShapeError,
        line=line,
        op="update",
        has=("the new value of p has shape [N, M], the tensor [N]",),
        hint="the new value must have the tensor's shape, or broadcast to it",
    )


# ---------------------------------------------------------------------------------------------
# dtype errors


def test_mixed_float_dtypes():
    h = Tensor("h", float16, [N], Replicated)
    f = Tensor("f", float32, [N], Replicated)
    with pytest.raises(cc.DTypeError) as info:
        line = _next_line()
        _ = h * f
    check(
        info,
        cc.DTypeError,
        line=line,
        op="mul",
        has=("operands have different element types: float16, float32", "h: f16[N]", "f: f32[N]"),
        hint="cast(...) one operand so both have the same dtype",
    )


def test_sqrt_of_an_int_tensor():
    i = Tensor("i", int32, [N], Local)
    with pytest.raises(cc.DTypeError) as info:
        line = _next_line()
        cc.sqrt(i)
    check(
        info,
        cc.DTypeError,
        line=line,
        op="sqrt",
        has=("sqrt needs a floating-point operand, got int32", "i: i32[N] Local"),
        hint="cast(x, float32) first",
    )


def test_float_constant_with_an_int_tensor():
    i = Tensor("i", int32, [N], Replicated)
    with pytest.raises(cc.DTypeError) as info:
        line = _next_line()
        _ = i + 0.5
    check(
        info,
        cc.DTypeError,
        line=line,
        op="add",
        has=("the constant 0.5 is a float but the tensor is int32",),
        hint="cast(...) the tensor to a float dtype",
    )


def test_dropout_with_a_float_seed():
    x = Tensor("x", float32, [N], Sliced(0))
    seed = Scalar("seed")
    with pytest.raises(cc.DTypeError) as info:
        line = _next_line()
        cc.dropout(x, 0.1, seed=seed)
    check(
        info,
        cc.DTypeError,
        line=line,
        op="dropout",
        has=("dropout's seed must be an integer scalar, got seed: f32[] Replicated",),
        hint="declare it with Scalar(name, int64) or pass a Python int",
    )


def test_where_with_a_float_condition():
    c = Tensor("c", float32, [N], Replicated)
    with pytest.raises(cc.DTypeError) as info:
        line = _next_line()
        cc.where(c, 1.0, 0.0)
    check(
        info,
        cc.DTypeError,
        line=line,
        op="where",
        has=("where's condition must be bool, got float32", "operand 0: c: f32[N] Replicated"),
        hint="build it with a comparison such as gt(x, 0)",
    )


def test_update_with_the_wrong_dtype():
    p = Tensor("p", float32, [N], Replicated)
    h = Tensor("h", float16, [N], Replicated)
    with pytest.raises(cc.DTypeError) as info:
        line = _next_line()
        cc.update(p, h)
    check(
        info,
        cc.DTypeError,
        line=line,
        op="update",
        has=("the new value of p is float16, the tensor is float32",),
        hint="cast(value, float32)",
    )


# ---------------------------------------------------------------------------------------------
# DSL misuse


def test_reduce_op_given_as_a_string():
    g = Tensor("g", float32, [N], Local)
    with pytest.raises(cc.DSLError) as info:
        line = _next_line()
        cc.all_reduce(g, op="sum")
    check(
        info,
        cc.DSLError,
        line=line,
        op="all_reduce",
        has=("op= must be a ReduceOp, got 'sum'",),
        hint="ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD or ReduceOp.MEAN",
    )


def test_truth_value_of_a_tensor():
    x = Tensor("x", float32, [N], Replicated)
    with pytest.raises(cc.DSLError) as info:
        line = _next_line()
        _ = 1.0 if x > 0 else 0.0
    check(
        info,
        cc.DSLError,
        line=line,
        op=None,
        has=("a coconet Tensor has no truth value while the program is being built",),
        hint="use where(cond, a, b) for a data-dependent choice",
    )


def test_sliced_dim_beyond_the_rank():
    with pytest.raises(cc.DSLError) as info:
        line = _next_line()
        Tensor("x", float32, [N, M], Sliced(2))
    check(
        info,
        cc.DSLError,
        line=line,
        op="Tensor",
        has=("x: Sliced(dim=2) but the tensor has rank 2",),
        hint="slice one of the tensor's dims",
    )


# ---------------------------------------------------------------------------------------------
# program-level errors


def test_input_used_but_not_listed():
    p = Tensor("p", float32, [N], Replicated)
    line = _next_line()
    q = Tensor("q", float32, [N], Replicated)
    with pytest.raises(cc.DSLError) as info:
        Program("step", [p], [p + q])
    # the error points at the declaration of the missing input
    check(
        info,
        cc.DSLError,
        line=line,
        op=None,
        has=("program step: tensor 'q' is used but not among the inputs",),
        hint="add q to Program('step', inputs=[...])",
    )


def test_tensor_updated_twice():
    p = Tensor("p", float32, [N], Replicated)
    first = cc.update(p, p * 0.5)
    line = _next_line()
    second = cc.update(p, p + 1.0)
    with pytest.raises(cc.DSLError) as info:
        Program("step", [p], [first, second])
    check(
        info,
        cc.DSLError,
        line=line,
        op=None,
        has=("program step: p is updated twice",),
        hint="a tensor gets one new value per step; combine the expressions",
    )


def test_two_values_with_one_name():
    p = Tensor("p", float32, [N], Replicated)
    first_line = _next_line()
    a = (p + 1.0).named("v")
    line = _next_line()
    b = (p * 2.0).named("v")
    with pytest.raises(cc.DSLError) as info:
        Program("step", [p], [a, b])
    check(
        info,
        cc.DSLError,
        line=line,
        op=None,
        has=(
            "two different values are named 'v'",
            f"first: v: f32[N] Replicated at {__file__}:{first_line}",
            f"second: v: f32[N] Replicated at {__file__}:{line}",
        ),
        hint="give each value its own name",
    )


def test_program_without_outputs():
    p = Tensor("p", float32, [N], Replicated)
    with pytest.raises(cc.DSLError) as info:
        line = _next_line()
        Program("noop", [p], [])
    check(
        info,
        cc.DSLError,
        line=line,
        op=None,
        has=("program noop has no outputs and no updates: it does nothing",),
    )


def test_program_input_that_is_computed():
    p = Tensor("p", float32, [N], Replicated)
    line = _next_line()
    twice = p * 2.0
    with pytest.raises(cc.DSLError) as info:
        Program("step", [p, twice], [twice + 1.0])
    check(
        info,
        cc.DSLError,
        line=line,
        op=None,
        has=("inputs must be tensors declared with Tensor(...) or Scalar(...)", "mul: f32[N]"),
    )


def test_broadcast_root_outside_the_group():
    x = Tensor("x", float32, [N], Local)
    line = _next_line()
    y = cc.broadcast(x, root=2, axis="tp")
    prog = Program("bcast", [x], [y])
    with pytest.raises(cc.SimulationError) as info:
        simulate(prog, {"x": torch.ones(3)}, Mesh(pp=2, tp=2))
    check(
        info,
        cc.SimulationError,
        line=line,
        op="broadcast",
        has=("root=2 but the group along axis 'tp' has 2 ranks",),
    )


# ---------------------------------------------------------------------------------------------
# simulator input errors: they point at the simulate(...) call


def _prog() -> Program:
    g = Tensor("g", float32, [N], Local)
    w = Tensor("w", float32, [N], Replicated)
    s = Tensor("s", float32, [N, 3], Sliced(0))
    return Program("p", [g, w, s], {"out": cc.all_reduce(g) * w, "s2": s * 2.0})


def _inputs(**over):
    base = {"g": torch.ones(4), "w": torch.ones(4), "s": torch.ones(4, 3)}
    base.update(over)
    return base


@pytest.mark.parametrize(
    ("inputs", "world", "has", "hint"),
    [
        pytest.param(
            {"g": torch.ones(4), "w": torch.ones(4)},
            2,
            ("input 's' (f32[N, 3] Sliced(dim=0)) is missing",),
            "pass s=... to simulate()",
            id="missing input",
        ),
        pytest.param(
            _inputs(extra=torch.ones(1)),
            2,
            ("program p has no inputs named ['extra']",),
            "its inputs are ['g', 's', 'w']",
            id="unknown input",
        ),
        pytest.param(
            _inputs(w=torch.ones(4, dtype=torch.float64)),
            2,
            ("input 'w' is torch.float64, the program declares float32",),
            "pass w.to(torch.float32)",
            id="wrong dtype",
        ),
        pytest.param(
            _inputs(w=torch.ones(4, 2)),
            2,
            ("input 'w' is declared with shape [N], got [4, 2]",),
            None,
            id="wrong rank",
        ),
        pytest.param(
            _inputs(s=torch.ones(4, 5)),
            2,
            ("input 's' is declared with shape [N, 3], got [4, 5]",),
            None,
            id="wrong fixed size",
        ),
        pytest.param(
            _inputs(w=torch.ones(5)),
            2,
            ("input 'w': size N is 5 here but 4 in input 'g'",),
            "every tensor sized with Dim('N') must have the same size",
            id="inconsistent Dim",
        ),
        pytest.param(
            _inputs(g=[torch.ones(4), torch.ones(6)]),
            2,
            ("input 'g' (rank 1): size N is 6 here but 4 in input 'g' (rank 0)",),
            "every tensor sized with Dim('N') must have the same size",
            id="inconsistent Dim between ranks",
        ),
        pytest.param(
            _inputs(g=[torch.ones(4)] * 3),
            2,
            ("input 'g': got 3 per-rank values for 2 ranks",),
            "pass a list of 2 tensors (one per rank), or one tensor",
            id="per-rank list length",
        ),
        pytest.param(
            _inputs(w=[torch.ones(4), torch.zeros(4)]),
            2,
            ("input 'w' is Replicated but ranks 0 and 1 hold different values",),
            "declare it Local, or pass one tensor for every rank",
            id="replicated ranks differ",
        ),
        pytest.param(
            _inputs(s=[torch.ones(1, 3), torch.ones(3, 3)]),
            2,
            (
                "input 's' (f32[N, 3] Sliced(dim=0)): rank 0 holds shape [1, 3], its slice of the "
                "global shape [4, 3] is [2, 3]",
            ),
            "pass the global tensor instead and let the simulator slice it",
            id="uneven per-rank slices",
        ),
        pytest.param(
            _inputs(w=[1.0, 1.0]),
            2,
            ("input 'w' (f32[N] Replicated) needs a tensor, got the number 1.0",),
            None,
            id="number for a tensor",
        ),
        pytest.param(
            _inputs(w="ones"),
            2,
            ("input 'w': expected a torch.Tensor, got str",),
            None,
            id="not a tensor",
        ),
        pytest.param(
            _inputs(), 0, ("world must be a positive int or a Mesh, got 0",), None, id="world"
        ),
    ],
)
def test_simulator_input_errors(inputs, world, has, hint):
    prog = _prog()
    with pytest.raises(cc.SimulationError) as info:
        line = _next_line()
        simulate(prog, inputs, world)
    check(info, cc.SimulationError, line=line, op=None, has=has, hint=hint)


def test_a_scalar_input_says_it_takes_a_number(tmp_path):
    """A scalar passed as None: the message says a Python number would do (issue 12)."""
    from types import SimpleNamespace

    x = Tensor("x", float32, [N], Replicated)
    lr = cc.Scalar("lr")
    prog = Program("p", [x, lr], {"y": x * lr})
    with pytest.raises(cc.SimulationError) as info:
        simulate(prog, {"x": torch.ones(3), "lr": None}, 1)
    assert "input 'lr': expected a torch.Tensor or a Python number, got NoneType" in str(info.value)
    step = cc.compile(prog, world=1, fused_kernels=False, cache_dir=tmp_path)
    _, problem = step._tensor(prog.input("lr"), None, SimpleNamespace(device=torch.device("cpu")))
    assert problem == "input 'lr': expected a torch.Tensor or a Python number, got NoneType"
    _, problem = step._tensor(prog.input("x"), None, SimpleNamespace(device=torch.device("cpu")))
    assert problem == "input 'x': expected a torch.Tensor, got NoneType"


def test_simulator_mesh_axis_missing():
    x = Tensor("x", float32, [N], Local)
    prog = Program("tp_sum", [x], [cc.all_reduce(x, ReduceOp.SUM, axis="tp")])
    with pytest.raises(cc.SimulationError) as info:
        line = _next_line()
        simulate(prog, {"x": torch.ones(2)}, Mesh(dp=2))
    check(
        info,
        cc.SimulationError,
        line=line,
        op=None,
        has=("program tp_sum uses mesh axes ['tp'] that Mesh(dp=2) does not have",),
        hint="pass world=Mesh(tp=...)",
    )


def test_errors_are_not_asserts():
    """Every user-facing error is a CoconetError subclass with the documented hierarchy."""
    assert issubclass(cc.LayoutError, cc.DSLError)
    assert issubclass(cc.ShapeError, cc.DSLError)
    assert issubclass(cc.DTypeError, cc.DSLError)
    assert issubclass(cc.DSLError, cc.CoconetError)
    assert issubclass(cc.SimulationError, cc.CoconetError)
    assert not issubclass(cc.SimulationError, cc.DSLError)
    assert not issubclass(cc.CoconetError, AssertionError)
