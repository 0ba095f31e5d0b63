"""The schedule primitives one by one: what each does to a small program, what each refuses and
why, and the JSON record that replays them.

The running example is a tiny optimizer step::

    g_sum = all_reduce(g)            m_new = 0.9 * m + g_sum      p_new = p - lr * m_new
    m_norm = norm(m_new)             update(p, p_new), update(m, m_new), return m_norm

Every structural test also runs the scheduled program in the simulator against the original, on
1..4 ranks and sizes the world size does not divide.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable

import pytest
import torch

import coconet as cc
from coconet.ir.group import GroupKind
from coconet.ir.ops import Op
from coconet.schedule import Schedule

N, K = cc.Dim("N"), cc.Dim("K")


def opt() -> cc.Program:
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)
    m = cc.Tensor("m", cc.float32, [N], cc.Replicated)
    lr = cc.Scalar("lr")
    g_sum = cc.all_reduce(g, name="g_sum")
    m_new = (0.9 * m + g_sum).named("m_new")
    p_new = (p - lr * m_new).named("p_new")
    m_norm = cc.norm(m_new).named("m_norm")
    return cc.Program(
        "opt",
        [g, p, m, lr],
        {"m_norm": m_norm, "up": cc.update(p, p_new), "um": cc.update(m, m_new)},
    )


def golden(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def inputs_for(program: cc.Program, world: int, n: int, k: int = 3, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out: dict = {}
    for node in program.inputs:
        shape = [n if s == N else k if s == K else s for s in node.type.shape]
        if node.type.dtype is not cc.float32:
            out[node.name] = 1
        elif node.type.layout.is_local:
            out[node.name] = [torch.randn(shape, generator=gen) for _ in range(world)]
        elif not shape:
            out[node.name] = float(torch.randn((), generator=gen))
        else:
            out[node.name] = torch.randn(shape, generator=gen)
    return out


def assert_same_results(
    original: cc.Program, scheduled: cc.Program, worlds=(1, 2, 3, 4), sizes=(1, 5, 7)
) -> None:
    """Every rank's outputs and every updated input agree (rtol 1e-5: norms re-associate)."""
    for world in worlds:
        for n in sizes:
            ins = inputs_for(original, world, n)
            want = cc.simulate(original, ins, world)
            got = cc.simulate(scheduled, ins, world)
            for name, values in want.outputs.items():
                for r in range(world):
                    torch.testing.assert_close(
                        got.outputs[name][r], values[r], rtol=1e-5, atol=1e-6
                    )
            for name in want.updates:
                torch.testing.assert_close(
                    got.updated(name), want.updated(name), rtol=1e-5, atol=1e-6
                )


def ops(program: cc.Program) -> list[Op]:
    return [n.op for n in program.nodes]


# ---------------------------------------------------------------------------------------------
# before -> after, one primitive at a time

OPT = golden(
    """
    program opt(g: f32[N] Local, p: f32[N] Replicated, m: f32[N] Replicated, lr: f32[] Replicated):
      mul_1 = mul(0.9, m)                   # f32[N] Replicated
      g_sum = all_reduce(g, reduce_op=sum)  # f32[N] Replicated
      m_new = add(mul_1, g_sum)             # f32[N] Replicated
      m_norm = norm(m_new)                  # f32[] Replicated
      mul_2 = mul(lr, m_new)                # f32[N] Replicated
      p_new = sub(p, mul_2)                 # f32[N] Replicated
      update(p, p_new)                      # f32[N] Replicated
      update(m, m_new)                      # f32[N] Replicated
      return m_norm
    """
)


def test_the_example_program():
    assert str(opt()) == OPT


def test_split():
    s = Schedule(opt())
    assert s.split("g_sum") == ("g_sum_rs", "g_sum")
    assert str(s.program) == golden(
        """
        program opt(g: f32[N] Local, p: f32[N] Replicated, m: f32[N] Replicated, lr: f32[] Replicated):
          mul_1 = mul(0.9, m)                                 # f32[N] Replicated
          g_sum_rs = reduce_scatter(g, dim=0, reduce_op=sum)  # f32[N] Sliced(dim=0)
          g_sum = all_gather(g_sum_rs)                        # f32[N] Replicated
          m_new = add(mul_1, g_sum)                           # f32[N] Replicated
          m_norm = norm(m_new)                                # f32[] Replicated
          mul_2 = mul(lr, m_new)                              # f32[N] Replicated
          p_new = sub(p, mul_2)                               # f32[N] Replicated
          update(p, p_new)                                    # f32[N] Replicated
          update(m, m_new)                                    # f32[N] Replicated
          return m_norm
        """  # noqa: E501
    )
    prog = s.program
    assert Op.ALL_REDUCE not in ops(prog)
    rs, ag = prog.node("g_sum_rs"), prog.node("g_sum")
    assert rs.op is Op.REDUCE_SCATTER and rs.inputs == (prog.input("g"),)
    assert rs.type.layout == cc.Sliced(0) and rs.attr("reduce_op") is cc.ReduceOp.SUM
    # The all_gather keeps the all_reduce's name, and its users read it unchanged.
    assert ag.op is Op.ALL_GATHER and ag.inputs == (rs,) and ag.type == opt().node("g_sum").type
    assert prog.node("m_new").inputs[1] is ag
    assert [str(st) for st in s.steps] == ["split(g_sum)"]
    assert_same_results(opt(), prog)


