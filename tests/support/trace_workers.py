"""Rank bodies for tests/dist/test_dist_trace.py: a data-parallel optimizer step, a
tensor-parallel layer's forward and backward, a pipeline step, and bare all_reduces that the
last rank joins late, each recorded with ``coconet.trace.record`` into a folder of its own."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from coconet import trace
from coconet.ir.types import slice_bounds


def workloads(comm, directory: str) -> dict[str, str]:
    """Record each workload on every rank; returns the folders by workload."""
    out = {}
    for name, run in (("dp", _dp_steps), ("tp", _tp_layers), ("pipeline", _pipeline_step),
                      ("late", _late_rank)):
        folder = os.path.join(directory, name)
        with trace.record(folder, comm=comm):
            run(comm)
        out[name] = folder
    return out


def _dp_steps(comm) -> None:
    from coconet.optim import Adam

    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = Adam(model.parameters(), lr=1e-3, comm=comm)
    for k in range(3):
        gen = torch.Generator().manual_seed(10 * comm.rank + k)
        model(torch.randn(4, 32, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _tp_layers(comm) -> None:
    from coconet.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    col = ColumnParallelLinear.from_linear(nn.Linear(8, 16), comm=comm)
    row = RowParallelLinear.from_linear(nn.Linear(16, 8), comm=comm)
    for _ in range(2):
        x = torch.randn(2, 3, 8, requires_grad=True)
        row(torch.relu(col(x))).sum().backward()


def _pipeline_step(comm) -> None:
    from coconet.pipeline import Pipeline

    torch.manual_seed(0)
    full = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]
    lo, hi = slice_bounds(4, comm.world, comm.rank)
    stage = nn.Sequential(*full[lo:hi])
    pipe = Pipeline(stage, comm, micro_batches=2, activation_shape=(4, 6), loss_fn=F.mse_loss,
                    schedule="1f1b", axis=None)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    pipe.step(inputs=x if pipe.is_first else None, targets=t if pipe.is_last else None)


def _late_rank(comm) -> None:
    """Three all_reduces; before the second, the last rank sleeps 80 ms: the others wait on it."""
    from coconet.ir.ops import ReduceOp

    for k in range(3):
        if k == 1 and comm.rank == comm.world - 1:
            time.sleep(0.08)
        work = comm.all_reduce_start(torch.ones(1024), ReduceOp.SUM, axis=None, donate=False,
                                     label=f"x{k}")  # fmt: skip
        comm.wait(work)
