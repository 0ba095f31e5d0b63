"""Small DSL programs covering every op and layout the code generator handles.

Each entry: name -> (program builder, mesh or world size, input maker(world_or_mesh, size, dtype)).
The workers run them distributed and compare with ``coconet.simulate``.
"""

from __future__ import annotations

import torch

import coconet as cc


def _per_rank(n, make):
    return [make(r) for r in range(n)]


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def collectives(dtype=cc.float32):
    """Every collective over the whole world, several dims and reduce ops, uneven sizes."""
    N, M, K = cc.Dim("N"), cc.Dim("M"), cc.Dim("K")
    x = cc.Tensor("x", dtype, [N, M], cc.Local)
    y = cc.Tensor("y", dtype, [N, K], cc.Sliced(1))
    z = cc.Tensor("z", dtype, [N], cc.Replicated)
    s = cc.Scalar("s", dtype)
    ar_sum = cc.all_reduce(x, name="ar_sum")
    ar_max = cc.all_reduce(x * s, cc.ReduceOp.MAX, name="ar_max")
    ar_min = cc.all_reduce(x, cc.ReduceOp.MIN, name="ar_min")
    rs0 = cc.reduce_scatter(x, name="rs0")
    rs1 = cc.reduce_scatter(x, cc.ReduceOp.MAX, dim=1, name="rs1")
    ag1 = cc.all_gather(y, name="ag1")
    ag_rs = cc.all_gather(rs0 * 2.0, name="ag_rs")
    bc = cc.broadcast(x + 1.0, root=1, name="bc")
    rd = cc.reduce(x, root=1, name="rd")
    sc = cc.scatter(z, name="sc")
    back = cc.all_gather(sc + 1.0, name="back")
    return cc.Program(
        "collectives",
        [x, y, z, s],
        {
            "ar_sum": ar_sum,
            "ar_max": ar_max,
            "ar_min": ar_min,
            "rs0": rs0,
            "rs1": rs1,
            "ag1": ag1,
            "ag_rs": ag_rs,
            "bc": bc,
            "rd": rd,
            "sc": sc,
            "back": back,
        },
    )


def collectives_inputs(world, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": _per_rank(world, lambda r: _randn(gen, size, size + 2, dtype=dtype)),
        "y": _randn(gen, size, 2 * size + 1, dtype=dtype),
        "z": _randn(gen, size, dtype=dtype),
        "s": 0.5,
    }


def prod_and_ints():
    """PROD reduction, integer reductions and casts, comparisons and where."""
    N = cc.Dim("N")
    a = cc.Tensor("a", cc.float32, [N], cc.Local)
    k = cc.Tensor("k", cc.int32, [N], cc.Local)
    prod = cc.all_reduce(a, cc.ReduceOp.PROD, name="prod")
    ksum = cc.all_reduce(k, name="ksum")
    total = cc.all_reduce(cc.sum(k), name="total")  # int32 sum: torch would give int64
    big = cc.where(cc.gt(prod, 0.0), prod, cc.neg(prod)).named("big")
    as_f = (cc.cast(ksum, cc.float32) + big).named("as_f")
    return cc.Program(
        "prod_and_ints", [a, k], {"prod": prod, "ksum": ksum, "total": total, "as_f": as_f}
    )


def prod_and_ints_inputs(world, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "a": _per_rank(world, lambda r: 0.5 + torch.rand(size, generator=gen)),
        "k": _per_rank(
            world, lambda r: torch.randint(-5, 5, (size,), generator=gen, dtype=torch.int32)
        ),
    }


def update_state(dtype=cc.float32):
    """Updates of Replicated, Sliced and Local state, an output that aliases an input, and a
    dropout on a sliced value (its mask must match the simulator's global one)."""
    N = cc.Dim("N")
    w = cc.Tensor("w", dtype, [N], cc.Replicated)
    m = cc.Tensor("m", dtype, [N], cc.Sliced(0))
    loc = cc.Tensor("loc", dtype, [N], cc.Local)
    seed = cc.Scalar("seed", cc.int64)
    g_rs = cc.reduce_scatter(loc, name="g_rs")
    m_new = (m * 0.5 + g_rs).named("m_new")
    dropped = cc.dropout(m_new, 0.25, seed, 3).named("dropped")
    w_new = cc.all_gather(dropped, name="w_new")
    return cc.Program(
        "update_state",
        [w, m, loc, seed],
        {
            "w": w,
            "dropped": dropped,
            "wu": cc.update(w, w_new),
            "mu": cc.update(m, m_new),
            "lu": cc.update(loc, loc * 2.0),
        },
    )


def update_state_inputs(world, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": _randn(gen, size, dtype=dtype),
        "m": _randn(gen, size, dtype=dtype),
        "loc": _per_rank(world, lambda r: _randn(gen, size, dtype=dtype)),
        "seed": 7,
    }


