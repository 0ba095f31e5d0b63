"""The code generator without processes: generated source, names, kernels, errors, caching.

(These need no ranks; they live with the distributed tier because they test the same compiler.)
"""

from __future__ import annotations

import ast

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from support import dist_programs
from support.examples_loader import load_example

import coconet as cc
from coconet.cache import keyed_cache_dir
from coconet.codegen import Namer, bind_sizes, geometry, lower
from coconet.codegen.plan import Kernel, Start, Wait
from coconet.ir.group import Group, GroupKind
from coconet.ir.ops import POINTWISE
from coconet.ir.program import Program


def _sgd():
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    w = cc.Tensor("w", cc.float32, [N], cc.Replicated)
    lr = cc.Scalar("lr")
    g_sum = cc.all_reduce(g, name="g_sum")
    return cc.Program("sgd", [g, w, lr], [cc.update(w, w - lr * g_sum)])


def test_source_is_valid_python_with_a_comment_per_op():
    prog = _sgd()
    src = cc.compile(prog, world=2).source
    ast.parse(src)
    for n in prog.nodes:
        if n.op.value not in ("input", "const"):
            assert f"# {prog.format_node(n)}  at " in src, prog.format_node(n)
    assert "g_sum_work = comm.all_reduce_start(g, ReduceOp.SUM, axis=None" in src
    assert "g_sum = comm.wait(g_sum_work)" in src
    assert "return {}, {'w': sub_1}" in src


def test_names_never_collide_with_keywords_builtins_or_helpers():
    N = cc.Dim("N")
    names = ["lambda", "int", "torch", "comm", "_x", "env", "kernels", "step", "sum"]
    ts = [cc.Tensor(n, cc.float32, [N], cc.Replicated) for n in names]
    acc = ts[0]
    for t in ts[1:]:
        acc = acc + t
    prog = cc.Program("names", ts, {"out": acc})
    src = cc.compile(prog, world=1).source
    tree = ast.parse(src)
    step = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "step")
    params = [a.arg for a in step.args.args]
    assert params[:3] == ["comm", "env", "kernels"]
    assert len(set(params)) == len(params)
    assert "lambda_" in params and "int_" in params and "torch_" in params and "v_x" in params


def test_namer():
    n = Namer()
    assert n.claim("x") == "x"
    assert n.claim("x") == "x_"
    assert n.claim("x") == "x_2"
    assert n.claim("print") == "print_"
    assert n.claim("_hidden") == "v_hidden"


def test_fused_group_with_collectives_is_one_kernel_between_them():
    s = dist_programs.fused_mix()
    plan = lower(s.program)
    kinds = [type(step).__name__ for step in plan.steps]
    assert kinds.count("Kernel") == 3
    starts = [step for step in plan.steps if isinstance(step, Start)]
    assert [st.node.name for st in starts] == ["rs", "ag"]
    middle = plan.kernels[1]
    assert isinstance(middle, Kernel) and [o.name for o in middle.outputs] == ["upd"]


def test_adam_fuse_rs_c_ag_has_a_single_kernel():
    adam = load_example("adam")
    s = adam.SCHEDULES["fuse_RS_C_AG"](adam.program())
    plan = lower(s.program)
    assert len(plan.kernels) == 1
    order = [type(step).__name__ for step in plan.steps]
    assert order.index("Kernel") > order.index("Start")  # after the reduce_scatter


def test_waits_come_just_before_first_use():
    N = cc.Dim("N")
    a = cc.Tensor("a", cc.float32, [N], cc.Local)
    b = cc.Tensor("b", cc.float32, [N], cc.Local)
    sa = cc.all_reduce(a, name="sa")
    sb = cc.all_reduce(b, name="sb")
    prog = cc.Program("two", [a, b], {"out": (sa + 1.0) * sb})
    steps = lower(prog).steps
    labels = [(type(s).__name__, getattr(s, "node", None) and s.node.name) for s in steps]
    assert labels[:2] == [("Start", "sa"), ("Start", "sb")]  # both in flight at once
    assert labels.index(("Wait", "sb")) > labels.index(("Wait", "sa"))
    assert isinstance(steps[-1], Wait) or labels[-1][1] == "out"


