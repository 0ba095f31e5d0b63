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


# ---------------------------------------------------------------------------------------------
# the ops optimizers and layers need, against torch, on 1-4 ranks

UNARY = [
    (cc.sign, torch.sign),
    (cc.tanh, torch.tanh),
    (cc.sigmoid, torch.sigmoid),
    (cc.erf, torch.erf),
    (cc.silu, torch.nn.functional.silu),
]


@pytest.mark.parametrize(("op", "ref"), UNARY, ids=[u[1].__name__ for u in UNARY])
@pytest.mark.parametrize("layout", [Local, Replicated, Sliced(0)], ids=str)
def test_new_unary_ops_match_torch(op, ref, layout):
    x = Tensor("x", float32, [N, M], layout)
    prog = Program("u", [x], {"y": op(x)})
    xv = [gen(5, 3, seed=r) for r in range(3)] if layout.is_local else gen(5, 3)
    xv_all = xv if layout.is_local else [xv] * 3
    xv_all[0][0, 0] = 0.0  # sign(0) = 0
    res = simulate(prog, {"x": xv}, 3)
    # On slices, which elements torch computes in its vector loop and which in the scalar tail
    # differs from the whole tensor: the transcendental ops may differ by an ulp there
    # (coconet.sim.exactness); sign is exact.
    rtol = 0.0 if op is cc.sign else 1e-6
    for r in range(3):
        if layout.is_sliced:
            torch.testing.assert_close(res.output("y"), ref(xv), rtol=rtol, atol=1e-7 * (rtol > 0))
        else:
            torch.testing.assert_close(res.outputs["y"][r], ref(xv_all[r]), rtol=0, atol=0)


def test_sign_of_ints():
    i = Tensor("i", cc.int64, [N], Replicated)
    prog = Program("s", [i], {"s": cc.sign(i)})
    iv = torch.tensor([-3, 0, 5])
    assert torch.equal(simulate(prog, {"i": iv}, 2).output("s"), torch.sign(iv))


