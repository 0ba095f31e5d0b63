"""Rank bodies for tests/dist/test_dist_pipeline.py: coconet.pipeline.Pipeline against one
process training the whole model on the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coconet.ir.types import slice_bounds
from coconet.pipeline import Pipeline

WIDTH, LAYERS, BATCH = 6, 4, 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(LAYERS)])  # fmt: skip


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def train_vs_one_process(comm, schedule: str, micro: int, steps: int = 3) -> dict:
    """Each rank keeps its layers of the model (tensor_split over the stages), trains them with
    SGD through the pipeline; the reference trains the whole model on one process."""
    full = _model()
    n, i = comm.world, comm.rank
    lo, hi = slice_bounds(LAYERS, n, i)
    stage = nn.Sequential(*list(full)[lo:hi])
    pipe = Pipeline(stage, comm, micro_batches=micro, activation_shape=(BATCH // micro, WIDTH),
                    loss_fn=F.mse_loss, schedule=schedule, axis=None)  # fmt: skip
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    errors, losses = {}, []
    for k in range(steps):
        x, t = _batch(k)
        opt.zero_grad()
        loss = pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(x), t)
        ref_loss.backward()
        mine = [p.grad for p in stage.parameters()]
        want = [p.grad for p in nn.Sequential(*list(reference)[lo:hi]).parameters()]
        errors[f"grads step {k}"] = max((a - b).abs().max().item() / max(b.abs().max().item(),
                                        1e-12) for a, b in zip(mine, want, strict=True))
        if loss is not None:
            errors[f"loss step {k}"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            losses.append(loss.item())
        opt.step()
        ref_opt.step()
    return {"errors": errors, "losses": losses, "table_rows": len(pipe.steps)}


def killed_mid_schedule(comm, victim: int) -> dict:
    """``victim`` dies in the middle of its schedule; the others must fail within the timeout,
    their parameters untouched (no optimizer step ran)."""
    import os
    import signal
    import time

    from coconet.errors import RuntimeFault

    full = _model()
    lo, hi = slice_bounds(LAYERS, comm.world, comm.rank)
    stage = nn.Sequential(*list(full)[lo:hi])
    pipe = Pipeline(stage, comm, micro_batches=4, activation_shape=(2, WIDTH),
                    loss_fn=F.mse_loss, axis=None)  # fmt: skip
    x, t = _batch(0)
    before = [p.detach().clone() for p in stage.parameters()]
    if comm.rank == victim:
        real = stage.forward
        calls = []

        def dying(inp):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(inp)

        stage.forward = dying
    t0 = time.perf_counter()
    try:
        pipe.step(x if pipe.is_first else None, t if pipe.is_last else None)
    except RuntimeFault as e:
        return {"status": "fault", "message": str(e), "seconds": time.perf_counter() - t0,
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, stage.parameters(),
                                                                  strict=True))}  # fmt: skip
    return {"status": "no error"}
