"""Sizes that the world size does not divide: slices differ by one element, some may be empty.

Covers the examples as written (everything Replicated except the collectives' inputs), hand-sliced
forms of Adam and LAMB (reduce_scatter -> update on slices -> all_gather, the shape schedules will
produce), and the row-parallel layer with H not divisible by the world size.
"""

import pytest
import torch
from support.examples_loader import load_example

import coconet as cc
from coconet.ir.types import slice_bounds

UNEVEN = [(7, 2), (7, 3), (7, 4), (1, 4), (5, 3)]  # (size, world); (1, 4) leaves 3 ranks empty


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    return diff / scale if scale > 0 else diff


@pytest.mark.parametrize("size,world", UNEVEN)
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lamb"])
def test_optimizer_examples(name, size, world):
    example = load_example(name)
    assert example.check(world, size, steps=3) <= example.TOLERANCE


# ---------------------------------------------------------------------------------------------
# hand-sliced optimizers: each rank updates only its slice of the parameters and state


def sliced_adam() -> cc.Program:
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p, m, v = (cc.Tensor(n, cc.float32, [N], cc.Replicated) for n in ("p", "m", "v"))
    lr, beta1, beta2, eps, weight_decay, step = (
        cc.Scalar(n) for n in ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
    )
    g_part = cc.reduce_scatter(g, name="g_part")
    p_s, m_s, v_s = cc.scatter(p), cc.scatter(m), cc.scatter(v)
    d_p = g_part + weight_decay * p_s
    m_new = beta1 * m_s + (1 - beta1) * d_p
    v_new = beta2 * v_s + (1 - beta2) * d_p * d_p
    denom = cc.sqrt(v_new) / cc.sqrt(1 - beta2**step) + eps
    p_new = p_s - lr / (1 - beta1**step) * (m_new / denom)
    return cc.Program(
        "adam_sliced",
        [g, p, m, v, lr, beta1, beta2, eps, weight_decay, step],
        [
            cc.update(p, cc.all_gather(p_new)),
            cc.update(m, cc.all_gather(m_new)),
            cc.update(v, cc.all_gather(v_new)),
        ],
    )


def sliced_lamb() -> cc.Program:
    """LAMB on slices: the norms become sqrt(all_reduce(sum(x * x))) of the slices."""
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    p, m, v = (cc.Tensor(n, cc.float32, [N], cc.Replicated) for n in ("p", "m", "v"))
    lr, beta1, beta2, eps, weight_decay, step = (
        cc.Scalar(n) for n in ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
    )
    g_part = cc.reduce_scatter(g, name="g_part")
    p_s, m_s, v_s = cc.scatter(p), cc.scatter(m), cc.scatter(v)
    m_new = beta1 * m_s + (1 - beta1) * g_part
    v_new = beta2 * v_s + (1 - beta2) * g_part * g_part
    adam_dir = (m_new / (1 - beta1**step)) / (cc.sqrt(v_new / (1 - beta2**step)) + eps)
    direction = adam_dir + weight_decay * p_s
    p_norm = cc.sqrt(cc.all_reduce(cc.sum(p_s * p_s)))
    dir_norm = cc.sqrt(cc.all_reduce(cc.sum(direction * direction)))
    trust = cc.where(p_norm > 0, cc.where(dir_norm > 0, p_norm / dir_norm, 1.0), 1.0)
    p_new = p_s - lr * (trust * direction)
    return cc.Program(
        "lamb_sliced",
        [g, p, m, v, lr, beta1, beta2, eps, weight_decay, step],
        [
            cc.update(p, cc.all_gather(p_new)),
            cc.update(m, cc.all_gather(m_new)),
            cc.update(v, cc.all_gather(v_new)),
        ],
    )


@pytest.mark.parametrize("size,world", UNEVEN)
@pytest.mark.parametrize("name,build", [("adam", sliced_adam), ("lamb", sliced_lamb)])
def test_sliced_update_matches_example(name, build, size, world):
    example = load_example(name)
    whole, sliced = example.program(), build()
    a = b = example.make_inputs(world, size, seed=size + world)
    for _ in range(3):
        ra, rb = cc.simulate(whole, a, world), cc.simulate(sliced, b, world)
        a = {**a, **{k: ra.updated(k) for k in ra.updates}, "step": a["step"] + 1}
        b = {**b, **{k: rb.updated(k) for k in rb.updates}, "step": b["step"] + 1}
    for k in ("p", "m", "v"):
        if name == "adam":  # pointwise maths on slices: the very same numbers
            assert torch.equal(b[k], a[k]), k
        else:  # the norms' partial sums add up in another order: close, not bit-exact
            assert rel_error(b[k], a[k]) <= 1e-6, k


def test_reduce_scatter_slices_follow_tensor_split():
    """Rank i's part of a reduce_scatter of 7 elements over 4 ranks: sizes 2, 2, 2, 1."""
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    prog = cc.Program("rs", [g], {"part": cc.reduce_scatter(g)})
    grads = [torch.arange(7.0) * (r + 1) for r in range(4)]
    result = cc.simulate(prog, {"g": grads}, 4)
    total = grads[0] + grads[1] + grads[2] + grads[3]
    parts = result.outputs["part"]
    assert [t.numel() for t in parts] == [2, 2, 2, 1]
    offset = 0
    for r, got in enumerate(parts):
        lo, hi = slice_bounds(7, 4, r)
        assert (lo, hi) == (offset, offset + got.numel())
        assert torch.equal(got, total[lo:hi])
        offset = hi


# ---------------------------------------------------------------------------------------------
# the row-parallel layer with H (the sliced contraction dim) not divisible by the world size


@pytest.mark.parametrize("size,world", UNEVEN)
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_tensor_parallel_uneven(size, world, p):
    tp = load_example("tensor_parallel")
    assert tp.check(world, size, steps=2, p=p) <= tp.TOLERANCE


@pytest.mark.parametrize("size,world", [(7, 3), (1, 4)])
def test_tensor_parallel_per_rank_slices(size, world):
    """Sliced inputs given as per-rank parts (torch.tensor_split) mean the same as global ones."""
    tp = load_example("tensor_parallel")
    prog = tp.program(p=0.1)
    inputs = tp.make_inputs(world, size)
    parts = {
        **inputs,
        "x": list(torch.tensor_split(inputs["x"], world, dim=1)),
        "w": list(torch.tensor_split(inputs["w"], world, dim=0)),
    }
    whole = cc.simulate(prog, inputs, world).output("out")
    assert torch.equal(cc.simulate(prog, parts, world).output("out"), whole)


def test_tensor_parallel_wrong_uneven_split_is_refused():
    """Parts of sizes 1, 2, 2, 2 are not the layout's 2, 2, 2, 1: an error, not a wrong answer."""
    tp = load_example("tensor_parallel")
    inputs = tp.make_inputs(4, 7)
    x = inputs["x"]
    inputs["x"] = [x[:, :1], x[:, 1:3], x[:, 3:5], x[:, 5:]]
    with pytest.raises(cc.SimulationError, match="slice of the global shape"):
        cc.simulate(tp.program(), inputs, 4)
