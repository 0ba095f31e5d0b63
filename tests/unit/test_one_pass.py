"""Which units run as one pass over shared memory, and the code generated for them.

The plan finds three forms (``coconet.codegen.plan``): a fused collective as ``OnePass`` (whole:
reduce_scatter -> kernel -> all_gather; or a half, when a collective outside the group cuts the
unit in two, as LAMB's norm all_reduce does), a chunk loop whose chunks are one-pass units
(``ol_MM_fuse_RS_C_AG``), and an all_reduce whose elementwise consumer kernel reads the result
where it was reduced (``ReadInPlace``, AR_C). Over torch.distributed none of them changes the
code. What they compute is checked on real ranks in tests/dist (test_dist_examples,
test_dist_shm); here: that the paper schedules take these paths, that what must not take them
does not, and that the generated code says so.
"""

from __future__ import annotations

import pytest
import torch
from support.examples_loader import load_example

import coconet as cc
from coconet.codegen import lower
from coconet.codegen.forms import loop_one_pass, one_pass, reads_in_place
from coconet.errors import CompileOptionError
from coconet.schedule import Schedule

SHM = "shared memory"


def _plan(example: str, schedule: str):
    mod = load_example(example)
    return lower(mod.SCHEDULES[schedule](mod.program()).program, set())


def _source(target, transport: str = SHM, world=2) -> str:
    return cc.compile(target, world=world, transport=transport).source


@pytest.mark.parametrize("example", ["sgd", "adam", "adamw"])
def test_ar_c_reads_the_reduced_gradient_in_place(example):
    plan = _plan(example, "AR_C")
    (r,) = reads_in_place(plan)
    assert r.all_reduce.name == "g_sum"
    mod = load_example(example)
    shm = _source(mod.SCHEDULES["AR_C"](mod.program()))
    assert ".reduce_in_place(" in shm and "_by_parts(" in shm
    assert ".release()" in shm and "comm.all_reduce_start(" not in shm
    gloo = _source(mod.SCHEDULES["AR_C"](mod.program()), "torch.distributed")
    assert "reduce_in_place" not in gloo and "comm.all_reduce_start(" in gloo


@pytest.mark.parametrize("example", ["sgd", "adam", "adamw"])
def test_fuse_rs_c_ag_is_one_whole_pass(example):
    (unit,) = _plan(example, "fuse_RS_C_AG").fused_collectives
    op = one_pass(unit)
    assert op is not None and op.reduce_scatter is not None and op.all_gather is not None


def test_lambs_unit_cut_by_its_norm_runs_as_two_halves():
    units = _plan("lamb", "fuse_RS_C_AG").fused_collectives
    forms = [(one_pass(u).reduce_scatter is not None, one_pass(u).all_gather is not None)
             for u in units]
    assert forms == [(True, False), (False, True)]
    mod = load_example("lamb")
    shm = _source(mod.SCHEDULES["fuse_RS_C_AG"](mod.program()))
    rs, finish, norm, ag, gather = (
        shm.index(s)
        for s in (
            ".begin(",
            ".end(",
            "label='dir_norm_sumsq'",
            ".slot(",
            ".finish(",
        )
    )
    assert rs < finish < norm < ag < gather  # the norm's all_reduce runs between the halves


def test_the_overlapped_layer_runs_each_chunk_as_one_pass():
    (loop,) = _plan("tensor_parallel", "ol_MM_fuse_RS_C_AG").loops
    assert loop_one_pass(loop) is not None
    mod = load_example("tensor_parallel")
    target = mod.SCHEDULES["ol_MM_fuse_RS_C_AG"](mod.program())
    shm = _source(target)
    assert ".begin(" in shm and ".finish(" in shm
    assert "for _c in range(4):" in shm  # the chunks one after the other
    gloo = _source(target, "torch.distributed")
    assert "comm.one_pass(" not in gloo and "stage s works on chunk" in gloo


def _ar_then(consumer, also_output: bool = False):
    """all_reduce of a [B, H] gradient, then ``consumer(g_sum, p, b)`` fused after it."""
    B, H = cc.Dim("B"), cc.Dim("H")
    g = cc.Tensor("g", cc.float32, [B, H], cc.Local)
    p = cc.Tensor("p", cc.float32, [B, H], cc.Replicated)
    b = cc.Tensor("b", cc.float32, [H], cc.Replicated)
    lr = cc.Scalar("lr")
    g_sum = cc.all_reduce(g, name="g_sum")
    p_new = consumer(g_sum, p, b, lr).named("p_new")
    outputs = [cc.update(p, p_new)] + ([g_sum] if also_output else [])
    prog = cc.Program("ar_then", [g, p, b, lr], outputs)
    s = Schedule(prog)
    s.fuse(s.computations("g_sum"))
    return s


def test_an_elementwise_consumer_of_a_2d_all_reduce_reads_it_in_place():
    s = _ar_then(lambda g, p, b, lr: p - lr * g * g)
    assert len(reads_in_place(lower(s.program, set()))) == 1
    assert ".reduce_in_place(" in _source(s)


