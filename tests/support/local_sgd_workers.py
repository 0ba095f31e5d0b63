"""Rank bodies for tests/dist/test_dist_local_sgd.py, and the meaning they are held to: Local SGD
and Overlap Local-SGD written in plain torch on one process (``reference``), every rank's model
side by side, its averages summed in rank order."""

from __future__ import annotations

import copy
import functools
import operator

import torch
from torch import nn

import coconet

LR = 0.05


def model(rank: int = 0) -> nn.Module:
    """Two float32 layers and a float64 parameter (two flat buffers). Ranks other than 0 start
    from another model: the optimizer must start every rank from rank 0's."""
    torch.manual_seed(7 + rank)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    net.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))
    return net


def loss_of(net: nn.Module, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
    return ((net(x) * net.scale - y) ** 2).mean()


def inner(net: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=LR, foreach=False)
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9, foreach=False)


def wrap(comm, net: nn.Module, algo: dict) -> coconet.optim.LocalSGD:
    opt = inner(net, algo["inner"])
    if algo["name"] == "overlap":
        return coconet.optim.OverlapLocalSGD(opt, period=algo["period"], pull=algo["pull"],
                                             momentum=algo["momentum"], comm=comm)  # fmt: skip
    return coconet.optim.LocalSGD(opt, period=algo["period"], comm=comm,
                                  warmup_steps=algo.get("warmup", 0),
                                  host_period=algo.get("host_period"))  # fmt: skip


def _params(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def train(comm, algo: dict, steps: int, resume_at: int | None = None) -> dict:
    """``steps`` steps; the parameters after each, and the losses. ``resume_at``: the run
    checkpoints after that step and a second model resumes from it; both must end equal."""
    net = model(comm.rank)
    opt = wrap(comm, net, algo)
    out = {"params": [], "losses": [], "explain": opt.explain()}
    saved = None
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(net, step, comm.rank)
        loss.backward()
        opt.step()
        out["losses"].append(loss.item())
        out["params"].append(_params(net))
        if step + 1 == resume_at:
            saved = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()))
    if saved is not None:
        again = model(comm.rank)
        opt2 = wrap(comm, again, algo)  # (its start broadcasts: collective, as the first)
        again.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        for step in range(resume_at, steps):
            opt2.zero_grad()
            loss_of(again, step, comm.rank).backward()
            opt2.step()
        out["resumed"] = _params(again)
    return _picklable(out)


def _picklable(out: dict) -> dict:
    """Tensors as numpy arrays: a tensor a rank returns is shared by file descriptor, gone
    when the rank exits."""
    out["params"] = [[p.numpy() for p in ps] for ps in out["params"]]
    if "resumed" in out:
        out["resumed"] = [p.numpy() for p in out["resumed"]]
    return out


# -- the meaning: every rank's model on one process ------------------------------------------


def _flat(net: nn.Module) -> list[torch.Tensor]:
    dtypes = list(dict.fromkeys(p.dtype for p in net.parameters()))
    return [torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.dtype == d])
            for d in dtypes]  # fmt: skip


def _write(net: nn.Module, flats: list[torch.Tensor]) -> None:
    dtypes = list(dict.fromkeys(p.dtype for p in net.parameters()))
    for d, flat in zip(dtypes, flats, strict=True):
        at = 0
        for p in net.parameters():
            if p.dtype == d:
                p.detach().copy_(flat[at : at + p.numel()].view_as(p))
                at += p.numel()


