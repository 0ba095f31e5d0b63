"""Rank functions for host replicas (``coconet.runtime.replica``, ``test_dist_replica.py``).

A step whose published gather is committed into a host replica writes each rank's new slice into
the replica's spare buffer and the commit flips it: it must compute bit for bit what the same
step computes on per-rank tensors (and what the simulator computes), and a step that fails on
any rank, at any point before the flip, must leave every surviving rank's parameters (the live
buffer) and state as they were.
"""

from __future__ import annotations

import os
import random
import signal
import time

import torch

import coconet as cc
from coconet.errors import ConfigError, RuntimeFault
from coconet.runtime import Communicator
from coconet.testing import rank_inputs


def _grad(k: int, rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(size, generator=g)


def _replica_inputs(comm: Communicator, step, sched, mod, size: int, seed: int):
    """(the replica, this rank's inputs with ``p`` its live buffer, the simulator's inputs)."""
    full = mod.make_inputs(comm.world, size, seed=seed, step=1)
    mine = rank_inputs(sched.program, full, comm.mesh, comm.rank)
    replica = step.host_replica("p", (size,))
    if comm.rank == 0:  # one copy per host: one writer
        replica.live().copy_(mine["p"])
    comm.control.barrier("replica written")
    mine["p"] = replica.live()
    return replica, mine, full


def equals_per_rank(comm: Communicator, example: str, size: int, steps: int) -> dict:
    """``example``'s fuse_RS_C_AG with ``p`` a host replica, against the same compiled program
    on per-rank tensors, step by step (random per-rank delays), and its first step against the
    simulator."""
    from support.examples_loader import load_example

    rng = random.Random(comm.rank)
    mod = load_example(example)
    sched = mod.SCHEDULES["fuse_RS_C_AG"](mod.program())
    step = cc.compile(sched, comm=comm, fused_kernels=False, commit="swap")
    plain_step = cc.compile(sched, comm=comm, fused_kernels=False, commit="swap")
    replica, mine, full = _replica_inputs(comm, step, sched, mod, size, seed=5)
    plain = rank_inputs(sched.program, full, comm.mesh, comm.rank)
    g = step.input_buffer("g", (size,))
    names = [u.inputs[0].name for u in sched.program.updates]  # p and the optimizer's state
    ptrs, equal, holds = [], True, True
    sim_equal = None
    for k in range(steps):
        grad = _grad(k, comm.rank, size)
        for inputs, fn in ((mine, step), (plain, plain_step)):
            inputs["step"] = float(k + 1)
            if rng.random() < 0.3:
                time.sleep(rng.random() * 2e-3)
            if fn is step:
                g.copy_(grad)
                inputs["g"] = g
            else:
                inputs["g"] = grad.clone()
        step(**mine)
        plain_step(**plain)
        if k == 0:
            sim_in = dict(full)
            sim_in["g"] = [_grad(0, r, size) for r in range(comm.world)]
            sim = cc.simulate(sched.program, sim_in, comm.mesh)
            sim_equal = all(
                torch.equal(mine[name], sim.updates[name][comm.rank]) for name in names
            )
        ptrs.append(mine["p"].data_ptr())
        holds = holds and replica.holds(mine["p"])
        equal = equal and all(torch.equal(mine[n], plain[n]) for n in names)
    return {
        "equal": equal,
        "simulator": sim_equal,
        "flips": len(set(ptrs)) == 2 and all(a != b for a, b in zip(ptrs, ptrs[1:], strict=False)),
        "holds": holds,
    }


def _dies_after(fn):
    """``fn``, after which this process is SIGKILLed."""

    def then_dies(*args, **kwargs):
        out = fn(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    return then_dies


def killed_before_flip(comm: Communicator, victim: int, where: str) -> dict:
    """Rank ``victim`` dies after it wrote its slice of the spare buffer: before it posted that
    (``where="kernel"``), or after the gather closed, before the commit vote
    (``where="gather"``). Every survivor must fail the step with a RuntimeFault and keep its
    parameters (the live buffer, the tensor it passed) and state as they were."""
    from support.examples_loader import load_example

    mod = load_example("adam")
    sched = mod.SCHEDULES["fuse_RS_C_AG"](mod.program())
    step = cc.compile(sched, comm=comm, fused_kernels=False, commit="swap")
    size = 1001
    replica, mine, _ = _replica_inputs(comm, step, sched, mod, size, seed=6)
    mine["g"] = _grad(0, comm.rank, size)
    step(**mine)  # one good step: the replica has flipped once
    before = {name: mine[name].clone() for name in ("p", "m", "v")}
    live_before = replica.live().clone()
    if comm.rank == victim:
        if where == "kernel":  # its slice written, not yet posted
            kernel = step.kernels._kernels["fused_1"]
            kernel.fn = _dies_after(kernel.fn)
        else:  # posted and gathered, before the vote
            channel = comm.one_pass(None)
            channel.finish = _dies_after(channel.finish)
    mine["g"] = _grad(1, comm.rank, size)
    mine["step"] = 2.0
    t0 = time.perf_counter()
    try:
        step(**mine)
    except RuntimeFault as e:
        status, message = "fault", str(e)
    else:
        status, message = "committed", ""
    return {
        "status": status,
        "message": message,
        "seconds": time.perf_counter() - t0,
        "unchanged": all(torch.equal(mine[n], before[n]) for n in ("p", "m", "v")),
        "live_unchanged": torch.equal(replica.live(), live_before),
        "holds": replica.holds(mine["p"]),
    }


def refusals(comm: Communicator) -> dict:
    """What cannot be a host replica: a step that computes ``p`` on every rank (AR_C), and any
    step on a communicator over torch.distributed."""
    from support.examples_loader import load_example

    mod = load_example("adam")
    out = {}
    ar_c = cc.compile(mod.SCHEDULES["AR_C"](mod.program()), comm=comm, fused_kernels=False)
    try:
        ar_c.host_replica("p", (64,))
    except ConfigError as e:
        out["AR_C"] = str(e)
    gloo = cc.runtime.Communicator(
        comm.mesh, cc.runtime.CommOptions(transport="torch.distributed", timeout=30)
    )
    try:
        gloo.host_replica((64,), torch.float32)
    except ConfigError as e:
        out["gloo"] = str(e)
    gloo.close()
    return out


def optimizer_matches_torch(comm: Communicator, frozen_steps: int) -> dict:
    """``coconet.optim.Adam(param_storage="host-shared")`` on a small model, each rank its half
    of the batch, against one process's ``torch.optim.Adam`` over the whole batch (the mean of
    the ranks' gradients). With ``frozen_steps``, the second layer has no gradient for that
    many first steps (each parameter's own step count: the mixed path). Every rank starts from
    the same weights (checked at construction); the host's one copy is written by rank 0."""
    import coconet.optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    opt = coconet.optim.Adam(
        model.parameters(), lr=1e-2, weight_decay=1e-2, comm=comm, param_storage="host-shared"
    )
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=1e-2)
    started = [p.detach().clone() for p in model.parameters()]
    same_start = all(torch.equal(a, b) for a, b in zip(started, ref.parameters(), strict=True))
    rows = 4
    for k in range(6):
        gen = torch.Generator().manual_seed(50 + k)
        x = torch.randn(rows * comm.world, 6, generator=gen)
        y = torch.randn(rows * comm.world, 3, generator=gen)
        mine = slice(rows * comm.rank, rows * (comm.rank + 1))
        frozen = k < frozen_steps
        for net, o, xs, ys in ((model, opt, x[mine], y[mine]), (ref, ropt, x, y)):
            o.zero_grad()
            h = net[1](net[0](xs))
            w, b = net[2].weight, net[2].bias
            if frozen:  # no gradient for the last layer: it is not stepped
                w, b = w.detach(), b.detach()
            loss = torch.nn.functional.mse_loss(torch.nn.functional.linear(h, w, b), ys)
            loss.backward()
            o.step()
    errs = [
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    ]
    bucket = opt.buckets[0]
    return {
        "same_start": same_start,
        "max_rel_err": max(errs),
        "attached": all(
            p.data_ptr() == bucket.flat[bucket.span(i)[0]:].data_ptr()
            for i, p in enumerate(bucket.params)
        ),
        "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
    }
