"""coconet.grad: every op's vector-Jacobian rule, random programs and the Megatron layers, each
against ``torch.autograd`` through the simulator (``coconet.sim.reference_grad``), on 1-4 ranks
with uneven slices.

The reference never uses coconet's rules: it gives each variable one leaf (a Local input one per
rank, a Replicated one one per group, a Sliced one one per part), simulates the forward program
with autograd's graph kept, and differentiates the loss that counts each output's variables
once. Agreement is to float32 rounding (torch's backward kernels fuse what coconet's programs
write op by op, e.g. ``gelu_backward``), except for linear programs (add, mul by an input,
collectives on 2 ranks), whose gradients are the same operations on the same values: bitwise.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, note, reject, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.errors import DifferentiationError, DSLError
from coconet.ir.mesh import Mesh
from coconet.ir.ops import LEAVES, Op
from coconet.ir.opspec import SPECS, missing_parts
from coconet.sim import reference_grad, simulate

B, K, N, R, C = (cc.Dim(d) for d in ("B", "K", "N", "R", "C"))
f32 = cc.float32


def T(name, shape, layout=cc.Replicated, dtype=f32):  # noqa: N802 - reads like a declaration
    return cc.Tensor(name, dtype, shape, layout)


def _groups(mesh: Mesh, layout):
    return mesh.groups(layout.axis) if not layout.is_local else [[r] for r in range(mesh.size)]


def _random_inputs(program, sizes, mesh, gen, positive=()):
    """Global values for Replicated and Sliced inputs (one per group when the axis has several
    groups), one per rank for Local ones; ``positive`` inputs in [0.5, 1.5]."""
    out = {}
    for n in program.inputs:
        shape = [sizes[d.name] if isinstance(d, cc.Dim) else d for d in n.type.shape]
        lay = n.type.layout

        def value(shape=shape, name=n.name, dtype=n.type.dtype.torch):
            if name in positive:
                return (torch.rand(shape, generator=gen) + 0.5).to(dtype)
            return torch.randn(shape, generator=gen).to(dtype)

        if n.type.dtype in (cc.int64, cc.int32):
            out[n.name] = 7
            continue
        if lay.is_local:
            out[n.name] = [value() for _ in range(mesh.size)]
        elif lay.axis is None or len(mesh.groups(lay.axis)) == 1:
            out[n.name] = value()
        else:
            per_rank = [None] * mesh.size
            for group in mesh.groups(lay.axis):
                v = value()
                for i, r in enumerate(group):
                    if lay.is_sliced:
                        parts = torch.tensor_split(v, len(group), dim=lay.dim)
                        per_rank[r] = parts[i].clone()
                    else:
                        per_rank[r] = v
            out[n.name] = per_rank
    return out


def _cotangents(program, sizes, mesh, gen):
    """One tensor per rank for each float output, equal within a group when Replicated."""
    out = {}
    for n in program.outputs:
        if not n.type.dtype.is_float:
            continue
        shape = [sizes[d.name] if isinstance(d, cc.Dim) else d for d in n.type.shape]
        lay = n.type.layout
        per_rank = [None] * mesh.size
        for group in _groups(mesh, lay):
            v = torch.randn(shape, generator=gen).to(n.type.dtype.torch)
            for i, r in enumerate(group):
                per_rank[r] = (
                    torch.tensor_split(v, len(group), dim=lay.dim)[i].clone()
                    if lay.is_sliced
                    else v
                )
        out[n.name] = per_rank
    return out


def check_grad(program, wrt, sizes, world, *, seed=0, positive=(), saved=(), rtol=1e-5,
               exact=False, reject_nonfinite=False):  # fmt: skip
    """coconet.grad(program) simulated equals torch.autograd through the simulator, per rank.
    ``reject_nonfinite``: a reference gradient that is not finite rejects the hypothesis draw
    (a max over a rank's empty slice is -inf there, and no gradient through it is finite)."""
    mesh = world if isinstance(world, Mesh) else Mesh.world(world)
    gen = torch.Generator().manual_seed(seed)
    inputs = _random_inputs(program, sizes, mesh, gen, positive)
    cts = _cotangents(program, sizes, mesh, gen)
    want = reference_grad(program, wrt, inputs, cts, mesh)
    backward = cc.grad(program, wrt, saved=saved)
    feed = dict(inputs)
    if saved:
        fwd = simulate(program, inputs, mesh)
        for s in saved:
            feed[s] = fwd.outputs[s]
    n_ct = len(cts)
    for node, name in zip(backward.inputs[len(backward.inputs) - n_ct:], cts, strict=True):
        feed[node.name] = cts[name]
    got = simulate(backward, feed, mesh).outputs
    for name in want:
        for r, (g, w) in enumerate(zip(got[name], want[name], strict=True)):
            assert g.shape == w.shape, (name, r, g.shape, w.shape)
            if reject_nonfinite and not torch.isfinite(w).all():
                reject()
            assert torch.isfinite(w).all(), (name, r)
            if exact:
                assert torch.equal(g, w), (name, r, (g - w).abs().max())
            else:
                scale = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
                err = (g.double() - w.double()).abs().max().item() if g.numel() else 0.0
                assert err <= rtol * scale, (name, r, err, scale, str(backward))
    return backward


# -- one program per op --------------------------------------------------------------------------

UNARY_CASES = {
    "neg": cc.neg, "sqrt": cc.sqrt, "rsqrt": cc.rsqrt, "exp": cc.exp, "log": cc.log,
    "abs": cc.abs, "relu": cc.relu, "gelu": cc.gelu, "tanh": cc.tanh, "sigmoid": cc.sigmoid,
    "erf": cc.erf, "silu": cc.silu,
}  # fmt: skip
POSITIVE = {"sqrt", "rsqrt", "log"}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["Replicated", "Local", "Sliced"])
@pytest.mark.parametrize("op", sorted(UNARY_CASES))
def test_unary(op, layout, world):
    lay = {"Replicated": cc.Replicated, "Local": cc.Local, "Sliced": cc.Sliced(0)}[layout]
    x = T("x", [N, C], lay)
    y = UNARY_CASES[op](x * 1.0 if op not in POSITIVE else x).named("y")
    prog = cc.Program("p", [x], {"y": y})
    check_grad(prog, ["x"], {"N": 5, "C": 3}, world, positive={"x"} if op in POSITIVE else ())


