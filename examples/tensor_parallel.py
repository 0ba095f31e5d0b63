"""A Megatron-style row-parallel linear layer with bias, dropout and residual, in the coconet DSL.

The layer computes ``out = dropout(x @ w + b) + r`` with the contraction dim split over the ranks
(the second linear layer of a tensor-parallel MLP, or the attention output projection)::

    x: [B, H]  Sliced(dim=1)     rank i holds columns i of the activations
    w: [H, H2] Sliced(dim=0)     rank i holds the matching rows of the weight
    partial = x @ w              Local: each rank's partial sum of the product
    out_sum = all_reduce(partial)                      Replicated: the full product
    out     = dropout(out_sum + b, p, seed, step) + r  b and r are Replicated

This is a layer (forward only), not an optimizer: there is no gradient here. In the optimizer
examples the data-parallel gradient is the sum over ranks of each rank's Local gradient; in this
layer the Local values summed by the all_reduce are the ranks' partial products.

The dropout mask comes from coconet's counter-based generator, keyed by (seed, step, global
element index): ``coconet.random.dropout_mask(seed, step, p, (B, H2))`` gives the same keep-mask
on one process, which is how the reference reproduces it. ``p`` is fixed when the program is
built (``program(p=0.1)``); ``seed`` and ``step`` are int64 runtime scalars, so every step draws
a new mask from the same program.

Inputs: ``x``, ``w`` (Sliced), ``b``, ``r`` (Replicated), int64 scalars ``seed`` and ``step``.
Named nodes: ``partial`` (the matmul), ``out_sum`` (the all_reduce), ``biased``, ``dropped``,
``out`` (the output).

Run ``python examples/tensor_parallel.py`` to simulate it on 2 and 4 virtual ranks against one
``torch.nn.Linear`` on one process.
"""

from __future__ import annotations

import pathlib
import sys

import torch

import coconet as cc
from coconet.random import dropout_mask
from coconet.schedule import MM_AR_C, MM_RS_C_AG, ol_MM_fuse_RS_C_AG
from coconet.testing import run_distributed

# Import the examples' shared checking code (examples/_harness.py) however this file is loaded.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import max_errors, report  # noqa: E402

# The all_reduce adds the ranks' partial sums in a different order than one matmul does.
TOLERANCE = 1e-5  # max relative error vs the single-process layer in float32

# The paper's schedules of this layer (see coconet.schedule), by name.
SCHEDULES = {
    "MM_AR_C": MM_AR_C,
    "MM_RS_C_AG": MM_RS_C_AG,
    "ol_MM_fuse_RS_C_AG": ol_MM_fuse_RS_C_AG,
}

P = 0.1  # dropout probability


def program(p: float = P, dtype: cc.DType = cc.float32) -> cc.Program:
    """The row-parallel layer with dropout probability ``p``."""
    B, H, H2 = cc.Dim("B"), cc.Dim("H"), cc.Dim("H2")
    x = cc.Tensor("x", dtype, [B, H], cc.Sliced(1))
    w = cc.Tensor("w", dtype, [H, H2], cc.Sliced(0))
    b = cc.Tensor("b", dtype, [H2], cc.Replicated)
    r = cc.Tensor("r", dtype, [B, H2], cc.Replicated)
    seed = cc.Scalar("seed", cc.int64)
    step = cc.Scalar("step", cc.int64)

    partial = cc.matmul(x, w).named("partial")
    out_sum = cc.all_reduce(partial, name="out_sum")
    biased = (out_sum + b).named("biased")
    dropped = cc.dropout(biased, p, seed, step).named("dropped")
    out = (dropped + r).named("out")
    return cc.Program("tensor_parallel", [x, w, b, r, seed, step], {"out": out})


def make_inputs(
    world: int,
    size: int = 64,
    seed: int = 0,
    step: int = 1,
    dtype: torch.dtype = torch.float32,
    *,
    batch: int = 8,
    out_features: int = 32,
) -> dict:
    """Random global tensors for a layer with ``size`` input features (H).

    Sliced inputs are passed whole: the simulator slices them. ``world`` is not needed (there
    are no Local inputs) and is accepted for the same signature as the optimizer examples.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    return {
        "x": randn(batch, size),
        "w": randn(size, out_features) / max(size, 1) ** 0.5,
        "b": randn(out_features),
        "r": randn(batch, out_features),
        "seed": seed,
        "step": step,
    }


def reference(inputs: dict, steps: int = 1, p: float = P) -> dict[str, torch.Tensor]:
    """The layer on one process: ``torch.nn.Linear`` + the same dropout mask + residual.

    A layer has no state to carry from step to step: ``steps`` is accepted for the same
    signature as the optimizer examples and does not change the result.
    """
    x, w = inputs["x"], inputs["w"]
    linear = torch.nn.Linear(w.shape[0], w.shape[1], dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w.T)
        linear.bias.copy_(inputs["b"])
        y = linear(x)
    keep = dropout_mask(inputs["seed"], inputs["step"], p, tuple(y.shape))
    return {"out": y * keep / (1 - p) + inputs["r"]}


def errors(world: int, size: int, steps: int = 3, p: float = P) -> tuple[float, float]:
    """Simulate the layer at steps 1..``steps`` (a new mask each) against the reference."""
    prog = program(p)
    abs_err = rel_err = 0.0
    for step in range(1, steps + 1):
        inputs = make_inputs(world, size, seed=step, step=step)
        out = cc.simulate(prog, inputs, world).output("out")
        a, r = max_errors({"out": out}, reference(inputs, p=p))
        abs_err, rel_err = max(abs_err, a), max(rel_err, r)
    return abs_err, rel_err


def check(world: int, size: int, steps: int = 3, p: float = P) -> float:
    """The max relative error of the simulated layer vs the single-process one."""
    return errors(world, size, steps, p)[1]


def main() -> int:
    """Print the check on 2 and 4 virtual ranks; exit status 0 if within TOLERANCE."""
    return report("tensor_parallel", errors, TOLERANCE, size=256)


if __name__ == "__main__":
    if "--distributed" in sys.argv:  # under `coconet run --nproc N` or torchrun
        sys.exit(run_distributed(program(), SCHEDULES, lambda world: make_inputs(world, 61)))
    sys.exit(main())
