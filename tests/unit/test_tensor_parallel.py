"""The row-parallel layer example against one torch.nn.Linear + the same mask + residual, and the
dropout mask's independence of how the tensor is sliced."""

import pytest
import torch
from support.examples_loader import load_example

import coconet as cc
from coconet.ir.types import slice_bounds
from coconet.random import dropout_mask

tp = load_example("tensor_parallel")


def single_device(inputs: dict, p: float) -> torch.Tensor:
    """Written here, independently of the example: Linear(x) -> keep-mask / (1 - p) -> + r."""
    w = inputs["w"]
    linear = torch.nn.Linear(w.shape[0], w.shape[1])
    with torch.no_grad():
        linear.weight.copy_(w.T)
        linear.bias.copy_(inputs["b"])
        y = linear(inputs["x"])
    keep = dropout_mask(inputs["seed"], inputs["step"], p, tuple(y.shape))
    return torch.where(keep, y / (1 - p), torch.zeros(())) + inputs["r"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_layer_matches_single_device(world, p):
    prog = tp.program(p=p)
    for step in (1, 2):
        inputs = tp.make_inputs(world, 48, seed=3, step=step)
        result = cc.simulate(prog, inputs, world)
        per_rank = result.outputs["out"]
        for r in range(1, world):
            assert torch.equal(per_rank[r], per_rank[0]), "out is Replicated"
        want = single_device(inputs, p)
        torch.testing.assert_close(result.output("out"), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tp.reference(inputs, p=p)["out"], want, rtol=1e-6, atol=1e-6)


def test_dropout_drops_about_p_and_changes_with_step():
    p = 0.25
    prog = tp.program(p=p)
    outs = []
    for step in (1, 2):
        inputs = tp.make_inputs(2, 16, step=step, batch=64, out_features=64)
        inputs["r"] = torch.zeros_like(inputs["r"])  # so the output is the dropout's result
        dropped = cc.simulate(prog, inputs, 2).output("out")
        outs.append(dropped)
        assert abs((dropped == 0).float().mean().item() - p) < 0.03
    assert not torch.equal(outs[0] == 0, outs[1] == 0), "each step draws a new mask"


def test_partial_sums_are_local_then_replicated():
    prog = tp.program()
    assert prog.node("partial").type.layout == cc.Local
    assert prog.node("out_sum").op.value == "all_reduce"
    assert prog.node("out_sum").type.layout == cc.Replicated
    assert [n.name for n in prog.outputs] == ["out"]


@pytest.mark.parametrize("world", [2, 4])
def test_example_check(world):
    assert tp.check(world, 40) <= tp.TOLERANCE
    assert tp.check(world, 40, p=0.0) <= tp.TOLERANCE


# ---------------------------------------------------------------------------------------------
# the mask is a function of (seed, step, global index): slicing cannot change it


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_mask_same_whole_and_sliced(parts, dim):
    shape = (6, 7)
    whole = dropout_mask(5, 9, 0.3, shape)
    pieces = []
    for i in range(parts):
        lo, hi = slice_bounds(shape[dim], parts, i)
        local = list(shape)
        local[dim] = hi - lo
        offsets = [0, 0]
        offsets[dim] = lo
        pieces.append(dropout_mask(5, 9, 0.3, shape, tuple(local), tuple(offsets)))
    assert torch.equal(torch.cat(pieces, dim=dim), whole)


def test_mask_same_for_2d_blocks_and_chunks():
    shape = (5, 9)
    whole = dropout_mask(1, 2, 0.5, shape)
    block = dropout_mask(1, 2, 0.5, shape, (2, 4), (3, 5))
    assert torch.equal(block, whole[3:5, 5:9])
    # an empty slice (more ranks than rows) is an empty mask, not an error
    assert dropout_mask(1, 2, 0.5, shape, (0, 9), (5, 0)).shape == (0, 9)


def test_mask_depends_on_seed_and_step():
    shape = (32, 32)
    base = dropout_mask(0, 1, 0.5, shape)
    assert torch.equal(base, dropout_mask(0, 1, 0.5, shape))
    assert not torch.equal(base, dropout_mask(0, 2, 0.5, shape))
    assert not torch.equal(base, dropout_mask(1, 1, 0.5, shape))


# ---------------------------------------------------------------------------------------------
# the sequence-parallel form (MM_RS_C_AG), written by hand: the same numbers as the example


def sliced_tp(p: float, dim: int) -> cc.Program:
    """matmul -> reduce_scatter along ``dim`` -> bias, dropout, residual on slices -> all_gather."""
    B, H, H2 = cc.Dim("B"), cc.Dim("H"), cc.Dim("H2")
    x = cc.Tensor("x", cc.float32, [B, H], cc.Sliced(1))
    w = cc.Tensor("w", cc.float32, [H, H2], cc.Sliced(0))
    b = cc.Tensor("b", cc.float32, [H2], cc.Replicated)
    r = cc.Tensor("r", cc.float32, [B, H2], cc.Replicated)
    seed, step = cc.Scalar("seed", cc.int64), cc.Scalar("step", cc.int64)
    part = cc.reduce_scatter(cc.matmul(x, w), dim=dim)
    # a bias along H2 only needs this rank's part when the slices cut H2
    bias = cc.scatter(b) if dim == 1 else b
    out = cc.dropout(part + bias, p, seed, step) + cc.scatter(r, dim=dim)
    return cc.Program("tp_sliced", [x, w, b, r, seed, step], {"out": cc.all_gather(out)})


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("world,batch,out_features", [(2, 8, 32), (3, 7, 10), (4, 3, 5)])
def test_sequence_parallel_form_matches(dim, world, batch, out_features):
    p = 0.3
    inputs = tp.make_inputs(world, 11, seed=4, step=7, batch=batch, out_features=out_features)
    want = cc.simulate(tp.program(p=p), inputs, world).output("out")
    got = cc.simulate(sliced_tp(p, dim), inputs, world).output("out")
    assert torch.equal(got, want)