BINARY_CASES = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "pow": cc.pow, "maximum": cc.maximum, "minimum": cc.minimum,
    "where": lambda a, b: cc.where(a > b, a, b * 2.0),
}  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    "layouts",
    [("Replicated", "Replicated"), ("Local", "Replicated"),
     ("Sliced", "Sliced"), ("Local", "Local"), ("Replicated", "bias"), ("Sliced", "bias"),
     ("Local", "scalar")],
)  # fmt: skip
@pytest.mark.parametrize("op", sorted(BINARY_CASES))
def test_binary_with_broadcasting(op, layouts, world):
    """Operands of different layouts and shapes: a bias [C] and a scalar are broadcast, and
    their gradients summed back over rows (a partial sum over a Sliced or Local operand's rows
    all_reduced into the Replicated bias)."""
    shapes = {"bias": [C], "scalar": []}
    lays = {"Replicated": cc.Replicated, "Local": cc.Local, "Sliced": cc.Sliced(0),
            "bias": cc.Replicated, "scalar": cc.Replicated}  # fmt: skip
    a = T("a", shapes.get(layouts[0], [N, C]), lays[layouts[0]])
    b = T("b", shapes.get(layouts[1], [N, C]), lays[layouts[1]])
    y = BINARY_CASES[op](a, b).named("y")
    prog = cc.Program("p", [a, b], {"y": y})
    positive = {"a"} if op == "pow" else ()
    check_grad(prog, ["a", "b"], {"N": 5, "C": 3}, world, positive=positive)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_row_broadcast_over_a_sliced_dim_of_size_one(world):
    """A Replicated [1, C] added to a [1, C] Sliced along its one row (rank 0 holds the row, the
    others none): the rules broadcast the Replicated row over each rank's part, so its gradient
    is the ranks' partial sums of their parts, all_reduced, even though the shapes are equal
    (found by test_random_programs: the equal shapes hid the broadcast from the gradient)."""
    x = T("x", [1, C], cc.Replicated)
    s = cc.scatter(x * 2.0, dim=0)
    y = (x + s).named("y")
    prog = cc.Program("p", [x], {"y": y})
    check_grad(prog, ["x"], {"C": 3}, world)


