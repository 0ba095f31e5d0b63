"""What a user writing an optimizer or a layer of their own reaches for: Python's operators on
Tensors, and the ops optimizers and layers need, each against torch (issue 12, items 3 and 4)."""

from __future__ import annotations

import pytest
import torch

import coconet as cc
from coconet import Dim, Local, Program, Replicated, Sliced, Tensor, float32, simulate
from coconet.ir.ops import Op
from coconet.ir.types import DType

N, M = Dim("N"), Dim("M")


def gen(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Python's operators


def test_eq_and_ne_build_comparisons_not_python_bools():
    x = Tensor("x", float32, [N], Sliced(0))
    y = Tensor("y", float32, [N], Sliced(0))
    for t, op in ((x == 0, Op.EQ), (0 == x, Op.EQ), (x != y, Op.NE), (1.5 != x, Op.NE)):
        assert isinstance(t, Tensor) and t.node.op is op and t.dtype is DType.bool
    prog = Program(
        "cmp",
        [x, y],
        {"z": cc.where(x == 0, 1.0, x), "d": cc.where(x != y, x - y, 0.0), "e": 0.0 == y},
    )
    xv, yv = gen(7), gen(7, seed=1)
    xv[[1, 4]] = 0.0
    yv[2] = xv[2]
    res = simulate(prog, {"x": xv, "y": yv}, 3)
    assert torch.equal(res.output("z"), torch.where(xv == 0, 1.0, xv))
    assert torch.equal(res.output("d"), torch.where(xv != yv, xv - yv, 0.0))
    assert torch.equal(res.output("e"), yv == 0.0)


def test_abs_neg_pow_and_reflected_operators_match_torch():
    x = Tensor("x", float32, [N], Local)
    prog = Program(
        "ops",
        [x],
        {"a": abs(x), "n": -x, "sq": x**2, "r": 2 - x, "p": 2.0**x, "h": abs(x) ** 0.5},
    )
    assert [prog.node(k).op for k in ("a", "n", "sq", "r", "p")] == [
        Op.ABS, Op.NEG, Op.POW, Op.SUB, Op.POW,
    ]  # fmt: skip
    xs = [gen(6, seed=r) for r in range(2)]
    out = simulate(prog, {"x": xs}, 2).outputs
    for r, xv in enumerate(xs):
        assert torch.equal(out["a"][r], xv.abs())
        assert torch.equal(out["n"][r], -xv)
        assert torch.equal(out["sq"][r], xv**2)
        assert torch.equal(out["r"][r], 2 - xv)
        assert torch.equal(out["p"][r], torch.pow(torch.tensor(2.0), xv))
        # a 0-d exponent, as the generated code passes it (torch special-cases a Python 0.5)
        assert torch.equal(out["h"][r], torch.pow(xv.abs(), torch.tensor(0.5)))


def test_tensors_stay_hashable_by_identity():
    x = Tensor("x", float32, [N], Replicated)
    y = Tensor("y", float32, [N], Replicated)
    table = {x: "x", y: "y"}
    assert table[x] == "x" and table[y] == "y" and len({x, y, x}) == 2
    assert x in [x] and x in {x}  # identity first: no comparison node, no truth value
    assert hash(x) != hash(y)
    with pytest.raises(cc.DSLError, match="no truth value"):
        x in [y]  # noqa: B015 - comparing two Tensors builds eq(x, y), which has no truth value
    with pytest.raises(cc.DSLError, match="no truth value"):
        if x == y:
            pass
