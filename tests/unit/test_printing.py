"""Golden tests of printed programs, structural equality and digests, and node lookup."""

from __future__ import annotations

import textwrap

import pytest

import coconet as cc
from coconet import (
    Dim,
    Local,
    Program,
    ReduceOp,
    Replicated,
    Scalar,
    Sliced,
    Tensor,
    bfloat16,
    float32,
    int64,
)

N, B, H = Dim("N"), Dim("B"), Dim("H")


def sgd(lr_const: float | None = None, w_layout=Replicated) -> Program:
    g = Tensor("g", float32, [N], Local)
    w = Tensor("w", float32, [N], w_layout)
    if lr_const is None:
        lr = Scalar("lr")
        return Program("sgd", [g, w, lr], [cc.update(w, w - lr * cc.all_reduce(g))])
    return Program("sgd", [g, w], [cc.update(w, w - lr_const * cc.all_reduce(g))])


SGD = """\
program sgd(g: f32[N] Local, w: f32[N] Replicated, lr: f32[] Replicated):
  all_reduce_1 = all_reduce(g, reduce_op=sum)  # f32[N] Replicated
  mul_1 = mul(lr, all_reduce_1)                # f32[N] Replicated
  sub_1 = sub(w, mul_1)                        # f32[N] Replicated
  update(w, sub_1)                             # f32[N] Replicated"""


def sharded_sgd() -> Program:
    g = Tensor("g", float32, [N, H], Local)
    w = Tensor("w", float32, [N, H], Sliced(0))
    lr = Scalar("lr")
    gs = cc.reduce_scatter(g, dim=0, name="g_rs")
    w1 = (w - lr * gs).named("w1")
    return Program("zero", [g, w, lr], {"w_full": cc.all_gather(w1), "u": cc.update(w, w1)})


SHARDED_SGD = """\
program zero(g: f32[N, H] Local, w: f32[N, H] Sliced(dim=0), lr: f32[] Replicated):
  g_rs = reduce_scatter(g, dim=0, reduce_op=sum)  # f32[N, H] Sliced(dim=0)
  mul_1 = mul(lr, g_rs)                           # f32[N, H] Sliced(dim=0)
  w1 = sub(w, mul_1)                              # f32[N, H] Sliced(dim=0)
  w_full = all_gather(w1)                         # f32[N, H] Replicated
  update(w, w1)                                   # f32[N, H] Sliced(dim=0)
  return w_full"""


def pipeline_stage() -> Program:
    x = Tensor("x", bfloat16, [B, H], Local)
    w = Tensor("w", bfloat16, [H, H], Sliced(1, axis="tp"))
    h = cc.relu(x @ cc.all_gather(w, axis="tp"))
    y = cc.send(h, axis="pp", name="to_next")
    return Program("stage", [x, w], [cc.all_reduce(y, ReduceOp.MAX, axis="tp")])


PIPELINE_STAGE = """\
program stage(x: bf16[B, H] Local, w: bf16[H, H] Sliced(dim=1, axis=tp)):
  all_gather_1 = all_gather(w, axis=tp)                       # bf16[H, H] Replicated(axis=tp)
  matmul_1 = matmul(x, all_gather_1)                          # bf16[B, H] Local
  relu_1 = relu(matmul_1)                                     # bf16[B, H] Local
  to_next = send(relu_1, axis=pp)                             # bf16[B, H] Local
  all_reduce_1 = all_reduce(to_next, axis=tp, reduce_op=max)  # bf16[B, H] Replicated(axis=tp)
  return all_reduce_1"""


def mlp(scale: float = 0.5) -> Program:
    x = Tensor("x", float32, [B, H], Sliced(0))
    bias = Tensor("bias", float32, [H], Replicated)
    step = Scalar("step", int64)
    y = (cc.gelu(x + bias) * scale).named("act")
    d = cc.dropout(y, 0.1, seed=7, step=step)
    return Program("mlp", [x, bias, step], [cc.where(d > 0.0, d, 1e-3), d.sum(1, keepdim=True)])


MLP = """\
program mlp(x: f32[B, H] Sliced(dim=0), bias: f32[H] Replicated, step: i64[] Replicated):
  add_1 = add(x, bias)                         # f32[B, H] Sliced(dim=0)
  gelu_1 = gelu(add_1)                         # f32[B, H] Sliced(dim=0)
  act = mul(gelu_1, 0.5)                       # f32[B, H] Sliced(dim=0)
  dropout_1 = dropout(act, 7, step, p=0.1)     # f32[B, H] Sliced(dim=0)
  gt_1 = gt(dropout_1, 0.0)                    # bool[B, H] Sliced(dim=0)
  where_1 = where(gt_1, dropout_1, 0.001)      # f32[B, H] Sliced(dim=0)
  sum_1 = sum(dropout_1, dim=1, keepdim=True)  # f32[B, 1] Sliced(dim=0)
  return where_1, sum_1"""


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        pytest.param(sgd, SGD, id="sgd"),
        pytest.param(sharded_sgd, SHARDED_SGD, id="reduce_scatter+all_gather"),
        pytest.param(pipeline_stage, PIPELINE_STAGE, id="2-d mesh with send"),
        pytest.param(mlp, MLP, id="const and named values"),
    ],
)
def test_golden(build, expected):
    prog = build()
    assert str(prog) == expected
    assert repr(prog) == expected


