"""An ordinary data-parallel training script, three ways: the tutorial's program.

The model, the data and the loop are what a DDP user already has; only the lines marked
``# <-`` change between the three ways (``--optimizer``):

- ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW``: the script as it was;
- ``coconet``: no DDP wrapper, ``coconet.optim.AdamW``: ``backward()`` writes each rank's local
  gradient straight into the optimizer's bucket and ``step()`` averages it, updates this rank's
  slice of the parameters and state and gathers the new parameters, in one fused collective;
- ``coconet-hook``: keep DDP, and hand coconet the gradients as DDP's communication hook
  (``coconet.optim.AdamW(..., ddp=model)``): the fused step runs inside ``backward()``.

Run it on 2 local ranks (``coconet run`` sets torchrun's environment; ``torchrun
--nproc-per-node 2`` runs it unchanged)::

    coconet run --nproc 2 examples/ddp_dropin.py --optimizer ddp
    coconet run --nproc 2 examples/ddp_dropin.py --optimizer coconet

Rank 0 prints the global batch's loss every few steps and ends with the final loss and an
``ok`` line once every rank holds the same parameters: the three ways print the same losses to
float32 rounding. Exit status 1 when the ranks' parameters differ or the loss is not finite.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's convention
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817 - the usual name

import coconet.optim
from coconet import runtime


def batch(step: int, rank: int, world: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (a fixed random regression task)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 32, generator=gen)
    y = torch.sin(x[:, :1] * 2) + 0.1 * x[:, 1:2]
    return torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=["ddp", "coconet", "coconet-hook"], default="coconet")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)

    # --8<-- [start:main_lines]
    comm = runtime.init()  # joins the job: torchrun's environment, as `coconet run` sets it
    rank, world = comm.rank, comm.world
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    if args.optimizer == "ddp":
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif args.optimizer == "coconet":
        opt = coconet.optim.AdamW(model.parameters(), lr=1e-2, comm=comm)  # <- no DDP wrapper
    else:
        model = DDP(model)
        opt = coconet.optim.AdamW(model.parameters(), lr=1e-2, comm=comm, ddp=model)  # <- hook
    if rank == 0:
        print(f"{args.optimizer}: {world} ranks, {args.steps} steps, a batch of 64 split over "
              "the ranks", flush=True)  # fmt: skip

    for step in range(args.steps):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()  # local gradients (with DDP: averaged, or coconet's hook, here)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # for printing: the global batch's loss (equal shares)
        if rank == 0 and (step % 10 == 0 or step + 1 == args.steps):
            print(f"  step {step + 1:>3}: loss {total.item() / world:.6f}", flush=True)

    # --8<-- [end:main_lines]

    # every rank must hold the same parameters: compare a checksum of them
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    sums = [None] * world
    dist.all_gather_object(sums, (flat.sum().item(), flat.abs().sum().item()))
    same = all(s == sums[0] for s in sums)
    ok = same and math.isfinite(total.item())
    if rank == 0:
        print(f"final loss {total.item() / world:.6f}")
        print(f"ok: {world} ranks hold the same parameters" if ok else
              "FAIL: the ranks' parameters differ" if not same else "FAIL: the loss is not finite")
    runtime.shutdown(comm, exit_code=0 if ok else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