@pytest.mark.parametrize("world", [1, 2])
def test_linear_programs_are_bitwise(world):
    """Gradients of sums, products with inputs, and collectives are the same float operations
    as autograd's on the same values, where no value's cotangent sums more than two terms (a
    sum of three depends on its order, which autograd's accumulation and coconet's differ in:
    hence not w, used by every rank)."""
    x = T("x", [N, C], cc.Local)
    w = T("w", [N, C], cc.Replicated)
    s = T("s", [N, C], cc.Sliced(0))
    total = cc.all_reduce(x * w, name="total")
    y = (total * w - w).named("y")
    z = (cc.all_gather(s * 3.0, name="zg") + w).named("z")
    rs = cc.reduce_scatter(x - w, name="rs")
    prog = cc.Program("lin", [x, w, s], {"y": y, "z": z, "rs": rs})
    check_grad(prog, ["x", "s"], {"N": 4, "C": 3}, world, exact=True)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("op", ["sum", "max", "norm", "mean"])
@pytest.mark.parametrize("layout", ["Replicated", "Local", "Sliced"])
def test_reductions(op, dim, keepdim, layout, world):
    lay = {"Replicated": cc.Replicated, "Local": cc.Local, "Sliced": cc.Sliced(1)}[layout]
    x = T("x", [N, C], lay)
    fn = {"sum": cc.sum, "max": cc.max, "norm": cc.norm, "mean": cc.mean}[op]
    try:
        y = fn(x * 1.0, dim=dim, keepdim=keepdim).named("y")
    except DSLError:  # norm over the sliced dim is refused by the layout rules
        assert op == "norm" and layout == "Sliced" and dim in (None, 1, -1)
        return
    if y.layout.is_local and not x.layout.is_local:
        y = cc.all_reduce(y, cc.ReduceOp.MAX if op == "max" else cc.ReduceOp.SUM, name="y_all")
    prog = cc.Program("p", [x], {"result": y})
    check_grad(prog, ["x"], {"N": 4, "C": 5}, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives(world):
    x = T("x", [N, C], cc.Local)
    r = T("r", [N, C], cc.Replicated)
    s = T("s", [N, C], cc.Sliced(1))
    outs = {
        "ar_max": cc.all_reduce(x * 1.0, cc.ReduceOp.MAX, name="ar_max"),
        "ar_mean": cc.all_reduce(x * r, cc.ReduceOp.MEAN, name="ar_mean"),
        "rs": cc.reduce_scatter(x * 2.0, dim=1, name="rs"),
        "ag": cc.all_gather(s * cc.scatter(r, dim=1), name="ag"),
        "sc2": (cc.scatter(r, dim=0, name="sc") * 2.0).named("sc2"),
        "bc": cc.broadcast(x * 1.0, root=world - 1, name="bc"),
        "red": cc.reduce(x + r, root=0, name="red"),
    }
    prog = cc.Program("coll", [x, r, s], outs)
    check_grad(prog, ["x", "r", "s"], {"N": 5, "C": 7}, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shape_ops_cast_and_dropout(world):
    x = T("x", [N, C], cc.Sliced(0))
    r = T("r", [C], cc.Replicated)
    seed, step = cc.Scalar("seed", cc.int64), cc.Scalar("step", cc.int64)
    spread = cc.expand_as(cc.unsqueeze(r, 0), x).named("spread")
    low = cc.cast(cc.cast(x * spread, cc.bfloat16), f32).named("low")
    dropped = cc.dropout(low, 0.3, seed, step).named("dropped")
    wt = cc.transpose(cc.all_reduce(cc.matmul_tn(x, dropped)), name="wt")  # [C, C]
    prog = cc.Program("shapes", [x, r, seed, step], {"dropped": dropped, "wt": wt})
    check_grad(prog, ["x", "r"], {"N": 5, "C": 3}, world)


# -- the Megatron layers --------------------------------------------------------------------------


def _mlp(axis=None, sequence_parallel=False):
    """Column-parallel -> gelu -> row-parallel, with biases and a residual (as Megatron's MLP)."""
    rep = cc.Replicated(axis) if axis else cc.Replicated
    x = T("x", [B, N, K], cc.Sliced(1, axis) if sequence_parallel else rep)
    w1 = T("w1", [K, C], cc.Sliced(1, axis))
    b1 = T("b1", [C], cc.Sliced(0, axis))
    w2 = T("w2", [C, K], cc.Sliced(0, axis))
    b2 = T("b2", [K], rep)
    full = cc.all_gather(x, axis=axis, name="x_full") if sequence_parallel else x
    h = cc.gelu(cc.matmul(full, w1) + b1).named("h")
    partial = cc.matmul(h, w2).named("partial")
    if sequence_parallel:
        y = cc.reduce_scatter(partial, axis=axis, dim=1, name="y")
    else:
        y = cc.all_reduce(partial, axis=axis, name="y")
    out = (y + b2 + x).named("out")
    return cc.Program("mlp", [x, w1, b1, w2, b2], {"out": out, "h": h})


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_mlp(world, sequence_parallel):
    prog = _mlp(sequence_parallel=sequence_parallel)
    wrt = ["x", "w1", "b1", "w2", "b2"]
    backward = check_grad(prog, wrt, {"B": 2, "N": 5, "K": 4, "C": 6}, world, saved=["h"])
    comms = [n.op for n in backward.nodes if n.op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER,
                                                      Op.ALL_GATHER)]  # fmt: skip
    # Megatron's conjugates: one all_reduce for the input gradient (f), nothing for g; in
    # sequence parallel the all_gather of x is recomputed and its gradient reduce_scattered
    if sequence_parallel:
        assert comms.count(Op.REDUCE_SCATTER) == 1 and comms.count(Op.ALL_REDUCE) == 1
    else:
        assert comms == [Op.ALL_REDUCE]


def test_megatron_mlp_on_a_2d_mesh():
    """dp x tp: parameters Replicated over tp; each dp group's gradient is its own."""
    mesh = Mesh(dp=2, tp=2)
    prog = _mlp(axis="tp")
    check_grad(prog, ["x", "w1", "b1", "w2", "b2"], {"B": 2, "N": 3, "K": 4, "C": 5}, mesh)


def test_attention_scores_and_softmax():
    """Heads split over the ranks: q and k column-parallel, a softmax over keys."""
    x = T("x", [N, K], cc.Replicated)
    wq = T("wq", [K, C], cc.Sliced(1))
    wk = T("wk", [K, C], cc.Sliced(1))
    q, k = cc.matmul(x, wq).named("q"), cc.matmul(x, wk).named("k")
    # one head per rank: scores = q @ k^T as sum over the head dim (a partial sum per rank)
    s = cc.sum(cc.unsqueeze(q, 1) * cc.unsqueeze(k, 0), dim=2).named("s")  # [N, N] Local
    e = cc.exp(s - cc.max(s, dim=1, keepdim=True)).named("e")
    p = (e / cc.sum(e, dim=1, keepdim=True)).named("p")
    out = cc.all_reduce(p, name="out")
    prog = cc.Program("attn", [x, wq, wk], {"out": out})
    for world in (1, 2, 3):
        check_grad(prog, ["x", "wq", "wk"], {"N": 4, "K": 3, "C": 5}, world, rtol=1e-4)


# -- random programs ------------------------------------------------------------------------------

_UNARY = [cc.tanh, cc.sigmoid, cc.gelu, cc.silu, cc.erf, cc.neg, lambda a: cc.exp(cc.tanh(a)),
          lambda a: cc.sqrt(a * a + 1.0), lambda a: cc.log(cc.abs(a) + 1.0)]  # fmt: skip
_BINARY = [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b,
           lambda a, b: a / (cc.abs(b) + 1.0), cc.maximum, cc.minimum]  # fmt: skip


@st.composite
def random_programs(draw):
    """Chains over inputs of shape [R, C] (and a weight [C, C]) with random layouts: pointwise
    ops, reductions (one dim, keepdim so the value can go on), collectives and matmuls; the
    steps the layout rules refuse are skipped."""
    layouts = [cc.Replicated, cc.Local, cc.Sliced(0), cc.Sliced(1)]
    inputs = [T(f"x{i}", [R, C], draw(st.sampled_from(layouts))) for i in range(draw(
        st.integers(1, 3)))]  # fmt: skip
    w = T("w", [C, C], draw(st.sampled_from([cc.Replicated, cc.Sliced(0), cc.Sliced(1)])))
    pool = [*inputs, w]
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "collective",
                                     "matmul"]))  # fmt: skip
        a = draw(st.sampled_from(pool))
        try:
            if kind == "unary":
                v = draw(st.sampled_from(_UNARY))(a)
            elif kind == "binary":
                v = draw(st.sampled_from(_BINARY))(a, draw(st.sampled_from(pool)))
            elif kind == "reduce":
                fn = draw(st.sampled_from([cc.sum, cc.max, cc.mean]))
                v = fn(a, dim=draw(st.integers(0, max(a.type.rank - 1, 0))), keepdim=True)
            elif kind == "collective":
                lay = a.layout
                if lay.is_local:
                    v = (cc.all_reduce(a) if draw(st.booleans()) or a.type.rank == 0
                         else cc.reduce_scatter(a, dim=draw(st.integers(0, a.type.rank - 1))))
                elif lay.is_sliced:
                    v = cc.all_gather(a)
                elif a.type.rank:
                    v = cc.scatter(a, dim=draw(st.integers(0, a.type.rank - 1)))
                else:
                    continue
            else:
                v = cc.matmul(a, w)
                if v.layout.is_local and not a.layout.is_local:
                    # row-parallel partial sums are reduced (as every layer does): a Local
                    # cotangent of them has no layout (test_partial_sums_need_their_reduction)
                    v = cc.all_reduce(v)
        except DSLError:
            continue
        pool.append(v)
    computed = [v for v in pool if v.node.op is not Op.INPUT]
    if not computed:
        computed = [inputs[0] * 2.0]
    outs = {f"y{i}": v for i, v in enumerate(computed[-2:])}
    return cc.Program("rand", [*inputs, w], outs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=random_programs(), world=st.integers(1, 4), rows=st.integers(1, 6),
       cols=st.integers(1, 5), seed=st.integers(0, 2**16))  # fmt: skip
