"""Every op in the simulator against plain torch, on 1-4 virtual ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
    bfloat16,
    float16,
    float32,
    int64,
    simulate,
)

N, M, B, H, K = Dim("N"), Dim("M"), Dim("B"), Dim("H"), Dim("K")


def gen(*shape, seed=0, dtype=torch.float32, positive=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if positive:
        x = x.abs() + 0.1
    return x.to(dtype)


def per_rank(world, *shape, positive=False, dtype=torch.float32):
    return [gen(*shape, seed=100 + r, positive=positive, dtype=dtype) for r in range(world)]


# ---------------------------------------------------------------------------------------------
# pointwise

UNARY = [
    (cc.neg, torch.neg, False),
    (cc.sqrt, torch.sqrt, True),
    (cc.rsqrt, torch.rsqrt, True),
    (cc.exp, torch.exp, False),
    (cc.log, torch.log, True),
    (cc.abs, torch.abs, False),
    (cc.relu, torch.relu, False),
    (cc.gelu, F.gelu, False),
]


@pytest.mark.parametrize(("op", "ref", "positive"), UNARY, ids=[u[1].__name__ for u in UNARY])
@pytest.mark.parametrize("world", [1, 3])
def test_unary_on_local_values(op, ref, positive, world):
    x = Tensor("x", float32, [N, M], Local)
    prog = Program("u", [x], [op(x)])
    xs = per_rank(world, 3, 5, positive=positive)
    out = simulate(prog, {"x": xs}, world).output(prog.outputs[0].name)
    assert isinstance(out, list) and len(out) == world
    for r in range(world):
        torch.testing.assert_close(out[r], ref(xs[r]), rtol=0, atol=0)


BINARY = [
    (lambda a, b: a + b, torch.add, "add"),
    (lambda a, b: a - b, torch.sub, "sub"),
    (lambda a, b: a * b, torch.mul, "mul"),
    (lambda a, b: a / b, torch.div, "div"),
    (cc.pow, torch.pow, "pow"),
    (cc.maximum, torch.maximum, "maximum"),
    (cc.minimum, torch.minimum, "minimum"),
    (cc.lt, torch.lt, "lt"),
    (cc.le, torch.le, "le"),
    (cc.gt, torch.gt, "gt"),
    (cc.ge, torch.ge, "ge"),
    (cc.eq, torch.eq, "eq"),
    (cc.ne, torch.ne, "ne"),
]


@pytest.mark.parametrize(("op", "ref"), [b[:2] for b in BINARY], ids=[b[2] for b in BINARY])
def test_binary_on_slices_with_broadcast_bias(op, ref):
    """Sliced(0) [B, H] with a Replicated [H] operand on 3 ranks, uneven (B=5)."""
    x = Tensor("x", float32, [B, H], Sliced(0))
    b = Tensor("b", float32, [H], Replicated)
    prog = Program("bin", [x, b], [op(x, b)])
    xv = gen(5, 4, positive=True)
    bv = gen(4, seed=1, positive=True)
    bv[1] = xv[2, 1]  # some equal elements, for the comparisons
    res = simulate(prog, {"x": xv, "b": bv}, 3)
    name = prog.outputs[0].name
    per = res.outputs[name]
    assert [t.shape[0] for t in per] == [2, 2, 1]
    torch.testing.assert_close(res.output(name), ref(xv, bv), rtol=0, atol=0)


def test_binary_local_with_replicated_and_python_numbers():
    g = Tensor("g", float32, [N], Local)
    w = Tensor("w", float32, [N], Replicated)
    prog = Program("lr", [g, w], [2.0 - g * w / 4.0])
    gs, wv = per_rank(2, 6), gen(6, seed=9)
    out = simulate(prog, {"g": gs, "w": wv}, 2).outputs[prog.outputs[0].name]
    for r in range(2):
        torch.testing.assert_close(out[r], 2.0 - gs[r] * wv / 4.0)


def test_where_and_cast():
    x = Tensor("x", float32, [N], Sliced(0))
    y = Tensor("y", float32, [N], Sliced(0))
    prog = Program("w", [x, y], {"sel": cc.where(x > y, x, 0.5), "n": cc.cast(x > 0.0, int64) * 3})
    xv, yv = gen(7), gen(7, seed=1)
    res = simulate(prog, {"x": xv, "y": yv}, 4)
    torch.testing.assert_close(res.output("sel"), torch.where(xv > yv, xv, torch.tensor(0.5)))
    n = res.output("n")
    assert n.dtype == torch.int64
    assert torch.equal(n, (xv > 0).to(torch.int64) * 3)


def test_cast_between_float_dtypes():
    x = Tensor("x", float32, [N], Replicated)
    prog = Program("c", [x], {"h": cc.cast(x, float16), "b": cc.cast(x, bfloat16)})
    xv = gen(9) * 100
    res = simulate(prog, {"x": xv}, 2)
    assert torch.equal(res.output("h"), xv.to(torch.float16))
    assert torch.equal(res.output("b"), xv.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"), [(float16, torch.float16), (bfloat16, torch.bfloat16)]
)
def test_half_precision_values(dtype, torch_dtype):
    g = Tensor("g", dtype, [N], Local)
    w = Tensor("w", dtype, [N], Replicated)
    lr = Scalar("lr")  # float32 scalar: the tensors keep their half dtype
    new_w = w - lr * cc.sqrt(cc.abs(cc.all_reduce(g))) + cc.gelu(w)
    prog = Program("half", [g, w, lr], [cc.update(w, new_w)])
    gs = per_rank(3, 8, dtype=torch_dtype)
    wv = gen(8, seed=5, dtype=torch_dtype)
    res = simulate(prog, {"g": gs, "w": wv, "lr": 0.25}, 3)
    got = res.updated("w")
    assert got.dtype == torch_dtype
    total = gs[0] + gs[1] + gs[2]  # rank order
    lr_t = torch.tensor(0.25)
    expected = wv - lr_t * torch.sqrt(torch.abs(total)) + F.gelu(wv)
    assert expected.dtype == torch_dtype
    torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------------------------
# reductions


@pytest.mark.parametrize(
    ("op", "ref"),
    [
        (cc.sum, lambda x, d, k: x.sum(dim=d, keepdim=k) if d is not None else x.sum()),
        (cc.max, lambda x, d, k: x.amax(dim=d, keepdim=k) if d is not None else x.max()),
        (
            cc.norm,
            lambda x, d, k: (
                torch.linalg.vector_norm(x, dim=d, keepdim=k)
                if d is not None
                else torch.linalg.vector_norm(x)
            ),
        ),
    ],
    ids=["sum", "max", "norm"],
)
@pytest.mark.parametrize(("dim", "keepdim"), [(None, False), (0, False), (1, True), (-1, False)])
def test_reductions_of_replicated(op, ref, dim, keepdim):
    x = Tensor("x", float32, [N, M], Replicated)
    prog = Program("r", [x], [op(x, dim, keepdim)])
    xv = gen(4, 6)
    res = simulate(prog, {"x": xv}, 2)
    name = prog.outputs[0].name
    expected = ref(xv, dim, keepdim)
    torch.testing.assert_close(res.output(name), expected)
    assert res.outputs[name][1].shape == expected.shape


def test_sum_over_sliced_dim_gives_partials_that_all_reduce_to_the_total():
    x = Tensor("x", float32, [N, M], Sliced(0))
    part = cc.sum(x, 0)
    prog = Program("s", [x], {"part": part, "total": cc.all_reduce(part)})
    xv = gen(7, 3)
    res = simulate(prog, {"x": xv}, 3)
    parts = res.output("part")
    chunks = torch.tensor_split(xv, 3, dim=0)
    for r in range(3):
        torch.testing.assert_close(parts[r], chunks[r].sum(0))
    torch.testing.assert_close(res.output("total"), xv.sum(0))


def test_sum_over_a_non_sliced_dim_stays_sliced():
    x = Tensor("x", float32, [N, M], Sliced(1))
    prog = Program("s", [x], {"rows": cc.sum(x, 0, keepdim=True)})
    xv = gen(4, 5)
    res = simulate(prog, {"x": xv}, 2)
    torch.testing.assert_close(res.output("rows"), xv.sum(0, keepdim=True))


def test_max_with_more_ranks_than_elements():
    """An empty slice contributes the identity of max, so all_reduce(MAX) is still right."""
    x = Tensor("x", float32, [N], Sliced(0))
    part = cc.max(x)
    prog = Program("m", [x], {"part": part, "peak": cc.all_reduce(part, ReduceOp.MAX)})
    xv = torch.tensor([-3.0, -1.0, -2.0])
    res = simulate(prog, {"x": xv}, 4)
    assert res.output("part")[3].item() == float("-inf")
    assert res.output("peak").item() == -1.0


# ---------------------------------------------------------------------------------------------
# matmul


def test_row_parallel_matmul_partial_sums():
    x = Tensor("x", float32, [B, K], Sliced(1))
    w = Tensor("w", float32, [K, N], Sliced(0))
    partial = x @ w
    prog = Program("row", [x, w], {"partial": partial, "y": cc.all_reduce(partial)})
    xv, wv = gen(3, 7), gen(7, 4, seed=1)
    res = simulate(prog, {"x": xv, "w": wv}, 3)
    xs, ws = torch.tensor_split(xv, 3, dim=1), torch.tensor_split(wv, 3, dim=0)
    for r in range(3):
        torch.testing.assert_close(res.output("partial")[r], xs[r] @ ws[r])
    torch.testing.assert_close(res.output("y"), xv @ wv)


def test_column_parallel_and_row_sliced_matmul():
    x = Tensor("x", float32, [B, K], Replicated)
    w = Tensor("w", float32, [K, N], Sliced(1))
    xr = Tensor("xr", float32, [B, K], Sliced(0))
    wr = Tensor("wr", float32, [K, N], Replicated)
    prog = Program("col", [x, w, xr, wr], {"col": x @ w, "rows": cc.matmul(xr, wr)})
    xv, wv = gen(5, 3), gen(3, 5, seed=1)
    res = simulate(prog, {"x": xv, "w": wv, "xr": xv, "wr": wv}, 2)
    assert res.outputs["col"][0].shape == (5, 3)
    torch.testing.assert_close(res.output("col"), xv @ wv)
    torch.testing.assert_close(res.output("rows"), xv @ wv)


# ---------------------------------------------------------------------------------------------
# collectives

REDUCERS = {
    ReduceOp.SUM: lambda vs: sum(vs[1:], vs[0]),  # in rank order, as the simulator
    ReduceOp.MAX: lambda vs: torch.stack(vs).amax(0),
    ReduceOp.MIN: lambda vs: torch.stack(vs).amin(0),
    ReduceOp.PROD: lambda vs: torch.stack(vs).prod(0),
    ReduceOp.MEAN: lambda vs: sum(vs[1:], vs[0]) / len(vs),  # the sum over the group's size
}


@pytest.mark.parametrize("rop", list(ReduceOp), ids=str)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce(rop, world):
    g = Tensor("g", float32, [N, M], Local)
    prog = Program("ar", [g], {"r": cc.all_reduce(g, rop)})
    gs = per_rank(world, 2, 3)
    res = simulate(prog, {"g": gs}, world)
    expected = REDUCERS[rop](gs)
    for r in range(world):
        torch.testing.assert_close(res.outputs["r"][r], expected)
    torch.testing.assert_close(res.output("r"), expected)


@pytest.mark.parametrize(("size", "world"), [(8, 4), (7, 3), (5, 4), (2, 3)])
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter(size, world, dim):
    g = Tensor("g", float32, [N, M], Local)
    prog = Program("rs", [g], {"s": cc.reduce_scatter(g, dim=dim)})
    shape = (size, 3) if dim == 0 else (3, size)
    gs = per_rank(world, *shape)
    res = simulate(prog, {"g": gs}, world)
    total = sum(gs[1:], gs[0])
    parts = torch.tensor_split(total, world, dim=dim)
    for r in range(world):
        assert res.outputs["s"][r].shape == parts[r].shape
        torch.testing.assert_close(res.outputs["s"][r], parts[r])
    torch.testing.assert_close(res.output("s"), total)


def test_reduce_scatter_max():
    g = Tensor("g", float32, [N], Local)
    prog = Program("rs", [g], {"s": cc.reduce_scatter(g, ReduceOp.MAX)})
    gs = per_rank(2, 5)
    torch.testing.assert_close(simulate(prog, {"g": gs}, 2).output("s"), torch.maximum(*gs))


@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather(dim):
    s = Tensor("s", float32, [N, M], Sliced(dim))
    prog = Program("ag", [s], {"a": cc.all_gather(s)})
    xv = gen(5, 7)
    res = simulate(prog, {"s": xv}, 3)
    for r in range(3):
        assert torch.equal(res.outputs["a"][r], xv)
    # per-rank slices given explicitly (uneven: 7 = 3 + 2 + 2 along dim 1, 5 = 2 + 2 + 1 along 0)
    parts = list(torch.tensor_split(xv, 3, dim=dim))
    res = simulate(prog, {"s": parts}, 3)
    assert torch.equal(res.output("a"), xv)


@pytest.mark.parametrize("root", [0, 1])
def test_broadcast(root):
    x = Tensor("x", float32, [N], Local)
    prog = Program("b", [x], {"b": cc.broadcast(x, root=root)})
    xs = per_rank(3, 4)
    res = simulate(prog, {"x": xs}, 3)
    for r in range(3):
        assert torch.equal(res.outputs["b"][r], xs[root])


@pytest.mark.parametrize("root", [0, 2])
def test_reduce(root):
    x = Tensor("x", float32, [N], Local)
    prog = Program("r", [x], {"r": cc.reduce(x, root=root)})
    xs = per_rank(3, 4)
    out = simulate(prog, {"x": xs}, 3).output("r")
    for r in range(3):
        if r == root:
            torch.testing.assert_close(out[r], xs[0] + xs[1] + xs[2])
        else:
            assert torch.equal(out[r], torch.zeros(4))


def test_send_on_a_pipeline_mesh():
    mesh = Mesh(pp=2, tp=2)
    x = Tensor("x", float32, [N], Local)
    prog = Program("s", [x], {"y": cc.send(x, axis="pp")})
    xs = per_rank(4, 3)
    out = simulate(prog, {"x": xs}, mesh).output("y")
    # stage 0 (ranks 0, 1) receives nothing; stage 1 gets stage 0's value at the same tp index
    assert torch.equal(out[0], torch.zeros(3))
    assert torch.equal(out[1], torch.zeros(3))
    assert torch.equal(out[2], xs[0])
    assert torch.equal(out[3], xs[1])


def test_send_of_tp_replicated_along_pp():
    mesh = Mesh(pp=3, tp=2)
    x = Tensor("x", float32, [N], Local)
    y = cc.send(cc.all_reduce(x, axis="tp"), axis="pp")
    prog = Program("s", [x], {"y": y})
    xs = per_rank(6, 2)
    out = simulate(prog, {"x": xs}, mesh).output("y")
    assert isinstance(out, list)  # Replicated over one axis: per-rank values
    assert torch.equal(out[0], torch.zeros(2)) and torch.equal(out[1], torch.zeros(2))
    for stage in (1, 2):
        prev = xs[2 * (stage - 1)] + xs[2 * (stage - 1) + 1]
        torch.testing.assert_close(out[2 * stage], prev)
        torch.testing.assert_close(out[2 * stage + 1], prev)


@pytest.mark.parametrize(("size", "world", "dim"), [(6, 3, 0), (5, 2, 1), (3, 4, 0)])
def test_scatter(size, world, dim):
    x = Tensor("x", float32, [N, M], Replicated)
    prog = Program("sc", [x], {"s": cc.scatter(x, dim=dim)})
    xv = gen(size, size + 1) if dim == 0 else gen(2, size)
    res = simulate(prog, {"x": xv}, world)
    parts = torch.tensor_split(xv, world, dim=dim)
    for r in range(world):
        assert torch.equal(res.outputs["s"][r], parts[r])
    assert torch.equal(res.output("s"), xv)


def test_collectives_over_one_mesh_axis():
    """all_reduce over 'tp' sums within each tp group only; over 'pp' within each pp group."""
    mesh = Mesh(pp=2, tp=2)
    x = Tensor("x", float32, [N], Local)
    prog = Program(
        "g",
        [x],
        {
            "tp_sum": cc.all_reduce(x, axis="tp"),
            "pp_max": cc.all_reduce(x, ReduceOp.MAX, axis="pp"),
            "all": cc.all_reduce(x),
            "tp_rs": cc.reduce_scatter(x, axis="tp"),
            "tp_b": cc.broadcast(x, root=1, axis="tp"),
        },
    )
    xs = per_rank(4, 5)
    res = simulate(prog, {"x": xs}, mesh)
    tp = res.output("tp_sum")
    for r in (0, 1):
        torch.testing.assert_close(tp[r], xs[0] + xs[1])
    for r in (2, 3):
        torch.testing.assert_close(tp[r], xs[2] + xs[3])
    pp = res.output("pp_max")
    for r in (0, 2):
        assert torch.equal(pp[r], torch.maximum(xs[0], xs[2]))
    for r in (1, 3):
        assert torch.equal(pp[r], torch.maximum(xs[1], xs[3]))
    torch.testing.assert_close(res.output("all"), xs[0] + xs[1] + xs[2] + xs[3])
    rs = res.output("tp_rs")
    torch.testing.assert_close(torch.cat([rs[0], rs[1]]), xs[0] + xs[1])
    torch.testing.assert_close(torch.cat([rs[2], rs[3]]), xs[2] + xs[3])
    assert [t.shape[0] for t in rs] == [3, 2, 3, 2]
    b = res.output("tp_b")
    assert torch.equal(b[0], xs[1]) and torch.equal(b[1], xs[1])
    assert torch.equal(b[2], xs[3]) and torch.equal(b[3], xs[3])


def test_sliced_over_one_axis_and_gathered():
    mesh = Mesh(dp=2, tp=3)
    w = Tensor("w", float32, [N], Sliced(0, axis="tp"))
    prog = Program("t", [w], {"w2": cc.all_gather(w * 2.0)})
    wv = gen(7)
    res = simulate(prog, {"w": wv}, mesh)
    assert [t.shape[0] for t in res.outputs["w2"]] == [7] * 6
    for t in res.output("w2"):
        torch.testing.assert_close(t, wv * 2.0)


# ---------------------------------------------------------------------------------------------
# update, scalars, inputs


def test_update_with_a_constant():
    p = Tensor("p", float32, [N], Replicated)
    s = Tensor("s", float32, [N, M], Sliced(0))
    c = Tensor("c", int64, [N], Local)
    prog = Program("z", [p, s, c], [cc.update(p, 0.0), cc.update(s, 1.5), cc.update(c, 7)])
    res = simulate(prog, {"p": gen(5), "s": gen(5, 2), "c": torch.arange(5)}, 2)
    assert torch.equal(res.updated("p"), torch.zeros(5))
    assert torch.equal(res.updated("s"), torch.full((5, 2), 1.5))
    assert [t.shape for t in res.updates["s"]] == [(3, 2), (2, 2)]
    for t in res.updated("c"):
        assert torch.equal(t, torch.full((5,), 7))


def test_update_broadcasts_and_is_not_an_output():
    p = Tensor("p", float32, [N, M], Replicated)
    row = Tensor("row", float32, [M], Replicated)
    prog = Program("u", [p, row], [cc.update(p, row * 2.0)])
    res = simulate(prog, {"p": gen(3, 4), "row": gen(4, seed=2)}, 2)
    assert res.outputs == {}
    torch.testing.assert_close(res.updated("p"), (gen(4, seed=2) * 2.0).expand(3, 4))


def test_runtime_scalars_and_sizes():
    x = Tensor("x", float32, [N], Replicated)
    a, i = Scalar("a"), Scalar("i", int64)
    prog = Program("s", [x, a, i], {"y": x * a + cc.cast(i, float32)})
    xv = gen(6)
    res = simulate(prog, {"x": xv, "a": torch.tensor(3.0), "i": 2}, 2)
    torch.testing.assert_close(res.output("y"), xv * 3.0 + 2.0)
    assert res.sizes == {"N": 6}


def test_inputs_are_not_modified():
    g = Tensor("g", float32, [N], Local)
    w = Tensor("w", float32, [N], Replicated)
    s = Tensor("s", float32, [N], Sliced(0))
    prog = Program(
        "sgd",
        [g, w, s],
        {"w_new": cc.update(w, w - cc.all_reduce(g)), "s_new": cc.update(s, s * 0.0)},
    )
    gs, wv, sv = per_rank(2, 4), gen(4, seed=7), gen(4, seed=8)
    before = ([t.clone() for t in gs], wv.clone(), sv.clone())
    res = simulate(prog, {"g": gs, "w": wv, "s": sv}, 2)
    assert all(torch.equal(a, b) for a, b in zip(gs, before[0], strict=True))
    assert torch.equal(wv, before[1])
    assert torch.equal(sv, before[2])
    # results do not alias the inputs either
    for t in res.updates["w"] + res.updates["s"]:
        t.add_(1.0)
    assert torch.equal(wv, before[1]) and torch.equal(sv, before[2])


def test_local_input_given_once_goes_to_every_rank():
    g = Tensor("g", float32, [N], Local)
    prog = Program("c", [g], {"t": cc.all_reduce(g)})
    gv = gen(3)
    torch.testing.assert_close(simulate(prog, {"g": gv}, 4).output("t"), gv * 4)
