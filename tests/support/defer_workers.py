"""Workers for the deferred collective (``coconet.schedule.defer``): Overlap Local-SGD's sync
as a coconet program whose average is started at the end of one sync and waited for at the
next, checked call by call against the simulator (the program's meaning, undeferred)."""

from __future__ import annotations

import os
import signal
import time

import torch

import coconet as cc
from coconet.errors import RuntimeFault
from coconet.schedule import Schedule
from support import local_sgd_workers as lsw

N = 37  # uneven over 2-4 ranks: the reduce_scatter's slices differ


def sync_program(dtype: cc.DType = cc.float32) -> cc.Program:
    """Overlap Local-SGD's sync (Wang, Liang, Joshi): the anchor ``z`` moves to the average ``a``
    that arrived (with momentum ``v``), each rank's model ``x`` is pulled toward it, and the
    average of the pulled models is what the next sync reads as ``a``."""
    n = cc.Dim("N")
    x = cc.Tensor("x", dtype, [n], cc.Local)
    z = cc.Tensor("z", dtype, [n], cc.Replicated)
    v = cc.Tensor("v", dtype, [n], cc.Replicated)
    a = cc.Tensor("a", dtype, [n], cc.Replicated)
    pull, momentum = cc.Scalar("pull", dtype), cc.Scalar("momentum", dtype)
    v_new = (momentum * v + (a - z)).named("v_new")
    z_new = (z + v_new).named("z_new")
    x_new = (x + pull * (z_new - x)).named("x_new")
    a_new = cc.all_reduce(x_new, cc.ReduceOp.MEAN, name="a_new")
    return cc.Program("overlap_sync", [x, z, v, a, pull, momentum], [
        cc.update(x, x_new), cc.update(z, z_new), cc.update(v, v_new), cc.update(a, a_new)])


def deferred(program: cc.Program | None = None, split: bool = False) -> Schedule:
    """The sync with its average deferred (``split``: as a reduce_scatter in the step and an
    all_gather deferred to the next call)."""
    s = Schedule(program or sync_program())
    if split:
        _, ag = s.split("a_new_sum")
        s.defer(ag)
    else:
        s.defer("a_new_sum")
    return s


def _initial(world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    start = torch.randn(N, generator=g)
    return {"x": [start + 0.1 * torch.randn(N, generator=g) for _ in range(world)],
            "z": start.clone(), "v": torch.zeros(N), "a": start.clone(),
            "pull": 0.5, "momentum": 0.3}


def _local_steps(x: torch.Tensor, rank: int, call: int) -> None:
    """What runs between two syncs (Local-SGD's local steps): a different move per rank."""
    x.mul_(0.9).add_(0.01 * (rank + 1) * (call + 1))


def simulated(world: int, calls: int) -> list[dict]:
    """The program's meaning: every rank's values after each call, a step at a time."""
    state = _initial(world)
    xs = [x.clone() for x in state["x"]]
    out = []
    for call in range(calls):
        for r in range(world):
            _local_steps(xs[r], r, call)
        inputs = {**state, "x": [x.clone() for x in xs]}
        res = cc.simulate(sync_program(), inputs, world)
        xs = [t.clone() for t in res.updates["x"]]
        state.update({k: res.updates[k][0].clone() for k in ("z", "v", "a")})
        out.append({"x": [x.numpy().copy() for x in xs],
                    **{k: state[k].numpy().copy() for k in ("z", "v", "a")}})
    return out


def run(comm, calls: int, land_after: int, split: bool = False) -> dict:
    """The deferred program on the ranks: x, z, v after each call; ``a`` where it has landed
    (after ``land_after``'s explicit ``wait_deferred`` and at the end)."""
    step = cc.compile(deferred(split=split), comm=comm)
    state = _initial(comm.world)
    x = state.pop("x")[comm.rank].clone()
    rows, in_flight = [], []
    for call in range(calls):
        _local_steps(x, comm.rank, call)
        step(x=x, **state)
        in_flight.append(step.deferred_in_flight)
        row = {"x": x.numpy().copy(), "z": state["z"].numpy().copy(),
               "v": state["v"].numpy().copy(), "a": None}
        if call in (land_after, calls - 1):
            step.wait_deferred()
            row["a"] = state["a"].numpy().copy()
        rows.append(row)
    return {"rows": rows, "in_flight": in_flight, "source": step.source}


def dies_in_flight(comm, victim: int) -> dict:
    """``victim`` starts its average at sync 2 and dies: the others' next sync fails with a
    RuntimeFault within the timeout, and leaves x, z and v as sync 2 committed them."""
    step = cc.compile(deferred(), comm=comm)
    state = _initial(comm.world)
    x = state.pop("x")[comm.rank].clone()
    for call in range(2):
        _local_steps(x, comm.rank, call)
        step(x=x, **state)
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    before = {k: t.clone() for k, t in (("x", x), ("z", state["z"]), ("v", state["v"]))}
    _local_steps(x, comm.rank, 2)
    moved = x.clone()
    t0 = time.monotonic()
    try:
        step(x=x, **state)
        status = "no fault"
    except RuntimeFault:
        status = "fault"
    intact = (torch.equal(x, moved) and torch.equal(state["z"], before["z"])
              and torch.equal(state["v"], before["v"]))
    return {"status": status, "seconds": time.monotonic() - t0, "intact": intact,
            "left": step.deferred_in_flight}


# -- the program in a training loop: Overlap Local-SGD written as a coconet program ------------


def model32(rank: int = 0) -> torch.nn.Module:
    """``local_sgd_workers.model`` with its float64 parameter in float32 (one flat buffer)."""
    net = lsw.model(rank)
    net.scale = torch.nn.Parameter(net.scale.detach().float())
    return net


def train(comm, algo: dict, steps: int) -> dict:
    """``algo`` (``local_sgd_workers``' overlap kind) with the sync as the deferred program:
    every ``period``-th step the flat model goes through it; between syncs its average is in
    flight while the local steps run. Every rank's parameters after each step."""
    net = model32(0)  # every rank starts from rank 0's model, as the optimizer makes it
    opt = lsw.inner(net, algo["inner"])
    step = cc.compile(deferred(), comm=comm)
    (flat,) = lsw._flat(net)
    state = {"z": flat.clone(), "v": torch.zeros_like(flat), "a": flat.clone(),
             "pull": algo["pull"], "momentum": algo["momentum"]}
    params = []
    for n in range(steps):
        opt.zero_grad()
        lsw.loss_of(net, n, comm.rank).backward()
        opt.step()
        if (n + 1) % algo["period"] == 0:
            (x,) = lsw._flat(net)
            step(x=x, **state)
            lsw._write(net, [x])
        params.append([p.detach().numpy().copy() for p in net.parameters()])
    return {"params": params, "in_flight": step.deferred_in_flight}