def test_random_programs(program, world, rows, cols, seed):
    note(str(program))
    wrt = [n.name for n in program.inputs]
    backward = check_grad(program, wrt, {"R": rows, "C": cols}, world, seed=seed, rtol=1e-4,
                          reject_nonfinite=True)
    # a backward program is a program: the compiler lowers it and writes its per-rank module
    cc.compile(backward, world=world, fused_kernels=False)


def test_two_inputs_with_the_very_same_gradient_each_get_it():
    """x0 + x1: both gradients are one value; each is returned under its own name (a draw of
    test_random_programs found the first one missing)."""
    r, c = cc.Dim("R"), cc.Dim("C")
    x0, x1 = (cc.Tensor(n, cc.float32, [r, c], cc.Replicated) for n in ("x0", "x1"))
    w = cc.Tensor("w", cc.float32, [c, c], cc.Replicated)
    program = cc.Program("rand", [x0, x1, w], {"y0": (w + w).named("y0"),
                                               "y1": cc.matmul(x0 + x1, w).named("y1")})
    backward = check_grad(program, ["x0", "x1", "w"], {"R": 2, "C": 3}, 2, rtol=1e-5)
    assert [n.name for n in backward.outputs] == ["d_x0", "d_x1", "d_w"]


# -- what grad refuses, and the completeness of the rules -----------------------------------------


