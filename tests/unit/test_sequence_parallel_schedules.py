"""The sequence-parallel layer schedules (``paper.ol_AG_MM``, ``paper.ol_MM_RS_C``): on the
programs of a sequence-parallel column- and row-parallel layer and on their backward programs
(``coconet.grad``), each schedule simulates equal to the program as written, on 1-4 ranks with
uneven sequence slices; programs without such a chain are refused with the schedule named."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.errors import ScheduleError
from coconet.ir.ops import Op
from coconet.schedule import paper
from coconet.tune.candidates import enumerate_schedules

T, D, H = cc.Dim("T"), cc.Dim("D"), cc.Dim("H")


def column_sp(bias: bool = True) -> cc.Program:
    """all_gather the sequence, x @ w.T with w split by output features, + b."""
    x = cc.Tensor("x", cc.float32, [T, D], cc.Sliced(0, "tp"))
    w = cc.Tensor("w", cc.float32, [H, D], cc.Sliced(0, "tp"))
    inputs = [x, w]
    y = cc.matmul(cc.all_gather(x, axis="tp", name="x_full"), cc.transpose(w)).named("xw")
    if bias:
        b = cc.Tensor("b", cc.float32, [H], cc.Sliced(0, "tp"))
        inputs.append(b)
        y = (y + b).named("xw_b")
    return cc.Program("column_sp", inputs, {"y": y})


def row_sp(p: float = 0.25, whole_residual: bool = False) -> cc.Program:
    """x @ w.T on input-feature parts, reduce_scatter along the sequence, + b, dropout, + r."""
    x = cc.Tensor("x", cc.float32, [T, D], cc.Sliced(1, "tp"))
    w = cc.Tensor("w", cc.float32, [H, D], cc.Sliced(1, "tp"))
    b = cc.Tensor("b", cc.float32, [H], cc.Replicated("tp"))
    seed, step = cc.Scalar("seed", cc.int64), cc.Scalar("step", cc.int64)
    partial = cc.matmul(x, cc.transpose(w)).named("partial")
    y = cc.dropout(cc.reduce_scatter(partial, axis="tp", dim=0, name="y_rs") + b, p, seed, step)
    if whole_residual:
        r = cc.Tensor("r", cc.float32, [T, H], cc.Replicated("tp"))
        y = y + cc.scatter(r, dim=0, axis="tp")
    else:
        r = cc.Tensor("r", cc.float32, [T, H], cc.Sliced(0, "tp"))
        y = y + r
    return cc.Program("row_sp", [x, w, b, r, seed, step], {"out": y.named("out")})


def _inputs(program: cc.Program, rows: int, d: int, h: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sizes = {"T": rows, "D": d, "H": h}
    out: dict = {}
    for node in program.inputs:
        if node.type.rank == 0:
            out[node.name] = 3 if node.name == "seed" else 5
            continue
        shape = [sizes[str(s)] if not isinstance(s, int) else s for s in node.type.shape]
        out[node.name] = torch.randn(*shape, generator=g)
    return out


def _backward(program: cc.Program) -> cc.Program:
    wrt = [n.name for n in program.inputs if n.type.rank and n.name != "seed"]
    return cc.grad(program, wrt)


def _same(a: cc.Program, b, inputs: dict, world: int) -> None:
    mesh = cc.Mesh(tp=world)
    want = cc.simulate(a, inputs, mesh)
    got = cc.simulate(b.program if hasattr(b, "program") else b, inputs, mesh)
    for name in want.outputs:
        # a matmul over a chunk of rows may round its last bit otherwise (its blocking follows
        # its shape): equal within float32's few ulp, not bitwise
        torch.testing.assert_close(got.output(name), want.output(name), rtol=1e-5, atol=1e-6)


PROGRAMS = {
    "column_sp": column_sp,
    "column_sp_no_bias": lambda: column_sp(bias=False),
    "row_sp": row_sp,
    "row_sp_whole_residual": lambda: row_sp(whole_residual=True),
}


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(PROGRAMS)),
    backward=st.booleans(),
    world=st.integers(1, 4),
    extra_rows=st.integers(0, 9),
    chunks=st.integers(2, 4),
    seed=st.integers(0, 1000),
)
def test_schedules_simulate_equal_to_the_program(name, backward, world, extra_rows, chunks, seed):
    program = PROGRAMS[name]()
    if backward:
        program = _backward(program)
    rows = max(chunks, world) + extra_rows  # uneven sequence slices whenever rows % world
    inputs = _inputs(program, rows, 3 * world, 2 * world + 1, seed)
    chains = paper.sequence_parallel_chains(program)
    applied = 0
    for schedule, make in (("ol_AG_MM", paper.ol_AG_MM), ("ol_MM_RS_C", paper.ol_MM_RS_C)):
        for _, collective in [(a, b) for a, b in chains[schedule]]:
            s = make(program, chunks, collective=collective)
            assert "overlap" in str(s)
            _same(program, s, inputs, world)
            applied += 1
    assert applied >= 1, f"{program.name} has a sequence-parallel chain"


def test_the_chains_of_each_layer_program():
    """Forward and backward: which chain each schedule finds (a column-parallel backward's
    input gradient is a matmul into a reduce_scatter; a row-parallel backward's is the
    cotangent's all_gather into a matmul; a weight gradient contracts over the rows and is no
    chain)."""
    col, row = column_sp(), row_sp()
    assert paper.sequence_parallel_chains(col) == {"ol_AG_MM": [("x_full", "xw")],
                                                   "ol_MM_RS_C": []}
    assert paper.sequence_parallel_chains(row) == {"ol_AG_MM": [],
                                                   "ol_MM_RS_C": [("partial", "y_rs")]}
    col_back = paper.sequence_parallel_chains(_backward(col))
    row_back = paper.sequence_parallel_chains(_backward(row))
    assert len(col_back["ol_MM_RS_C"]) == 1 and not col_back["ol_AG_MM"]
    assert len(row_back["ol_AG_MM"]) == 1 and not row_back["ol_MM_RS_C"]
    for back in (_backward(col), _backward(row)):
        for a, b in paper.sequence_parallel_chains(back)["ol_AG_MM"]:
            assert back.node(b).op is Op.MATMUL and back.node(b).inputs[0].name == a


def test_the_row_schedule_fuses_the_computations_on_the_slices():
    s = paper.ol_MM_RS_C(row_sp(), 2)
    text = str(s)
    assert "fuse(" in text and "overlap([partial, y_rs, " in text


@pytest.mark.parametrize("make,program,fragment", [
    (paper.ol_AG_MM, row_sp, "no all_gather feeding a matmul"),
    (paper.ol_MM_RS_C, column_sp, "no matmul feeding a reduce_scatter"),
])
def test_a_program_without_the_chain_is_refused(make, program, fragment):
    with pytest.raises(ScheduleError) as e:
        make(program())
    assert fragment in e.value.message
    assert e.value.op == make.__name__
    assert "sequence-parallel" in e.value.hint


def test_a_collective_outside_every_chain_is_refused():
    with pytest.raises(ScheduleError, match="not in a chain"):
        paper.ol_AG_MM(column_sp(), collective="w")


def test_a_sequence_dim_other_than_the_rows_has_no_chain():
    """Batch-first ``[B, T, D]`` slices dim 1: overlap cuts rows, so no chain is offered."""
    B = cc.Dim("B")
    x = cc.Tensor("x", cc.float32, [B, T, D], cc.Sliced(1, "tp"))
    w = cc.Tensor("w", cc.float32, [H, D], cc.Sliced(0, "tp"))
    y = cc.matmul(cc.all_gather(x, axis="tp"), cc.transpose(w))
    program = cc.Program("batch_first", [x, w], {"y": y})
    assert paper.sequence_parallel_chains(program) == {"ol_AG_MM": [], "ol_MM_RS_C": []}


@pytest.mark.parametrize("program", [column_sp, row_sp])
def test_the_tuner_enumerates_the_overlaps(program):
    """``coconet.tune`` (and so ``schedule="auto"``) weighs the overlapped chains, each chunk
    count a candidate named after the paper-style schedule."""
    found = enumerate_schedules(program())
    names = [s.name if s is not None else None for s in found.schedules]
    assert names[0] is None
    expected = "ol_AG_MM" if program is column_sp else "ol_MM_RS_C"
    assert any(n and n.startswith(expected) for n in names), names
