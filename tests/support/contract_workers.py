"""Rank bodies for tests/dist/test_dist_optim_contracts.py: torch's optimizer contracts on
several ranks (issue 42, items 10-11). Each trains ``coconet.optim.AdamW`` next to a reference
that every rank computes alone: torch's AdamW on one process stepping the ranks' average
gradient (the mean of every rank's loss), and compares the parameters."""

from __future__ import annotations

import copy

import torch

import coconet.optim


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _train(comm, edit, steps: int = 5, at: int = 2) -> dict[str, float]:
    """``steps`` steps of both; ``edit(model)`` on both before step ``at``."""
    model = _model()
    frozen = edit is _unfreeze
    if frozen:
        model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = coconet.optim.AdamW(model.parameters(), lr=1e-2, comm=comm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for k in range(steps):
        if k == at:
            edit(model)
            edit(ref)
        opt.zero_grad()
        model(_batch(k, comm.rank)).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        sum(ref(_batch(k, r)).square().mean() for r in range(comm.world)).div(
            comm.world).backward()
        ref_opt.step()
    errors = {f"param {i}": _err(p, q)
              for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters(), strict=True))}
    errors["attached"] = float(any(b.detachment(i) is not None for b in opt.buckets
                                   for i in range(len(b.params))))  # fmt: skip
    return errors


def _repoint(model: torch.nn.Module) -> None:
    """What accelerate's prepare / a device move does: every parameter's .data re-pointed to a
    copy of itself (the same values on every rank)."""
    for p in model.parameters():
        p.data = p.data.clone()


def _unfreeze(model: torch.nn.Module) -> None:
    model[0].requires_grad_(True)


def repointed(comm) -> dict[str, float]:
    return _train(comm, _repoint)


def unfrozen(comm) -> dict[str, float]:
    return _train(comm, _unfreeze)


def ddp_wrapped(comm) -> dict:
    """The model wrapped by ``DistributedDataParallel`` after the optimizer was built (as HF
    Trainer and accelerate do): DDP's all_reduce is the one reduction (the optimizer's steps
    move no data: one agreement round each, the safety check), and the parameters follow
    torch's AdamW behind DDP."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = coconet.optim.AdamW(model.parameters(), lr=1e-2, comm=comm)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rounds = []
    for k in range(4):
        opt.zero_grad()
        ddp(_batch(k, comm.rank)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)  # (Trainer's): of the average
        before = comm.control.rounds
        opt.step()
        rounds.append(comm.control.rounds - before)
        ref_opt.zero_grad()
        sum(ref(_batch(k, r)).square().mean() for r in range(comm.world)).div(
            comm.world).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    errors = {f"param {i}": _err(p, q)
              for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters(), strict=True))}
    from coconet.ir.opspec import Prop, spec

    moves = [n.name for b in opt.buckets for n in b.step_fn.program.nodes
             if spec(n.op).has(Prop.COMMUNICATES)]  # fmt: skip
    return {"errors": errors, "averaged_by": opt.gradients_averaged_by, "rounds": rounds,
            "moves": moves}


def one_step_more(comm) -> dict:
    """Rank 0 steps once more than rank 1 (a data loader one batch longer there): rank 1's
    work returns and it leaves; rank 0's extra step must fail at once, naming the rank that
    left and the calls it made, and its own step."""
    import time

    from coconet.errors import RuntimeFault

    model = _model()
    opt = coconet.optim.AdamW(model.parameters(), lr=1e-2, comm=comm)
    steps = 5 if comm.rank == 0 else 4
    for k in range(steps):
        opt.zero_grad()
        model(_batch(k, comm.rank)).square().mean().backward()
        t0 = time.monotonic()
        try:
            opt.step()
        except RuntimeFault as e:
            return {"error": str(e), "seconds": time.monotonic() - t0, "step": k + 1}
    return {"error": None, "step": steps}


def lamb_diagnostics(comm) -> dict[str, float]:
    """LAMB's per-parameter diagnostics (weight_norm, adam_norm, trust_ratio) on 2 ranks: five
    equal-sized tensors in a bucket of rows, sliced unevenly (3 and 2 rows), and a tensor of
    its own, against pytorch_optimizer.Lamb on one process stepping the average gradient."""
    import pytorch_optimizer

    torch.manual_seed(0)
    small = [torch.nn.Parameter(torch.randn(6)) for _ in range(5)]
    big = torch.nn.Parameter(torch.randn(40, 10))
    ours = [*small, big]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = coconet.optim.LAMB(ours, lr=1e-2, weight_decay=1e-2, comm=comm)
    ref_opt = pytorch_optimizer.Lamb(ref, lr=1e-2, weight_decay=1e-2, foreach=False)

    def loss(params, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(rank)
        return sum((p * torch.randn(p.shape, generator=g)).sum() ** 2 for p in params)

    for _ in range(2):
        opt.zero_grad()
        loss(ours, comm.rank).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(loss(ref, r) for r in range(comm.world)) / comm.world).backward()
        ref_opt.step()
    rows = len({id(b) for b in opt.buckets if b.row})
    errors = {"one bucket of rows": float(rows != 1)}
    for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
        for key in ("weight_norm", "adam_norm", "trust_ratio"):
            errors[f"{key} {i}"] = _err(torch.as_tensor(opt.state[p][key]),
                                        torch.as_tensor(ref_opt.state[q][key]))  # fmt: skip
    return errors