REORDERED = golden(
    """
    program opt(g: f32[N] Local, p: f32[N] Replicated, m: f32[N] Replicated, lr: f32[] Replicated):
      m_slice = scatter(m, dim=0)                               # f32[N] Sliced(dim=0)
      mul_1_slice = mul(0.9, m_slice)                           # f32[N] Sliced(dim=0)
      g_sum_rs = reduce_scatter(g, dim=0, reduce_op=sum)        # f32[N] Sliced(dim=0)
      m_new_slice = add(mul_1_slice, g_sum_rs)                  # f32[N] Sliced(dim=0)
      m_norm_sq = mul(m_new_slice, m_new_slice)                 # f32[N] Sliced(dim=0)
      m_norm_partial = sum(m_norm_sq)                           # f32[] Local
      m_norm_sumsq = all_reduce(m_norm_partial, reduce_op=sum)  # f32[] Replicated
      m_norm = sqrt(m_norm_sumsq)                               # f32[] Replicated
      p_slice = scatter(p, dim=0)                               # f32[N] Sliced(dim=0)
      mul_2_slice = mul(lr, m_new_slice)                        # f32[N] Sliced(dim=0)
      p_new_slice = sub(p_slice, mul_2_slice)                   # f32[N] Sliced(dim=0)
      p_new = all_gather(p_new_slice)                           # f32[N] Replicated
      update(p, p_new)                                          # f32[N] Replicated
      m_new = all_gather(m_new_slice)                           # f32[N] Replicated
      update(m, m_new)                                          # f32[N] Replicated
      return m_norm
    """
)


def reordered() -> Schedule:
    s = Schedule(opt())
    _, ag = s.split("g_sum")
    s.reorder(s.computations(ag), ag)
    return s


def test_reorder():
    s = Schedule(opt())
    _, ag = s.split("g_sum")
    assert s.computations(ag) == ["mul_1", "m_new", "m_norm", "mul_2", "p_new"]
    s.reorder(s.computations(ag), ag)
    assert str(s.program) == REORDERED
    prog = s.program
    # The computations read the reduce_scatter's output and scatter(...) of replicated inputs.
    assert prog.node("m_new_slice").inputs[1] is prog.node("g_sum_rs")
    for name, source in (("m_slice", "m"), ("p_slice", "p")):
        n = prog.node(name)
        assert n.op is Op.SCATTER and n.inputs == (prog.input(source),)
    assert prog.node("mul_1_slice").inputs[1] is prog.node("m_slice")
    # The gradient is never gathered: no user is left for the split's all_gather.
    assert "g_sum" not in {n.name for n in prog.nodes}
    # Updates of replicated tensors become update(all_gather(slice)), under the old names.
    new = {u.inputs[0].name: u.inputs[1] for u in prog.updates}
    assert new["p"].op is Op.ALL_GATHER and new["p"].name == "p_new"
    assert new["p"].inputs[0] is prog.node("p_new_slice")
    assert new["m"].op is Op.ALL_GATHER and new["m"].inputs[0] is prog.node("m_new_slice")
    # norm(x) became sqrt(all_reduce(sum(x * x))) on slices: the norm gathers nothing.
    norm = prog.node("m_norm")
    assert norm.op is Op.SQRT
    (ar,) = norm.inputs
    assert ar.op is Op.ALL_REDUCE and ar.type.rank == 0
    (part,) = ar.inputs
    assert part.op is Op.SUM and part.type.layout.is_local
    (sq,) = part.inputs
    assert sq.op is Op.MUL and sq.inputs == (prog.node("m_new_slice"),) * 2
    assert Op.NORM not in ops(prog)
    assert_same_results(opt(), prog)


def test_reorder_of_a_subset_gathers_what_is_still_read_whole():
    s = Schedule(opt())
    _, ag = s.split("g_sum")
    s.reorder(["m_new"], ag)
    prog = s.program
    # mul_1 stays whole and is scattered for m_new_slice; m_new is gathered for its whole users.
    assert prog.node("mul_1").type.layout == cc.Replicated
    assert prog.node("m_new_slice").inputs[0].op is Op.SCATTER
    m_new = prog.node("m_new")
    assert m_new.op is Op.ALL_GATHER
    assert prog.node("m_norm").inputs == (m_new,) and prog.node("m_norm").op is Op.NORM
    assert_same_results(opt(), prog)