def test_overlap_groups_become_pipelined_chunk_loops():
    tp = load_example("tensor_parallel")
    sched = tp.SCHEDULES["ol_MM_fuse_RS_C_AG"](tp.program(), chunks=3)
    (loop,) = lower(sched.program).loops
    # stage 0: matmul + start reduce_scatter; stage 1: wait, fused kernel, start all_gather;
    # stage 2: wait all_gather
    kinds = [[type(s).__name__ for s in stage] for stage in loop.stages]
    assert kinds == [["Compute", "Start"], ["Wait", "Kernel", "Start"], ["Wait"]]
    assert {n.name for n in loop.chunked} == {"x", "r_slice"}  # w and b are read whole
    assert [n.name for n in loop.outputs] == ["out"]
    source = cc.compile(sched, world=2).source
    assert "for _t in range(5):  # stage s works on chunk _t - s" in source
    assert "env.chunk_rows['overlap_2/x'][c]" in source


def test_a_fuse_group_partly_inside_an_overlap_is_refused():
    prog = _sgd()
    grouped = Program.from_nodes(
        prog.name,
        prog.inputs,
        prog.outputs,
        prog.updates,
        [
            Group(GroupKind.OVERLAP, ("g_sum", prog.updates[0].inputs[1].name), chunks=2),
            Group(GroupKind.FUSE, tuple(n.name for n in prog.nodes if n.op in POINTWISE)),
        ],
    )
    with pytest.raises(cc.CodegenError, match="lies partly inside an overlapped chain"):
        cc.compile(grouped, world=2)


def test_compile_errors():
    prog = _sgd()
    with pytest.raises(cc.CodegenError, match="coconet.runtime.init"):
        cc.compile(prog)
    with pytest.raises(cc.CodegenError, match="unknown compile option"):
        cc.compile(prog, world=2, fused=False)
    with pytest.raises(cc.CodegenError, match="Program or a Schedule"):
        cc.compile("sgd", world=2)
    N = cc.Dim("N")
    x = cc.Tensor("x", cc.float32, [N], cc.Local)
    bad_root = cc.Program("root", [x], {"b": cc.broadcast(x, root=3)})
    with pytest.raises(cc.CodegenError, match="root=3"):
        cc.compile(bad_root, world=2)
    t = cc.Tensor("t", cc.float32, [N], cc.Local)
    axes = cc.Program("axes", [t], {"s": cc.all_reduce(t, axis="tp")})
    with pytest.raises(cc.CodegenError, match="mesh axes"):
        cc.compile(axes, world=2)


def test_modules_are_cached_by_key(tmp_path):
    prog = _sgd()
    a = cc.compile(prog, world=2, cache_dir=tmp_path)
    b = cc.compile(_sgd(), world=2, cache_dir=tmp_path)
    c = cc.compile(prog, world=3, cache_dir=tmp_path)
    assert a.module is b.module and a.key == b.key
    assert c.key != a.key
    generated = keyed_cache_dir(tmp_path) / "generated"  # keyed by torch version and CPU
    files = sorted(p.name for p in generated.iterdir())
    assert f"sgd_{c.key}.py" in files  # (a's module may come from an earlier compile)
    assert (generated / f"sgd_{c.key}.py").read_text() == c.source


def test_bind_sizes_and_geometry():
    prog = dist_programs.update_state()
    mesh = cc.Mesh.world(3)
    shapes = [
        {"w": (7,), "m": (3,), "loc": (7,), "seed": ()},
        {"w": (7,), "m": (2,), "loc": (7,), "seed": ()},
        {"w": (7,), "m": (2,), "loc": (7,), "seed": ()},
    ]
    sizes, problems = bind_sizes(prog, mesh, shapes)
    assert sizes == {"N": 7} and problems == []
    geo = geometry(prog, mesh, 1, sizes)
    assert geo.parts["w_new"] == (3, 2, 2)
    assert geo.offsets["dropped"] == (3,)
    shapes[2]["m"] = (3,)
    _, problems = bind_sizes(prog, mesh, shapes)
    assert any("rank 2: input 'm'" in p for p in problems)