def fused_mix():
    """Pointwise fuse groups (one with a dropout, whose block geometry the kernel is passed),
    and a fuse group around a reduce_scatter and an all_gather."""
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    lr = cc.Scalar("lr")
    pre = (g * 2.0 + 1.0).named("pre")
    rs = cc.reduce_scatter(pre, name="rs")
    ps = cc.scatter(p, name="ps")
    upd = (ps - lr * cc.sqrt(cc.abs(rs)) + cc.exp(-cc.abs(ps))).named("upd")
    ag = cc.all_gather(upd, name="ag")
    out = cc.relu(cc.dropout(ag - 0.5, 0.3, 5, 2)).named("out")
    program = cc.Program("fused_mix", [g, p, lr], {"out": out, "pu": cc.update(p, ag)})
    from coconet.schedule import Schedule

    s = Schedule(program, "fused_mix")
    s.fuse(s.computations("g")[:2])  # g * 2.0 + 1.0
    s.fuse(["rs", *s.computations("rs"), "ag"])
    s.fuse(s.computations("ag"))
    return s


def fused_mix_inputs(world, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "g": _per_rank(world, lambda r: torch.randn(size, generator=gen)),
        "p": torch.randn(size, generator=gen),
        "lr": 0.1,
    }


def user_ops():
    """The ops of issue 12 in generated code: sign/tanh/sigmoid/erf/silu/clamp, means over one
    dim and over all (sizes bound when the step runs), world_size and a ReduceOp.MEAN all_reduce
    split and reordered (the division and a partial mean on slices), with one fused group."""
    from coconet.schedule import fuse_RS_C_AG

    N, M = cc.Dim("N"), cc.Dim("M")
    g = cc.Tensor("g", cc.float32, [N, M], cc.Local)
    w = cc.Tensor("w", cc.float32, [N, M], cc.Replicated)
    g_avg = cc.all_reduce(g, cc.ReduceOp.MEAN, name="g_avg")
    act = (cc.silu(g_avg) + cc.tanh(w) * cc.sigmoid(g_avg) + cc.erf(w)).named("act")
    clipped = cc.clamp(act * cc.sign(w), -0.5, max=1.0).named("clipped")
    centered = (clipped - cc.mean(clipped, 1, keepdim=True)).named("centered")
    total = (cc.mean(centered * centered) * cc.world_size()).named("total")
    program = cc.Program(
        "user_ops", [g, w], {"total": total, "u": cc.update(w, w - centered / N)}
    )
    return fuse_RS_C_AG(program)


def user_ops_inputs(world, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "g": _per_rank(world, lambda r: torch.randn(size, 3, generator=gen)),
        "w": torch.randn(size, 3, generator=gen),
    }


def lion():
    """Lion with the averaged gradient (ReduceOp.MEAN) as one fused collective, its momentum
    sliced: over shared memory the one-pass kernel reads world_size as an input."""
    from coconet.schedule import fuse_RS_C_AG

    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    m = cc.Tensor("m", cc.float32, [N], cc.Replicated)
    lr, beta1, beta2 = cc.Scalar("lr"), cc.Scalar("beta1"), cc.Scalar("beta2")
    grad = cc.all_reduce(g, cc.ReduceOp.MEAN, name="grad")
    p_new = (p - lr * cc.sign(beta1 * m + (1 - beta1) * grad)).named("p_new")
    m_new = (beta2 * m + (1 - beta2) * grad).named("m_new")
    program = cc.Program(
        "lion", [g, p, m, lr, beta1, beta2], [cc.update(p, p_new), cc.update(m, m_new)]
    )
    return fuse_RS_C_AG(program, state=("m",))


def lion_inputs(world, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "g": _per_rank(world, lambda r: torch.randn(size, generator=gen)),
        "p": torch.randn(size, generator=gen),
        "m": torch.randn(size, generator=gen),
        "lr": 0.01,
        "beta1": 0.9,
        "beta2": 0.99,
    }


def mesh_program():
    """Collectives along the axes of a 2x2 mesh, send along pp, matmuls on tp slices."""
    B, H = cc.Dim("B"), cc.Dim("H")
    x = cc.Tensor("x", cc.float32, [B, H], cc.Sliced(1, axis="tp"))
    w = cc.Tensor("w", cc.float32, [H, H], cc.Sliced(0, axis="tp"))
    loc = cc.Tensor("loc", cc.float32, [B, H], cc.Local)
    partial = cc.matmul(x, w).named("partial")
    tp_sum = cc.all_reduce(partial, axis="tp", name="tp_sum")
    sent = cc.send(partial, axis="pp", name="sent")
    dp_rs = cc.reduce_scatter(loc, axis="pp", dim=1, name="dp_rs")
    dp_ag = cc.all_gather(dp_rs, axis="pp", name="dp_ag")
    bc = cc.broadcast(loc, root=1, axis="tp", name="bc")
    world_sum = cc.all_reduce(loc, name="world_sum")
    return cc.Program(
        "mesh_program",
        [x, w, loc],
        {"tp_sum": tp_sum, "sent": sent, "dp_ag": dp_ag, "bc": bc, "world_sum": world_sum},
    )