def test_every_op_has_a_rule_or_is_a_leaf():
    assert missing_parts() == []
    for op, s in SPECS.items():
        assert (s.vjp is None) == (op in LEAVES or op is Op.UPDATE), op


def test_missing_parts_names_an_op_without_a_rule(monkeypatch):
    from dataclasses import replace

    monkeypatch.setitem(SPECS, Op.TANH, replace(SPECS[Op.TANH], vjp=None))
    assert "tanh has no vector-Jacobian rule (coconet.ir.adjoints.RULES)" in missing_parts()


def _simple():
    x = T("x", [N], cc.Local)
    i = T("i", [N], cc.Local, cc.int64)
    y = (x * 2.0).named("y")
    return cc.Program("simple", [x, i], {"y": y, "j": (i + 1).named("j")})


@pytest.mark.parametrize(
    ("wrt", "saved", "fragment"),
    [
        (["i"], (), "is not a float tensor"),
        (["nope"], (), "does not have"),
        (["y"], (), "a computed value, not an input"),
        ([], (), "wrt names no input"),
        ("x", (), "a list of names"),
        (["x"], ["x"], "not a computed value"),
        (["x", "x"], (), "twice"),
    ],
)
def test_bad_requests_are_refused(wrt, saved, fragment):
    with pytest.raises(DifferentiationError, match=fragment) as info:
        cc.grad(_simple(), wrt, saved=saved)
    assert info.value.loc is not None and info.value.loc.filename == __file__
    assert info.value.hint