@pytest.mark.parametrize(
    ("why", "consumer", "also_output"),
    [
        ("rounds differently on other slices", lambda g, p, b, lr: p - lr * cc.gelu(g), False),
        ("broadcasts a [H] operand", lambda g, p, b, lr: p - lr * g + b, False),
        ("reduces", lambda g, p, b, lr: p - lr * g / g.norm(), False),
        ("the reduced value is also an output", lambda g, p, b, lr: p - lr * g, True),
    ],
)
def test_what_cannot_run_slice_by_slice_keeps_its_copy(why, consumer, also_output):
    s = _ar_then(consumer, also_output)
    assert reads_in_place(lower(s.program, set())) == (), why
    assert "reduce_in_place" not in _source(s), why


def test_transport_names_are_checked():
    mod = load_example("adam")
    with pytest.raises(CompileOptionError, match="unknown transport 'shm'"):
        cc.compile(mod.program(), world=2, transport="shm")


def test_a_wait_stays_after_its_start_when_the_group_is_gathered():
    """Regression: in pytorch_optimizer's LAMB (coconet.optim.programs.lamb) under fuse_RS_C_AG,
    the norm all_reduce that reads the first kernel's partial sums started after the fused unit
    while its wait was moved before it (a NameError on the ranks). lower() now checks the order
    of every plan it makes."""
    from coconet.codegen.plan import Start, Wait
    from coconet.optim import programs
    from coconet.schedule import fuse_RS_C_AG

    plan = lower(fuse_RS_C_AG(programs.lamb(), state=("m", "v")).program, set())
    order = [(type(s), s.node.name) for s in plan.steps if isinstance(s, (Start, Wait))]
    for kind, name in order:
        if kind is Wait:
            assert order.index((Start, name)) < order.index((Wait, name)), name


def test_a_gather_is_published_only_when_no_collective_follows_it():
    """Regression: a published gather holds the group's epoch open until the commit, so a
    collective after it in the same step waited for peers that waited for it (a deadlock found by
    a program whose unit is followed by the all_reduce of a partial sum). A scalar all_reduce
    over the whole mesh runs over the control channel instead and leaves the gather published
    (a speculative step's norm); any other collective after the unit still unpublishes it."""
    from coconet.schedule import fuse_RS_C_AG

    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    h = cc.Tensor("h", cc.float32, [N], cc.Local)
    w = cc.Tensor("w", cc.float32, [N], cc.Replicated)
    w_new = (w - cc.all_reduce(g, name="g_sum")).named("w_new")
    followed = cc.Program("followed", [g, h, w], {"h_sum": cc.all_reduce(h * w_new),
                                                   "u": cc.update(w, w_new)})
    scalar = cc.Program("scalar", [g, w], {"total": (w_new * w_new).sum(),
                                            "u": cc.update(w, w_new)})
    alone = cc.Program("alone", [g, w], [cc.update(w, w_new)])
    assert "published=True" not in _source(fuse_RS_C_AG(followed, all_reduce="g_sum"))
    source = _source(fuse_RS_C_AG(scalar))
    assert "published=True" in source and "comm.all_reduce_control_start(" in source
    assert "published=True" in _source(fuse_RS_C_AG(alone))
    assert "all_reduce_control_start" not in _source(fuse_RS_C_AG(alone))


LAMB_SCALARS = {"grad_scale": 0.5, "beta1": 0.9, "beta3": 0.1, "beta2": 0.999,
                "one_minus_beta2": 1e-3, "eps": 1e-6, "decay": 0.99, "step_size": 0.1,
                "use_trust": 1.0}


def test_lambs_rows_are_one_whole_pass_without_a_norm_collective():
    """``programs.lamb(rows=True)`` (coconet.optim.LAMB's bucket of equal-sized tensors, one per
    row) sliced by rows: each rank's norms are its own rows', so nothing cuts the unit."""
    from coconet.optim import programs
    from coconet.schedule import fuse_RS_C_AG

    s = fuse_RS_C_AG(programs.lamb(rows=True), state=("m", "v"))
    (unit,) = lower(s.program, set()).fused_collectives
    op = one_pass(unit)
    assert op is not None and op.reduce_scatter is not None and op.all_gather is not None
    shm = _source(s)
    assert "all_reduce_start(" not in shm and "norm_sumsq" not in shm


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lambs_rows_are_each_the_flat_program_of_that_row(world):
    """Simulated: row k of the rows program (sliced by rows over ``world`` ranks, 5 rows: slices
    of unequal row counts) is the flat program over tensor k."""
    from coconet.optim import programs
    from coconet.schedule import fuse_RS_C_AG

    gen = torch.Generator().manual_seed(3)
    g = [torch.randn(5, 12, generator=gen) for _ in range(world)]
    p, m, v = torch.randn(5, 12, generator=gen), torch.randn(5, 12, generator=gen) * 0.1, \
        torch.rand(5, 12, generator=gen) * 0.1
    rows = fuse_RS_C_AG(programs.lamb(rows=True), state=("m", "v")).program
    got = cc.simulate(rows, {"g": g, "p": p, "m": m, "v": v, **LAMB_SCALARS}, world)
    flat = programs.lamb()
    for k in range(5):
        want = cc.simulate(flat, {"g": [x[k] for x in g], "p": p[k], "m": m[k], "v": v[k],
                                  **LAMB_SCALARS}, world)
        for name in ("p", "m", "v"):
            torch.testing.assert_close(got.updated(name)[k], want.updated(name),
                                       rtol=1e-6, atol=1e-7)