def mesh_program_inputs(mesh, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = mesh.size

    # integer-valued data: every sum is exact in any order
    def ints(*shape):
        return torch.randint(-4, 5, shape, generator=gen).float()

    return {
        "x": ints(3, size),
        "w": ints(size, size),
        "loc": _per_rank(n, lambda r: ints(3, size)),
    }


def megatron_mlp_grad():
    """The backward program coconet.grad derives for a Megatron MLP (column-parallel, gelu,
    row-parallel, biases, residual): matmul_tn, transpose, expand-free sums, one all_reduce."""
    B, K, C = cc.Dim("B"), cc.Dim("K"), cc.Dim("C")
    x = cc.Tensor("x", cc.float32, [B, K], cc.Replicated)
    w1 = cc.Tensor("w1", cc.float32, [K, C], cc.Sliced(1))
    b1 = cc.Tensor("b1", cc.float32, [C], cc.Sliced(0))
    w2 = cc.Tensor("w2", cc.float32, [C, K], cc.Sliced(0))
    b2 = cc.Tensor("b2", cc.float32, [K], cc.Replicated)
    h = cc.gelu(cc.matmul(x, w1) + b1).named("h")
    y = cc.all_reduce(cc.matmul(h, w2), name="y")
    out = (y + b2 + x).named("out")
    forward = cc.Program("mlp", [x, w1, b1, w2, b2], {"out": out})
    return cc.grad(forward, ["x", "w1", "b1", "w2", "b2"], saved=["h"])


def megatron_mlp_grad_inputs(world, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, c, b = size, size + 1, 3
    return {
        "x": torch.randn(b, k, generator=gen),
        "w1": torch.randn(k, c, generator=gen),
        "b1": torch.randn(c, generator=gen),
        "w2": torch.randn(c, k, generator=gen),
        "b2": torch.randn(k, generator=gen),
        "h": torch.randn(b, c, generator=gen),
        "d_out": torch.randn(b, k, generator=gen),
    }


def mesh_program_grad():
    """coconet.grad of a program with sends both ways and a broadcast along tp on a 2x2 mesh:
    the sends' adjoints (a send back and one forward) and the broadcast's (axis_index)."""
    B, H = cc.Dim("B"), cc.Dim("H")
    x = cc.Tensor("x", cc.float32, [B, H], cc.Local)
    r = cc.Tensor("r", cc.float32, [B, H], cc.Replicated("tp"))
    y = cc.send(x * 2.0, axis="pp", name="y")
    z = cc.send(y * r + x, axis="pp", name="z", reverse=True)
    b = cc.broadcast(x * r, root=1, axis="tp", name="b")
    forward = cc.Program("stages", [x, r], {"y": y, "z": z, "b": b})
    return cc.grad(forward, ["x", "r"])


def mesh_program_grad_inputs(mesh, size, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)

    def ints(*shape):  # integer-valued: every sum exact in any order
        return torch.randint(-3, 4, shape, generator=gen).float()

    inputs = {"x": _per_rank(mesh.size, lambda r: ints(3, size)), "r": ints(3, size)}
    for n in mesh_program_grad().inputs:
        if n.name.startswith("d_"):
            inputs[n.name] = ints(3, size)
    return inputs


def norm_alongside():
    """A one-pass unit whose gather is published and a scalar all_reduce after it (the sum of
    squares of the reduced slice, computed in the same pass: a speculative step's norm), which
    runs over the control channel on shared memory."""
    from coconet.schedule import fuse_RS_C_AG

    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    lr = cc.Scalar("lr")
    g_sum = cc.all_reduce(g, name="g_sum")
    norm = cc.sqrt(cc.sum(g_sum * g_sum).named("sumsq")).named("norm")
    p_new = (p - lr * g_sum).named("p_new")
    program = cc.Program("norm_alongside", [g, p, lr], {"norm": norm, "u": cc.update(p, p_new)})
    return fuse_RS_C_AG(program)


PROGRAMS = {
    "norm_alongside": (norm_alongside, fused_mix_inputs),
    "collectives": (collectives, collectives_inputs),
    "prod_and_ints": (prod_and_ints, prod_and_ints_inputs),
    "update_state": (update_state, update_state_inputs),
    "fused_mix": (fused_mix, fused_mix_inputs),
    "user_ops": (user_ops, user_ops_inputs),
    "megatron_mlp_grad": (megatron_mlp_grad, megatron_mlp_grad_inputs),
    "lion": (lion, lion_inputs),
}