def clipped_two_grads() -> cc.Program:
    """Momentum-free SGD of two tensors clipped by their global norm (as clip_grad_norm_)."""
    g1 = cc.Tensor("g1", cc.float32, [N], cc.Local)
    g2 = cc.Tensor("g2", cc.float32, [K], cc.Local)
    p1 = cc.Tensor("p1", cc.float32, [N], cc.Replicated)
    p2 = cc.Tensor("p2", cc.float32, [K], cc.Replicated)
    lr, max_norm = cc.Scalar("lr"), cc.Scalar("max_norm")
    s1, s2 = cc.all_reduce(g1, name="s1"), cc.all_reduce(g2, name="s2")
    total = cc.sqrt(cc.sum(s1 * s1) + cc.sum(s2 * s2)).named("total")
    coef = cc.minimum(max_norm / (total + 1e-6), 1.0).named("coef")
    p1n = (p1 - lr * coef * s1).named("p1n")
    p2n = (p2 - lr * coef * s2).named("p2n")
    return cc.Program(
        "clip", [g1, g2, p1, p2, lr, max_norm], [cc.update(p1, p1n), cc.update(p2, p2n)]
    )


def test_reorder_each_all_gather_of_two_gradients_joined_by_a_global_norm(tmp_path):
    """The README's recipe for each all_reduce in turn (issue 12, bug 2): once the first reorder
    has moved p1n onto slices, the second all_gather's computations() lists only what is still
    whole, and check_reorder refuses the values already on slices, saying so."""
    s = Schedule(clipped_two_grads())
    rs1, ag1 = s.split("s1")
    rs2, ag2 = s.split("s2")
    s.reorder(s.computations(ag1), ag1)
    assert s.program.node("p1n_slice").type.layout.is_sliced
    comps = s.computations(ag2)
    assert "p1n_slice" not in comps and "mul_4_slice" not in comps
    assert {"p2n", "coef", "total"} <= set(comps)
    with pytest.raises(cc.ScheduleError) as info:
        s.reorder([*comps, "mul_4_slice", "p1n_slice"], ag2)
    assert (
        "reorder: mul_4_slice (Sliced(dim=0)), p1n_slice (Sliced(dim=0)) are not whole "
        "(Replicated) and already run on slices or per rank" in str(info.value)
    )
    assert "s.computations('s2') lists only the values that can move" in info.value.hint
    s.reorder(comps, ag2)
    prog = s.program
    # Both updates run on slices; the global norm adds partial sums of squares (no gather).
    for p in ("p1n", "p2n"):
        assert prog.node(p).op is Op.ALL_GATHER and prog.node(p).inputs[0].type.layout.is_sliced
    assert [n.name for n in prog.nodes if n.op is Op.ALL_GATHER] == ["p1n", "p2n"]
    assert_same_results(clipped_two_grads(), prog, sizes=(1, 5, 8))
    s.as_slice(["p1", "p2"])  # ZeRO: each rank keeps only its slice of both parameters
    assert not [n for n in s.program.nodes if n.op is Op.ALL_GATHER]
    assert "def step(" in cc.compile(s, world=2, cache_dir=tmp_path).source


def test_as_slice():
    s = reordered()
    s.as_slice("m")
    assert str(s.program) == golden(
        """
        program opt(g: f32[N] Local, p: f32[N] Replicated, m: f32[N] Sliced(dim=0), lr: f32[] Replicated):
          mul_1_slice = mul(0.9, m)                                 # f32[N] Sliced(dim=0)
          g_sum_rs = reduce_scatter(g, dim=0, reduce_op=sum)        # f32[N] Sliced(dim=0)
          m_new_slice = add(mul_1_slice, g_sum_rs)                  # f32[N] Sliced(dim=0)
          m_norm_sq = mul(m_new_slice, m_new_slice)                 # f32[N] Sliced(dim=0)
          m_norm_partial = sum(m_norm_sq)                           # f32[] Local
          m_norm_sumsq = all_reduce(m_norm_partial, reduce_op=sum)  # f32[] Replicated
          m_norm = sqrt(m_norm_sumsq)                               # f32[] Replicated
          p_slice = scatter(p, dim=0)                               # f32[N] Sliced(dim=0)
          mul_2_slice = mul(lr, m_new_slice)                        # f32[N] Sliced(dim=0)
          p_new_slice = sub(p_slice, mul_2_slice)                   # f32[N] Sliced(dim=0)
          p_new = all_gather(p_new_slice)                           # f32[N] Replicated
          update(p, p_new)                                          # f32[N] Replicated
          update(m, m_new_slice)                                    # f32[N] Sliced(dim=0)
          return m_norm
        """  # noqa: E501
    )
    prog = s.program
    m = prog.input("m")
    assert m.type.layout == cc.Sliced(0)
    assert not [n for n in prog.nodes if n.op is Op.SCATTER and n.inputs[0] is m]
    assert "m_slice" not in {n.name for n in prog.nodes}
    # The all_gather of m's new value is gone: m keeps its slice.
    assert "m_new" not in {n.name for n in prog.nodes}
    (um,) = [u for u in prog.updates if u.inputs[0] is m]
    assert um.inputs[1] is prog.node("m_new_slice")
    # p is untouched.
    assert prog.input("p").type.layout == cc.Replicated
    assert_same_results(opt(), prog)


