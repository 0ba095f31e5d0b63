"""Counter-based dropout masks: deterministic, keyed by (seed, step, index), slice-invariant."""

from __future__ import annotations

import pytest
import torch

import coconet as cc
from coconet import Dim, Local, Mesh, Program, Replicated, Scalar, Sliced, Tensor, float32, int64
from coconet.random import dropout_mask, global_index, uniform

N, M = Dim("N"), Dim("M")


def test_deterministic():
    a = dropout_mask(3, 7, 0.4, (33, 17))
    b = dropout_mask(3, 7, 0.4, (33, 17))
    assert a.dtype == torch.bool and a.shape == (33, 17)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("seed2", "step2"), [(4, 7), (3, 8), (3 + 2**31, 7), (3, 7 + 2**31)])
def test_differs_by_seed_and_step(seed2, step2):
    a = dropout_mask(3, 7, 0.5, (100, 100))
    b = dropout_mask(seed2, step2, 0.5, (100, 100))
    # two independent masks with p=0.5 agree on about half the elements
    agree = (a == b).float().mean().item()
    assert 0.45 < agree < 0.55


def test_not_the_same_pattern_shifted():
    """Neighbouring elements, rows and steps are not trivially related."""
    m = dropout_mask(0, 0, 0.5, (200, 200))
    for shifted in (m[:, 1:] == m[:, :-1], m[1:] == m[:-1]):
        assert 0.45 < shifted.float().mean().item() < 0.55
    u0 = uniform(0, 0, torch.arange(50_000))
    u1 = uniform(0, 1, torch.arange(50_000))
    corr = torch.corrcoef(torch.stack([u0, u1]))[0, 1].item()
    assert abs(corr) < 0.02


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    m = dropout_mask(11, 5, p, (100_000,))
    assert abs(m.float().mean().item() - (1 - p)) < 0.01


def test_uniform_range():
    u = uniform(1, 2, torch.arange(100_000))
    assert u.dtype == torch.float64
    assert u.min().item() >= 0.0 and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01


def test_p_zero_keeps_everything_and_empty_blocks():
    assert dropout_mask(1, 1, 0.0, (50, 3)).all()
    empty = dropout_mask(1, 1, 0.5, (4, 6), (0, 6), (4, 0))
    assert empty.shape == (0, 6)


def test_global_index():
    idx = global_index((4, 5), (2, 3), (1, 2))
    assert torch.equal(idx, torch.tensor([[7, 8, 9], [12, 13, 14]]))
    assert torch.equal(global_index((2, 3), (2, 3)), torch.arange(6).view(2, 3))


@pytest.mark.parametrize("parts", [2, 3, 4, 7])
@pytest.mark.parametrize("dim", [0, 1])
def test_block_equals_block_of_the_whole_mask(parts, dim):
    shape = (10, 13)
    whole = dropout_mask(5, 9, 0.3, shape)
    start = 0
    for block in torch.tensor_split(torch.empty(shape), parts, dim=dim):
        local = tuple(block.shape)
        offsets = (start, 0) if dim == 0 else (0, start)
        mask = dropout_mask(5, 9, 0.3, shape, local, offsets)
        assert torch.equal(mask, whole.narrow(dim, start, local[dim]))
        start += local[dim]
    assert start == shape[dim]


def test_two_dim_tiles_equal_the_whole_mask():
    shape = (9, 11)
    whole = dropout_mask(2, 3, 0.5, shape)
    for r0, r1 in [(0, 4), (4, 9)]:
        for c0, c1 in [(0, 1), (1, 6), (6, 11)]:
            tile = dropout_mask(2, 3, 0.5, shape, (r1 - r0, c1 - c0), (r0, c0))
            assert torch.equal(tile, whole[r0:r1, c0:c1])


def _dropout_ref(x: torch.Tensor, p: float, seed: int, step: int) -> torch.Tensor:
    keep = dropout_mask(seed, step, p, tuple(x.shape))
    return torch.where(keep, x / (1 - p), torch.zeros(()))


@pytest.mark.parametrize(("dim", "world"), [(0, 3), (1, 2), (1, 4), (0, 1)])
def test_simulated_dropout_on_slices_equals_whole(dim, world):
    x = Tensor("x", float32, [N, M], Sliced(dim))
    step = Scalar("step", int64)
    prog = Program("d", [x, step], {"y": cc.dropout(x, 0.25, seed=17, step=step)})
    xv = torch.randn(7, 9, generator=torch.Generator().manual_seed(0))
    res = simulate_y(prog, xv, world, step=4)
    expected = _dropout_ref(xv, 0.25, 17, 4)
    torch.testing.assert_close(res, expected)
    # the same program on a Replicated tensor gives the same values, then sliced
    xr = Tensor("x", float32, [N, M], Replicated)
    prog_r = Program("d", [xr, step], {"y": cc.dropout(xr, 0.25, seed=17, step=step)})
    torch.testing.assert_close(simulate_y(prog_r, xv, world, step=4), res)
    # another step draws another mask
    assert not torch.equal(simulate_y(prog, xv, world, step=5), res)


def simulate_y(prog: Program, xv: torch.Tensor, world, step: int) -> torch.Tensor:
    return cc.simulate(prog, {"x": xv, "step": step}, world).output("y")


def test_dropout_of_a_tensor_sliced_over_one_mesh_axis():
    mesh = Mesh(dp=2, tp=3)
    x = Tensor("x", float32, [N, M], Sliced(1, axis="tp"))
    prog = Program("d", [x], {"y": cc.all_gather(cc.dropout(x, 0.5, seed=1, step=2))})
    xv = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = cc.simulate(prog, {"x": xv}, mesh).output("y")
    expected = _dropout_ref(xv, 0.5, 1, 2)
    for t in out:
        torch.testing.assert_close(t, expected)


def test_dropout_of_local_values_uses_one_mask_on_every_rank():
    x = Tensor("x", float32, [N], Local)
    prog = Program("d", [x], {"y": cc.dropout(x, 0.5, seed=3)})
    ones = torch.ones(64)
    out = cc.simulate(prog, {"x": [ones, 2 * ones]}, 2).output("y")
    assert torch.equal(out[0] * 2, out[1])
    torch.testing.assert_close(out[0], _dropout_ref(ones, 0.5, 3, 0))