def test_auto_names_skip_user_names():
    """An automatic name never takes a name the user chose."""
    x = Tensor("x", float32, [N], Replicated)
    a = (x + 1.0).named("add_1")
    b = a + 2.0
    prog = Program("names", [x], [b])
    assert str(prog) == textwrap.dedent(
        """\
        program names(x: f32[N] Replicated):
          add_1 = add(x, 1.0)      # f32[N] Replicated
          add_2 = add(add_1, 2.0)  # f32[N] Replicated
          return add_2"""
    )


def test_dict_outputs_name_the_returned_values():
    x = Tensor("x", float32, [N], Local)
    prog = Program(
        "named_out", [x], {"total": cc.all_reduce(x), "peak": cc.all_reduce(x, ReduceOp.MAX)}
    )
    assert [n.name for n in prog.outputs] == ["total", "peak"]
    assert str(prog).splitlines()[-1] == "  return total, peak"


# ---------------------------------------------------------------------------------------------
# structural equality and digests


@pytest.mark.parametrize("build", [sgd, sharded_sgd, pipeline_stage, mlp])
def test_built_twice_is_equal(build):
    a, b = build(), build()
    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert a.digest() == b.digest()
    assert len(a.digest()) == 16
    int(a.digest(), 16)  # hex


def test_a_different_constant_differs():
    assert sgd(0.1) == sgd(0.1)
    assert sgd(0.1) != sgd(0.2)
    assert sgd(0.1).digest() != sgd(0.2).digest()
    assert mlp(0.5) != mlp(0.25)
    assert mlp(0.5).digest() != mlp(0.25).digest()


def test_a_different_layout_differs():
    a = sgd(0.1)
    b = sgd(0.1, w_layout=Replicated("dp"))
    assert a != b
    assert a.digest() != b.digest()


def test_different_programs_differ():
    digests = {f().digest() for f in (sgd, sharded_sgd, pipeline_stage, mlp)}
    assert len(digests) == 4
    assert sgd() != "not a program"


# ---------------------------------------------------------------------------------------------
# lookup


def test_node_lookup_by_name_and_by_handle():
    g = Tensor("g", float32, [N], Local)
    w = Tensor("w", float32, [N], Replicated)
    total = cc.all_reduce(g)
    m = (total * 2.0).named("m")
    new_w = w - m
    prog = Program("look", [g, w], [m, cc.update(w, new_w)])

    # by name, including automatic names
    assert prog.node("m").op is cc.ir.Op.MUL
    assert prog.node("all_reduce_1").op is cc.ir.Op.ALL_REDUCE
    assert prog.node("g") is prog.inputs[0]
    # by the DSL handle that built the value
    assert prog.node(total) is prog.node("all_reduce_1")
    assert prog.node(m) is prog.node("m")
    assert prog.node(new_w) is prog.node("sub_1")
    assert prog.node(g) is prog.input("g")
    assert prog.node(w).type == w.type
    # by one of the program's own nodes
    for n in prog.nodes:
        assert prog.node(n) is n
    # the program's nodes are wired to each other, not to the DSL's nodes
    assert prog.node("m").inputs[0] is prog.node("all_reduce_1")
    assert prog.node("all_reduce_1").inputs[0] is prog.node("g")
    # users
    assert [n.name for n in prog.users()["all_reduce_1"]] == ["m"]


def test_node_lookup_misses():
    g = Tensor("g", float32, [N], Local)
    prog = Program("look", [g], [cc.all_reduce(g)])
    with pytest.raises(KeyError, match="program look has no value named 'nope'"):
        prog.node("nope")
    with pytest.raises(KeyError, match="is not a value of program look"):
        prog.node(g * 2.0)
    with pytest.raises(KeyError, match="is not a value of program look"):
        prog.node(Tensor("other", float32, [N], Local))
    with pytest.raises(KeyError, match="no input named 'all_reduce_1'"):
        prog.input("all_reduce_1")


def test_node_lookup_of_a_foreign_handle_with_the_same_name():
    g = Tensor("g", float32, [N], Local)
    prog = Program("look", [g], [cc.all_reduce(g)])
    foreign = Tensor("g", bfloat16, [N, N], Replicated)
    with pytest.raises(KeyError):
        prog.node(foreign)