def test_as_slice_after_split_alone_when_the_state_is_only_overwritten():
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    z = cc.Tensor("z", cc.float32, [N], cc.Replicated)
    g_sum = cc.all_reduce(g, name="g_sum")
    prog = cc.Program("copy", [g, z], [cc.update(z, g_sum)])
    s = Schedule(prog)
    s.split("g_sum")
    s.as_slice(["z"])
    assert s.program.input("z").type.layout == cc.Sliced(0)
    assert s.program.updates[0].inputs[1].name == "g_sum_rs"
    assert Op.ALL_GATHER not in ops(s.program)
    assert_same_results(prog, s.program)


def _nodes_only(program: cc.Program) -> str:
    return "\n".join(line for line in str(program).splitlines() if "# schedule:" not in line)


def test_fuse():
    s = Schedule(opt())
    s.fuse(["p_new", "mul_1", "m_new", "mul_2"])  # any order: kept in program order
    assert str(s.program) == OPT + "\n  # schedule: fuse(mul_1, m_new, mul_2, p_new)"
    assert _nodes_only(s.program) == OPT
    (group,) = s.program.groups
    assert group.kind is GroupKind.FUSE and group.members == ("mul_1", "m_new", "mul_2", "p_new")
    assert [str(st) for st in s.steps] == ["fuse([p_new, mul_1, m_new, mul_2])"]  # as written
    assert_same_results(opt(), s.program)


def test_fuse_a_collective_with_its_computation():
    s = reordered()
    s.fuse(["g_sum_rs", "mul_1_slice", "m_new_slice", "mul_2_slice", "p_new_slice", "p_new"])
    assert _nodes_only(s.program) == REORDERED
    assert str(s.program).endswith(
        "  # schedule: fuse(mul_1_slice, g_sum_rs, m_new_slice, mul_2_slice, p_new_slice, p_new)"
    )


def test_overlap():
    s = Schedule(opt())
    s.overlap(["g_sum", "m_new", "mul_2", "p_new"], chunks=3)
    assert str(s.program) == OPT + "\n  # schedule: overlap(g_sum, m_new, mul_2, p_new, chunks=3)"
    (group,) = s.program.groups
    assert group.kind is GroupKind.OVERLAP and group.chunks == 3
    assert [str(st) for st in s.steps] == ["overlap([g_sum, m_new, mul_2, p_new], chunks=3)"]
    assert_same_results(opt(), s.program, sizes=(1, 2, 5, 7, 9))


# ---------------------------------------------------------------------------------------------
# regressions: chunked chains next to sliced values, broadcast state, broken groups


def test_overlap_of_a_gather_whose_reduce_scatter_stays_outside():
    """The chunk of a whole value is the union of part c of every rank's block when the chain
    reads a value sliced on rows from outside (here the reduce_scatter before the all_gather)."""
    s = Schedule(opt())
    s.split("g_sum")
    s.overlap(["g_sum", "m_new", "mul_2", "p_new"], chunks=2)
    assert_same_results(opt(), s.program, sizes=(1, 2, 5, 7, 9))


def test_split_after_overlap_keeps_the_chain_chunked_correctly():
    s = Schedule(opt())
    s.overlap(["g_sum", "m_new", "mul_2", "p_new"], chunks=4)
    s.split("g_sum")
    assert s.program.groups[0].members == ("g_sum", "m_new", "mul_2", "p_new")
    assert s.program.node("g_sum").op is Op.ALL_GATHER
    assert_same_results(opt(), s.program, sizes=(1, 2, 5, 7, 9))


def test_overlap_of_a_reduction_that_keeps_the_rows():
    """sum(g[K, N], dim=1) is [K]: its operand is cut in chunks of rows though the ranks differ."""
    g = cc.Tensor("g", cc.float32, [K, N], cc.Local)
    r = cc.sum(g, 1).named("r")
    t = cc.all_reduce(r, name="t")
    prog = cc.Program("rows", [g], {"out": (t * 2.0).named("out")})
    s = Schedule(prog)
    s.overlap(["r", "t", "out"], chunks=2)
    for world in (1, 2, 3):
        ins = inputs_for(prog, world, 4, k=5)
        want = cc.simulate(prog, ins, world).outputs["out"]
        got = cc.simulate(s.program, ins, world).outputs["out"]
        for r_ in range(world):
            torch.testing.assert_close(got[r_], want[r_], rtol=1e-5, atol=1e-6)