@pytest.mark.parametrize(
    ("lo", "hi"), [(-0.5, 1.0), (None, 0.25), (0.0, None), (1.0, -1.0), ("t", None)]
)
def test_clamp_and_clip_match_torch_clamp(lo, hi):
    x = Tensor("x", float32, [N], Sliced(0))
    t = cc.Scalar("t")
    lo_ = t if lo == "t" else lo
    prog = Program("c", [x, t], {"c": cc.clamp(x, lo_, hi), "k": cc.clip(x, lo_, hi)})
    xv = gen(9) * 2
    xv[3] = float("nan")
    res = simulate(prog, {"x": xv, "t": 0.3}, 4)
    want = torch.clamp(xv, 0.3 if lo == "t" else lo, hi)
    torch.testing.assert_close(res.output("c"), want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(res.output("k"), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("layout", [Local, Replicated, Sliced(0), Sliced(1)], ids=str)
@pytest.mark.parametrize(("dim", "keepdim"), [(None, False), (0, False), (1, True), (-1, False)])
def test_mean_matches_torch_mean(layout, dim, keepdim):
    """Over a sliced dim each rank's mean is a partial mean (Local) and all_reduce adds them
    up to the mean; elsewhere it is torch.mean of the rank's value. Sizes are bound when the
    step runs: one program serves every N and M."""
    x = Tensor("x", float32, [N, M], layout)
    m = cc.mean(x, dim, keepdim)
    over_slices = layout.is_sliced and (dim is None or dim % 2 == layout.dim)
    outs = {"m": cc.all_reduce(m) if over_slices else m}
    prog = Program("mean", [x], outs)
    for n, k in ((5, 3), (2, 7)):
        world = 3
        xv = [gen(n, k, seed=r) for r in range(world)] if layout.is_local else gen(n, k)
        res = simulate(prog, {"x": xv}, world)
        for r in range(world):
            mine = xv[r] if layout.is_local else xv
            want = mine.mean() if dim is None else mine.mean(dim, keepdim)
            got = res.outputs["m"][r] if not layout.is_sliced or over_slices else res.output("m")
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


def test_dim_arithmetic_and_world_size():
    """x / N divides by the bound size of N; world_size(axis) is the group's rank count."""
    x = Tensor("x", float32, [N, M], Local)
    prog = Program(
        "sizes",
        [x],
        {
            "per_col": cc.sum(x, 0) / N,
            "scaled": x * M - N,
            "ranks": cc.all_reduce(x) / cc.world_size(),
            "tp": cc.world_size("tp") + 0.0,
            "dp": cc.world_size("dp", cc.int64) * 1,
            "dp_mean": cc.all_reduce(x, cc.ReduceOp.MEAN, axis="dp", name="dp_sum"),
        },
    )
    assert "per_col = div(sum_1, N)" in str(prog) and "sub(mul_1, N)" in str(prog)
    mesh = cc.Mesh(dp=2, tp=3)
    xs = [gen(4, 5, seed=r) for r in range(6)]
    res = simulate(prog, {"x": xs}, mesh)
    for r in range(6):
        torch.testing.assert_close(res.outputs["per_col"][r], xs[r].sum(0) / 4, rtol=0, atol=0)
        torch.testing.assert_close(res.outputs["scaled"][r], xs[r] * 5.0 - 4, rtol=0, atol=0)
        total = sum(xs[1:], xs[0])
        torch.testing.assert_close(res.outputs["ranks"][r], total / 6, rtol=0, atol=0)
        assert res.outputs["tp"][r].item() == 3.0 and res.outputs["dp"][r].dtype == torch.int64
        assert res.outputs["dp"][r].item() == 2
        group = mesh.group_of(r, "dp")
        dp_total = sum((xs[g] for g in group[1:]), xs[group[0]])
        torch.testing.assert_close(res.outputs["dp_mean"][r], dp_total / 2, rtol=0, atol=0)
    # name= names the mean (the division); its all_reduce is name_sum
    assert prog.node("dp_sum_sum").op is Op.ALL_REDUCE and prog.node("dp_mean").op is Op.DIV


def test_a_size_must_be_bound_by_an_input():
    x = Tensor("x", float32, [N], Local)
    with pytest.raises(cc.DSLError, match="the size Q is not a size of any input"):
        Program("p", [x], {"y": x / Dim("Q")})


@pytest.mark.parametrize("rop", [cc.ReduceOp.MEAN], ids=str)
def test_mean_collectives_match_the_average(rop):
    x = Tensor("x", float32, [N], Local)
    prog = Program(
        "avg",
        [x],
        {
            "ar": cc.all_reduce(x, rop, name="ar"),
            "rs": cc.reduce_scatter(x, rop, name="rs"),
            "rd": cc.reduce(x, 1, rop, name="rd"),
        },
    )
    xs = [gen(7, seed=r) for r in range(3)]
    res = simulate(prog, {"x": xs}, 3)
    avg = sum(xs[1:], xs[0]) / 3
    torch.testing.assert_close(res.output("ar"), avg, rtol=0, atol=0)
    torch.testing.assert_close(res.output("rs"), avg, rtol=0, atol=0)
    torch.testing.assert_close(res.outputs["rd"][1], avg, rtol=0, atol=0)
    assert torch.equal(res.outputs["rd"][0], torch.zeros(7))


def test_a_mean_all_reduce_is_split_through_its_sum():
    """name= names the mean; split names its all_reduce in the hint, and the paper's schedules
    find it by themselves (the only all_reduce of a tensor)."""
    from coconet.schedule import RS_C_AG, Schedule

    g = Tensor("g", float32, [N], Local)
    p = Tensor("p", float32, [N], Replicated)
    grad = cc.all_reduce(g, cc.ReduceOp.MEAN, name="grad")
    prog = Program("sgd", [g, p], [cc.update(p, p - 0.1 * grad)])
    with pytest.raises(cc.ScheduleError) as info:
        Schedule(prog).split("grad")
    assert "grad is a div, not an all_reduce" in info.value.message
    assert info.value.hint == "split its all_reduce: split('grad_sum')"
    s = RS_C_AG(prog)
    assert str(s).splitlines()[1].strip() == "split(grad_sum)"
    xs = [gen(5, seed=r) for r in range(2)]
    ins = {"g": xs, "p": gen(5, seed=9)}
    want = simulate(prog, ins, 2).updated("p")
    assert torch.equal(simulate(s.program, ins, 2).updated("p"), want)