def test_partial_sums_need_their_reduction():
    """Row-parallel partial sums returned as they are get a Local cotangent, which a column
    slice of the weight cannot carry back to x's slices: refused, naming the matmul."""
    x, w = T("x", [B, K], cc.Sliced(1)), T("w", [K, N], cc.Sliced(0))
    prog = cc.Program("row", [x, w], {"y": cc.matmul(x, w).named("y")})
    with pytest.raises(DifferentiationError, match="no layout") as info:
        cc.grad(prog, ["x"])
    assert info.value.op == "matmul" and info.value.loc.filename == __file__


@pytest.mark.parametrize("mesh", [Mesh(pp=2), Mesh(pp=3), Mesh(pp=2, tp=2)])
def test_send_and_its_adjoint(mesh):
    """A pipeline boundary: the gradient of a send goes back a stage (a reverse send), and the
    reverse send's goes forward; Local values and values Replicated over tp."""
    x = T("x", [N, C], cc.Local)
    w = T("w", [N, C], cc.Replicated("tp") if "tp" in mesh.names else cc.Local)
    y = cc.send(x * w, axis="pp", name="y")
    z = cc.send(cc.tanh(y) * w, axis="pp", name="z", reverse=True)
    prog = cc.Program("stages", [x, w], {"y": y, "z": z})
    backward = check_grad(prog, ["x", "w"], {"N": 3, "C": 2}, mesh, saved=["y"])
    sends = [n for n in backward.nodes if n.op is Op.SEND]
    assert sorted(bool(n.attr("reverse")) for n in sends) == [False, True]


def test_world_replicated_parameter_in_a_tp_value_is_refused():
    b = T("b", [N], cc.Replicated)  # one copy for the whole world, used per tp group
    p = T("p", [N], cc.Local)
    y = cc.all_reduce(p * 1.0, axis="tp", name="y")
    prog = cc.Program("p", [p, b], {"z": (y + b).named("z")})
    with pytest.raises(DifferentiationError, match="Replicated over the whole world") as info:
        cc.grad(prog, ["b"])
    assert "Replicated('tp')" in info.value.hint


def test_the_backward_program_is_a_program():
    """It prints, has d_<input> outputs in the inputs' layouts, and unused gradients are zeros."""
    prog = _mlp()
    backward = cc.grad(prog, ["w1", "b2"], saved=["h"])
    assert [n.name for n in backward.outputs] == ["d_w1", "d_b2"]
    assert backward.outputs[0].type == prog.input("w1").type
    assert [n.name for n in backward.inputs][-3:] == ["h", "d_out", "d_h"]
    assert "matmul_tn" in str(backward)
    x = T("x", [N], cc.Local)
    z = T("z", [N], cc.Replicated)
    unused = cc.grad(cc.Program("u", [x, z], {"y": (x * 2.0).named("y")}), ["z"])
    out = simulate(unused, {"x": torch.ones(3), "z": torch.ones(3), "d_y": torch.ones(3)}, 2)
    assert torch.equal(out.outputs["d_z"][0], torch.zeros(3))


@pytest.mark.parametrize("name", ["MM_AR_C", "MM_RS_C_AG", "ol_MM_fuse_RS_C_AG"])
@pytest.mark.parametrize("world", [2, 3])
def test_paper_schedules_apply_to_a_backward_program(name, world):
    """The MLP's backward (its input gradient's all_reduce, then the residual's add) takes the
    paper's layer schedules like a forward program, computes the same, and compiles."""
    from coconet import schedule as schedules

    prog = _mlp()
    backward = cc.grad(prog, ["x", "w1", "b1", "w2", "b2"], saved=["h"])
    scheduled = getattr(schedules, name)(backward)
    sizes = {"B": 4, "N": 3, "K": 4, "C": 6}
    mesh = Mesh.world(world)
    gen = torch.Generator().manual_seed(1)
    inputs = _random_inputs(backward, sizes, mesh, gen)
    want = simulate(backward, inputs, mesh).outputs
    got = simulate(scheduled.program, inputs, mesh).outputs
    for k in want:
        for g, w in zip(got[k], want[k], strict=True):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), k
    cc.compile(scheduled, world=world, fused_kernels=False)