def _bias_gelu() -> cc.Program:
    B, H = cc.Dim("B"), cc.Dim("H")
    part = cc.Tensor("part", cc.float32, [B, H], cc.Local)
    b = cc.Tensor("b", cc.float32, [H], cc.Replicated)
    y = (cc.all_reduce(part, name="y_sum") + b).named("y")
    return cc.Program("p", [part, b], {"out": cc.gelu(y).named("out")})


@pytest.mark.parametrize("fuse_first", [False, True])
def test_a_fuse_group_partly_inside_an_overlapped_chain_is_refused_when_written(
    fuse_first, tmp_path
):
    """What the checks accept, the compiler compiles (issue 12, bug 1): the group that only
    ``coconet.compile`` used to refuse is refused by the schedule primitive, in either order,
    and the legal neighbours (the group wholly inside or wholly outside the chain) compile."""
    s = Schedule(_bias_gelu())
    steps = [lambda: s.overlap(["y_sum", "y"], chunks=2), lambda: s.fuse(["y", "out"])]
    if fuse_first:
        steps.reverse()
    steps[0]()
    with pytest.raises(cc.ScheduleError, match="lies partly inside the overlapped chain"):
        steps[1]()
    assert len(s.steps) == 1
    inside = Schedule(_bias_gelu())
    inside.overlap(["y_sum", "y", "out"], chunks=2)
    inside.fuse(["y", "out"])
    outside = Schedule(_bias_gelu())
    outside.overlap(["y_sum", "y"], chunks=2)
    outside.fuse(["out"])
    for legal in (inside, outside):
        step = cc.compile(legal, world=2, cache_dir=tmp_path, fused_kernels=False)
        assert "def step(" in step.source


# ---------------------------------------------------------------------------------------------
# illegal applications: a ScheduleError saying why, and the schedule left as it was


def refused(s: Schedule, apply: Callable[[Schedule], object], *fragments: str) -> str:
    program, steps = s.program, list(s.steps)
    with pytest.raises(cc.ScheduleError) as info:
        apply(s)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in:\n{msg}"
    assert s.program is program and s.steps == steps
    return msg


def two_grads() -> cc.Program:
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    h = cc.Tensor("h", cc.float32, [N], cc.Local)
    a = cc.all_reduce(g, name="a")
    b = cc.all_reduce(h, name="b")
    return cc.Program("two", [g, h], {"c": (a + 1.0).named("c"), "d": (b * 2.0).named("d")})


def tensor_parallel() -> cc.Program:
    B, H, H2 = cc.Dim("B"), cc.Dim("H"), cc.Dim("H2")
    x = cc.Tensor("x", cc.float32, [B, H], cc.Sliced(1))
    w = cc.Tensor("w", cc.float32, [H, H2], cc.Sliced(0))
    b = cc.Tensor("b", cc.float32, [H2], cc.Replicated)
    partial = cc.matmul(x, w).named("partial")
    out_sum = cc.all_reduce(partial, name="out_sum")
    return cc.Program("tp", [x, w, b], {"y": (out_sum + b).named("y")})


def with_local_read() -> cc.Program:
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    g_sum = cc.all_reduce(g, name="g_sum")
    return cc.Program("loc", [g], {"y": (g_sum + g).named("y")})


def with_overwritten_state() -> cc.Program:
    """z gets a value computed whole; x[K, N] gets a value of shape [N], broadcast over K."""
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    z = cc.Tensor("z", cc.float32, [N], cc.Replicated)
    x = cc.Tensor("x", cc.float32, [K, N], cc.Replicated)
    g_sum = cc.all_reduce(g, name="g_sum")
    v = cc.relu(g_sum).named("v")
    return cc.Program("ow", [g, z, x], [cc.update(z, g_sum * 2.0), cc.update(x, v)])


def one_row() -> cc.Program:
    h = cc.Tensor("h", cc.float32, [1], cc.Local)
    t = cc.all_reduce(h, name="t")
    return cc.Program("one", [h], {"u": (t + 1.0).named("u")})


def _split(s: Schedule) -> Schedule:
    s.split("g_sum")
    return s


def _as_sliced_m(s: Schedule) -> Schedule:
    s.as_slice("m")
    return s


def _fused_m_new(s: Schedule) -> Schedule:
    s.fuse(["m_new"])
    return s


def _overlapped(s: Schedule) -> Schedule:
    s.overlap(["g_sum", "m_new"], chunks=2)
    return s


def _fused_m_new_mul_2(s: Schedule) -> Schedule:
    s.fuse(["m_new", "mul_2"])
    return s


def _overlapped_split_chain(s: Schedule) -> Schedule:
    s.split("g_sum")
    s.overlap(["g_sum_rs", "g_sum", "m_new", "mul_2", "p_new"], chunks=2)
    return s