def _alike_program() -> Program:
    """Inputs of every layout along a mesh axis and the world, with a static dim: what a layer's
    program declares (activations replicated, weights sliced along tp, a fixed width)."""
    b, t, k, n, s = cc.Dim("B"), cc.Dim("T"), cc.Dim("K"), cc.Dim("N"), cc.Dim("S")
    x = cc.Tensor("x", cc.float32, [b, t, k], cc.Replicated)
    w = cc.Tensor("w", cc.float32, [n, k], cc.Sliced(0, axis="tp"))
    h = cc.Tensor("h", cc.float32, [b, t, n], cc.Sliced(2, axis="tp"))
    c = cc.Tensor("c", cc.float32, [s, 4], cc.Sliced(0))
    return cc.Program("alike", [x, w, h, c], {"x": x, "w": w, "h": h, "c": c})


@settings(max_examples=150, deadline=None)
@given(sizes=st.tuples(*[st.integers(1, 5)] * 5), tweak=st.integers(0, 12),
       mesh=st.sampled_from([(1, 1), (1, 2), (2, 2), (3, 1)]))
def test_bind_alike_is_bind_sizes_on_ranks_with_the_same_shapes(sizes, tweak, mesh):
    """Where every rank has the same shapes, ``bind_alike`` (one pass) binds what ``bind_sizes``
    (every rank's) does, and refuses exactly what it finds a problem in."""
    from coconet.codegen.geometry import bind_alike

    b, t, k, n, static = sizes
    dp, tp = mesh
    m = cc.Mesh(dp=dp, tp=tp)
    shapes = {"x": [b, t, k], "w": [n, k], "h": [b, t, n], "c": [t, 4]}
    if tweak < 10:  # one length off (or not: the tweak may land on a length that still fits)
        name = sorted(shapes)[tweak % 4]
        dim = tweak % len(shapes[name])
        shapes[name][dim] = static if tweak >= 5 else shapes[name][dim] + 1
    elif tweak == 10:
        shapes["x"] = [b, t]  # another rank
    elif tweak == 11:
        del shapes["h"]  # missing: its sizes come from the others
    shapes = {k_: tuple(v) for k_, v in shapes.items()}
    prog = _alike_program()
    want, problems = bind_sizes(prog, m, [shapes] * m.size)
    got = bind_alike(prog, m, shapes)
    assert (got is None) == bool(problems), (got, problems)
    if got is not None:
        assert got == want
    event("fits" if got is not None else "refused")


def test_generated_step_runs_in_process_with_a_fake_world_of_one():
    """World of one needs no process group: collectives are local. This runs the generated code
    (eager kernels) in the test process and compares with the simulator."""
    from coconet.codegen.kernels import KernelSet

    s = dist_programs.fused_mix()
    step = cc.compile(s, world=1)
    inputs = dist_programs.fused_mix_inputs(1, 6)
    inputs = {k: (v[0] if isinstance(v, list) else v) for k, v in inputs.items()}
    sim = cc.simulate(s.program, inputs, 1)

    class OneRank:
        """The collectives of a one-rank group, without torch.distributed."""

        def reduce_scatter_start(self, x, op, **kw):
            return x.clone()

        def all_gather_start(self, x, **kw):
            return x

        def wait(self, work):
            return work

    sizes = {"N": 6}
    geo = geometry(s.program, cc.Mesh.world(1), 0, sizes)
    args = [
        torch.tensor(v) if isinstance(v, float) else v.clone()
        for v in (inputs[n.name] for n in s.program.inputs)
    ]
    outputs, updates = step.module.step(
        OneRank(), geo, KernelSet(step.module.KERNELS, fused=False), *args
    )
    assert torch.equal(outputs["out"], sim.outputs["out"][0])
    assert torch.equal(updates["p"], sim.updates["p"][0])


def test_a_geometry_digest_sees_every_element_of_its_index_tensors():
    """What keys a kept rehearsal (``Geometry.digest``): two geometries whose long index tensors
    differ in one element elided from their repr digest differently; equal ones alike."""
    import torch

    from coconet.codegen.geometry import Geometry

    rows = torch.arange(5000)
    other = rows.clone()
    other[2500] = 0
    a = Geometry(sizes={"N": 5000}, chunk_rows={"loop/x": (rows,)})
    b = Geometry(sizes={"N": 5000}, chunk_rows={"loop/x": (other,)})
    assert repr(a) == repr(b)  # (why repr cannot be the key)
    assert a.digest() != b.digest()
    same = Geometry(sizes={"N": 5000}, chunk_rows={"loop/x": (rows.clone(),)})
    assert a.digest() == same.digest()
    assert a.digest() != Geometry(sizes={"N": 5001}, chunk_rows={"loop/x": (rows,)}).digest()