def _average(all_flats: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The sum over ranks, in rank order, divided by their number."""
    world = len(all_flats)
    return [functools.reduce(operator.add, parts) / world for parts in zip(*all_flats, strict=True)]


def reference(world: int, algo: dict, steps: int, hosts: int = 1, make=model) -> dict:
    """The parameters of every rank after each step, and the losses (``hosts``: the ranks in
    that many equal blocks, for ``host_period``; ``make(rank)``: the model)."""
    nets = [make(0) for _ in range(world)]  # every rank starts from rank 0's
    opts = [inner(n, algo["inner"]) for n in nets]
    period, per_host = algo["period"], world // hosts
    anchor = _flat(nets[0])
    velocity = [torch.zeros_like(a) for a in anchor]
    in_flight = None
    out = {"params": [[] for _ in range(world)], "losses": [[] for _ in range(world)]}
    for step in range(steps):
        for r in range(world):
            opts[r].zero_grad()
            loss = loss_of(nets[r], step, r)
            loss.backward()
            opts[r].step()
            out["losses"][r].append(loss.item())
        n = step + 1
        with torch.no_grad():
            if algo["name"] == "overlap" and n % period == 0:
                if in_flight is not None:
                    arrived = _average(in_flight)
                    if algo["momentum"]:
                        velocity = [v * algo["momentum"] + (a - z)
                                    for v, a, z in zip(velocity, arrived, anchor, strict=True)]
                        anchor = [z + v for z, v in zip(anchor, velocity, strict=True)]
                    else:
                        anchor = arrived
                pulled = [[torch.lerp(x, z, algo["pull"]) for x, z in
                           zip(_flat(net), anchor, strict=True)] for net in nets]  # fmt: skip
                in_flight = [[x.clone() for x in p] for p in pulled]
                for net, p in zip(nets, pulled, strict=True):
                    _write(net, p)
            elif algo["name"] == "local":
                warm = algo.get("warmup", 0)
                if n <= warm or (n - warm) % period == 0:
                    avg = _average([_flat(net) for net in nets])
                    for net in nets:
                        _write(net, avg)
                elif algo.get("host_period") and n % algo["host_period"] == 0:
                    for h in range(hosts):
                        members = nets[h * per_host : (h + 1) * per_host]
                        avg = _average([_flat(net) for net in members])
                        for net in members:
                            _write(net, avg)
        for r in range(world):
            out["params"][r].append(_params(nets[r]))
    return out


def dies_in_flight(comm, victim: int) -> dict:
    """Overlap Local-SGD, period 2: ``victim`` starts the average at step 2 and dies in step 3.
    The others fail at a later sync with a RuntimeFault within the timeout, and their model as
    that step's local step left it (the sync changed nothing). Which sync: step 4's where the
    next average's start meets the dead peer (shared memory completes a collective as it
    starts), else step 6's wait (a start over gloo may return before the peer's death shows)."""
    import os
    import signal
    import time

    from coconet.errors import RuntimeFault

    net = model(comm.rank)
    opt = coconet.optim.OverlapLocalSGD(torch.optim.SGD(net.parameters(), lr=LR), period=2,
                                        pull=0.5, comm=comm)  # fmt: skip
    for step in range(3):
        opt.zero_grad()
        loss_of(net, step, comm.rank).backward()
        opt.step()
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(3, 7):
        opt.zero_grad()
        loss_of(net, step, comm.rank).backward()
        local = [p.detach().add(p.grad, alpha=-LR) for p in net.parameters()]  # SGD's alone
        t0 = time.perf_counter()
        try:
            opt.step()
        except RuntimeFault as e:
            same = [torch.equal(p.detach(), want) for p, want in zip(net.parameters(), local,
                                                                     strict=True)]  # fmt: skip
            return {"status": "fault", "message": str(e), "seconds": time.perf_counter() - t0,
                    "intact": all(same), "steps": opt.steps}  # fmt: skip
    return {"status": "no error"}


def refusals(comm) -> dict:
    from coconet.errors import ConfigError

    out = {}
    net = model(comm.rank)

    def attempt(label, fn):
        try:
            fn()
            out[label] = "no error"
        except ConfigError as e:
            out[label] = str(e)

    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    attempt("period", lambda: coconet.optim.LocalSGD(sgd, period=0, comm=comm))
    attempt("pull", lambda: coconet.optim.OverlapLocalSGD(sgd, period=2, pull=1.5, comm=comm))
    attempt("momentum", lambda: coconet.optim.OverlapLocalSGD(sgd, period=2, momentum=1.0,
                                                              comm=comm))  # fmt: skip
    attempt("not an optimizer", lambda: coconet.optim.LocalSGD(net, period=2, comm=comm))
    torch.manual_seed(0)  # (the same parameters on every rank, as coconet.optim checks)
    averaging = coconet.optim.SGD(nn.Linear(2, 2).parameters(), lr=LR, comm=comm)
    attempt("averaging inner", lambda: coconet.optim.LocalSGD(averaging, period=2, comm=comm))
    plain = coconet.optim.LocalSGD(sgd, period=2, comm=comm)
    overlap = coconet.optim.OverlapLocalSGD(torch.optim.SGD(net.parameters(), lr=LR), period=2,
                                            comm=comm)  # fmt: skip
    attempt("wrong kind", lambda: overlap.load_state_dict(plain.state_dict()))
    return out