# (id, program, set-up, the illegal application, fragments its message must contain)
ILLEGAL = [
    # split
    ("split-not-an-all_reduce", opt, None, lambda s: s.split("m_new"),
     ["split: ", "m_new is an add, not an all_reduce"]),
    ("split-scalar", reordered, None, lambda s: s.split("m_norm_sumsq"),
     ["m_norm_sumsq is a scalar all_reduce: there is nothing to slice"]),
    ("split-dim-out-of-range", opt, None, lambda s: s.split("g_sum", dim=1),
     ["dim=1 is out of range"]),
    ("split-dim-not-int", opt, None, lambda s: s.split("g_sum", dim="0"),
     ["split's dim must be an int"]),
    ("split-unknown-value", opt, None, lambda s: s.split("nope"),
     ["has no value named 'nope'"]),
    ("split-already-split", reordered, None, lambda s: s.split("p_new"),
     ["p_new is an all_gather, not an all_reduce"]),
    # reorder
    ("reorder-onto-all_reduce", opt, None, lambda s: s.reorder(["m_new"], "g_sum"),
     ["reorder: ", "g_sum is an all_reduce, not an all_gather", "split(...) the all_reduce first"]),
    ("reorder-onto-computation", opt, _split, lambda s: s.reorder(["mul_2"], "m_new"),
     ["m_new is an add, not an all_gather"]),
    ("reorder-a-matmul", tensor_parallel, lambda s: (s.split("out_sum"), s)[1],
     lambda s: s.reorder(["partial", "y"], "out_sum"),
     ["partial is a matmul; only pointwise computations, reductions and sends can run on slices"]),
    ("reorder-a-collective", opt, _split, lambda s: s.reorder(["g_sum_rs", "m_new"], "g_sum"),
     ["g_sum_rs is a reduce_scatter"]),
    ("reorder-not-reading-it", opt, _split, lambda s: s.reorder(["mul_1"], "g_sum"),
     ["none of the computations reads g_sum"]),
    ("reorder-reading-a-local", with_local_read, lambda s: (s.split("g_sum"), s)[1],
     lambda s: s.reorder(["y"], "g_sum"), ["y reads the Local value g"]),
    ("reorder-nothing", opt, _split, lambda s: s.reorder([], "g_sum"),
     ["no computations to reorder"]),
    ("reorder-breaks-an-overlap", opt, _overlapped_split_chain,
     lambda s: s.reorder(s.computations("g_sum"), "g_sum"),
     ["reorder: the rewrite would break overlap(g_sum_rs, g_sum, m_new, mul_2, p_new, chunks=2)"]),
    # as_slice
    ("as_slice-not-an-input", reordered, None, lambda s: s.as_slice("m_new"),
     ["as_slice: ", "m_new is computed by all_gather, not a program input"]),
    ("as_slice-read-whole", opt, None, lambda s: s.as_slice("m"),
     ["mul_1 (mul) reads m whole", "reorder mul_1 onto slices first"]),
    ("as_slice-already-sliced", reordered, _as_sliced_m, lambda s: s.as_slice("m"),
     ["m is Sliced(dim=0), not Replicated"]),
    ("as_slice-scalar-input", reordered, None, lambda s: s.as_slice("lr"),
     ["mul_2_slice (mul) reads lr whole"]),
    ("as_slice-computed-whole", with_overwritten_state, None, lambda s: s.as_slice("z"),
     ["the new value of z (mul_1) is computed whole, not gathered from slices"]),
    ("as_slice-broadcast-update", with_overwritten_state,
     lambda s: (s.split("g_sum"), s.reorder(["v"], "g_sum"), s)[2], lambda s: s.as_slice("x"),
     ["the new value of x (v: f32[N] Replicated) is broadcast to x's shape [K, N]"]),
    ("as_slice-nothing", opt, None, lambda s: s.as_slice([]), ["no tensors to slice"]),
    # fuse
    ("fuse-two-all_reduces", two_grads, None, lambda s: s.fuse(["a", "b", "c", "d"]),
     ["fuse: ", "two collectives (a, b) cannot be fused"]),
    ("fuse-cycle", opt, None, lambda s: s.fuse(["g_sum", "m_norm"]),
     ["m_new is outside the group, reads the group's results and feeds m_norm",
      "the group would depend on itself"]),
    ("fuse-already-fused", opt, _fused_m_new, lambda s: s.fuse(["m_new", "mul_2"]),
     ["m_new already belongs to fuse(m_new)"]),
    ("fuse-an-input", opt, None, lambda s: s.fuse(["m", "mul_1"]),
     ["m is an input: only computations and communication can be grouped"]),
    ("fuse-two-gathers", reordered, None, lambda s: s.fuse(["p_new", "m_new"]),
     ["2 all_gathers (p_new, m_new) with no collective feeding them"]),
    ("fuse-independent-gather", reordered, None,
     lambda s: s.fuse(["m_norm_partial", "m_norm_sumsq", "m_norm", "p_new"]),
     ["p_new gathers a value that does not come from m_norm_sumsq"]),
    ("fuse-nothing", opt, None, lambda s: s.fuse([]), ["no nodes given"]),
    # overlap
    ("overlap-one-chunk", opt, None, lambda s: s.overlap(["g_sum", "m_new"], chunks=1),
     ["overlap: ", "chunks must be an int >= 2, got 1"]),
    ("overlap-bool-chunks", opt, None, lambda s: s.overlap(["g_sum", "m_new"], chunks=True),
     ["chunks must be an int >= 2, got True"]),
    ("overlap-no-communication", opt, None, lambda s: s.overlap(["m_new", "mul_2", "p_new"]),
     ["the chain has no communication: there is nothing to overlap"]),
    ("overlap-reduction-over-rows", opt, None,
     lambda s: s.overlap(["g_sum", "m_new", "m_norm"]),
     ["m_norm cannot run in chunks of rows"]),
    ("overlap-not-a-chain", opt, None, lambda s: s.overlap(["mul_1", "g_sum"]),
     ["g_sum reads nothing from the rest of the chain: it is not a consumer"]),
    ("overlap-cycle", opt, None, lambda s: s.overlap(["g_sum", "p_new"]),
     ["mul_2 is outside the group, reads the group's results and feeds p_new"]),
    ("overlap-single-node", opt, None, lambda s: s.overlap(["g_sum"]),
     ["overlap needs a chain of at least two nodes"]),
    ("overlap-twice", opt, _overlapped, lambda s: s.overlap(["g_sum", "m_new", "mul_2"]),
     ["overlap(g_sum, m_new, chunks=2) already overlaps some of these nodes"]),
    ("overlap-one-row", one_row, None, lambda s: s.overlap(["t", "u"], chunks=2),
     ["t has a single row", "nothing to cut into chunks"]),
    ("overlap-an-update", opt, None, lambda s: s.overlap(["g_sum", "update_1"]),
     ["update_1 is an update: only computations and communication can be grouped"]),
    # a fused kernel cannot run both chunk by chunk and once (issue 12, bug 1), in either order
    ("fuse-partly-overlapped", opt, _overlapped, lambda s: s.fuse(["m_new", "mul_2"]),
     ["fuse: fuse(m_new, mul_2) lies partly inside the overlapped chain overlap(g_sum, m_new): "
      "m_new inside, mul_2 outside"]),
    ("overlap-partly-fused", opt, _fused_m_new_mul_2,
     lambda s: s.overlap(["g_sum", "m_new"], chunks=2),
     ["overlap: fuse(m_new, mul_2) lies partly inside the overlapped chain overlap(g_sum, m_new)"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "make,setup,apply,fragments", [case[1:] for case in ILLEGAL], ids=[c[0] for c in ILLEGAL]
)
def test_illegal(make, setup, apply, fragments):
    made = make()  # a program, or a schedule already under way
    s = made if isinstance(made, Schedule) else Schedule(made)
    if setup is not None:
        s = setup(s)
    refused(s, apply, *fragments)


def test_enough_illegal_cases_per_primitive():
    per = {p: sum(c[0].startswith(p + "-") for c in ILLEGAL) for p in
           ("split", "reorder", "as_slice", "fuse", "overlap")}  # fmt: skip
    assert all(n >= 2 for n in per.values()), per
    assert len(ILLEGAL) >= 10


def test_a_refused_primitive_leaves_the_schedule_usable():
    s = reordered()
    before = str(s.program)
    refused(s, lambda s: s.fuse(["p_new", "m_new"]), "all_gathers")
    s.as_slice("m")  # the schedule goes on from where it was
    assert str(s.program) != before and len(s.steps) == 3


def test_check_functions_do_not_touch_the_program():
    from coconet.schedule import check_as_slice, check_fuse, check_overlap, check_reorder

    prog = opt()
    text = str(prog)
    with pytest.raises(cc.ScheduleError):
        check_as_slice(prog, ["m"])
    with pytest.raises(cc.ScheduleError):
        check_reorder(prog, ["m_new"], "g_sum")
    assert [n.name for n in check_fuse(prog, ["mul_2", "m_new"])] == ["m_new", "mul_2"]
    assert len(check_overlap(prog, ["g_sum", "m_new"], 2)) == 2
    assert str(prog) == text and prog.groups == ()


# ---------------------------------------------------------------------------------------------
# JSON: record, replay, refuse


def _sched_split() -> Schedule:
    return _split(Schedule(opt()))


def _sched_as_slice() -> Schedule:
    s = reordered()
    s.as_slice(["m"])
    return s


def _sched_fuse() -> Schedule:
    s = reordered()
    s.fuse(["g_sum_rs", "mul_1_slice", "m_new_slice", "mul_2_slice", "p_new_slice", "p_new"])
    return s


def _sched_overlap() -> Schedule:
    s = Schedule(opt())
    s.split("g_sum")
    s.overlap(["g_sum", "m_new", "mul_2", "p_new"], chunks=3)
    return s


SCHEDULES = {
    "split": _sched_split,
    "reorder": reordered,
    "as_slice": _sched_as_slice,
    "fuse": _sched_fuse,
    "overlap": _sched_overlap,
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_json_replays_every_primitive(name):
    s = SCHEDULES[name]()
    assert any(st.primitive.value == name for st in s.steps)
    text = s.to_json()
    doc = json.loads(text)
    assert doc["format"] == "coconet.schedule/1" and doc["program"] == "opt"
    # Replay onto a freshly built (equal, not identical) program.
    again = Schedule.from_json(opt(), text)
    assert again.program == s.program and str(again.program) == str(s.program)
    assert again.steps == s.steps and str(again) == str(s)
    assert again.digest == s.digest
    assert again.to_json() == text


def test_json_records_split_dim_and_overlap_chunks():
    g = cc.Tensor("g", cc.float32, [K, N], cc.Local)
    prog = cc.Program("mat", [g], {"y": (cc.all_reduce(g, name="g_sum") * 2.0).named("y")})
    s = Schedule(prog)
    s.split("g_sum", dim=1)
    doc = json.loads(s.to_json())
    assert doc["steps"] == [{"primitive": "split", "nodes": ["g_sum"], "dim": 1}]
    again = Schedule.from_json(prog, s.to_json())
    assert again.program.node("g_sum_rs").type.layout == cc.Sliced(1)
    assert again.program == s.program
    doc = json.loads(_sched_overlap().to_json())
    assert doc["steps"] == [
        {"primitive": "split", "nodes": ["g_sum"]},
        {"primitive": "overlap", "nodes": ["g_sum", "m_new", "mul_2", "p_new"], "chunks": 3},
    ]
    assert Schedule.from_json(opt(), json.dumps(doc)).program.groups[0].chunks == 3


def test_json_onto_another_program_is_refused():
    text = reordered().to_json()
    with pytest.raises(cc.ScheduleError, match="recorded on another program"):
        Schedule.from_json(two_grads(), text)
    # Same name and shape of text, other structure: the digest tells them apart.
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    other = cc.Program("opt", [g], {"y": cc.all_reduce(g, name="g_sum")})
    with pytest.raises(cc.ScheduleError, match="recorded on another program"):
        Schedule.from_json(other, text)


def _doc(**changes) -> str:
    doc = json.loads(reordered().to_json())
    doc.update(changes)
    return json.dumps(doc)


CORRUPT = {
    "not-json": ("{not json", "not a schedule JSON document"),
    "truncated": (reordered().to_json()[:-20], "not a schedule JSON document"),
    "a-list": ("[1, 2]", "not a coconet.schedule/1 document"),
    "wrong-format": (_doc(format="coconet.schedule/0"), "not a coconet.schedule/1 document"),
    "steps-not-a-list": (_doc(steps="split"), "steps must be a list"),
    "step-not-an-object": (_doc(steps=[7]), "unknown schedule step 7"),
    "unknown-primitive": (_doc(steps=[{"primitive": "tile", "nodes": ["g_sum"]}]),
                          "unknown schedule step"),
    "no-primitive": (_doc(steps=[{"nodes": ["g_sum"]}]), "unknown schedule step"),
    "nodes-not-a-list": (_doc(steps=[{"primitive": "split", "nodes": "g_sum"}]),
                         "nodes must be a list of value names"),
    "split-without-node": (_doc(steps=[{"primitive": "split", "nodes": []}]),
                           "split takes exactly one all_reduce"),
    "dim-not-int": (_doc(steps=[{"primitive": "split", "nodes": ["g_sum"], "dim": "0"}]),
                    "dim must be a int"),
    "chunks-not-int": (_doc(steps=[{"primitive": "overlap", "nodes": ["g_sum", "m_new"],
                                    "chunks": 2.5}]), "chunks must be a int"),
    "unknown-node": (_doc(steps=[{"primitive": "split", "nodes": ["h_sum"]}]),
                     "no value named 'h_sum'"),
    "illegal-step": (_doc(steps=[{"primitive": "reorder", "nodes": ["m_new"], "target": "g_sum"}]),
                     "g_sum is an all_reduce, not an all_gather"),
    "digest-mismatch": (_doc(program_digest="0" * 16), "recorded on another program"),
}  # fmt: skip


@pytest.mark.parametrize("key", sorted(CORRUPT))
def test_json_corrupted_document_is_refused(key):
    text, fragment = CORRUPT[key]
    with pytest.raises(cc.ScheduleError) as info:
        Schedule.from_json(opt(), text)
    assert fragment in str(info.value)
