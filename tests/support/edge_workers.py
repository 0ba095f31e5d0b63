"""Ranks for the faults at the edges of a step (tests/dist/test_dist_edges.py): a Ctrl-C in the
local checks before the agreement, a peer killed while this rank compiles its first step."""

from __future__ import annotations

import os
import signal
import time

import torch

import coconet as cc
from coconet.errors import RuntimeFault
from coconet.runtime import Communicator
from coconet.schedule import fuse_RS_C_AG
from support.sigint_workers import program

N = 64


def _inputs(rank: int) -> dict:
    return dict(g=torch.full((N,), float(rank + 1)), p=torch.ones(N), m=torch.zeros(N),
                lr=0.01, beta=0.9)


def _run(step, mine: dict) -> dict:
    before = {k: v.clone() for k, v in mine.items() if isinstance(v, torch.Tensor)}
    t0 = time.perf_counter()
    try:
        step(**mine)
        status, message = "no error", ""
    except KeyboardInterrupt:
        status, message = "KeyboardInterrupt", ""
    except RuntimeFault as exc:
        status, message = "RuntimeFault", str(exc)
    unchanged = all(torch.equal(before[k], mine[k]) for k in before)
    return dict(status=status, message=message, seconds=time.perf_counter() - t0,
                unchanged=unchanged)


def interrupted_in_local_checks(comm: Communicator, victim: int) -> dict:
    """Ctrl-C on ``victim`` while it checks its inputs, before the per-step agreement: the
    peers, already waiting in the agreement, are told at once (not at their timeout)."""
    step = cc.compile(fuse_RS_C_AG(program()), comm=comm, fused_kernels=False)
    mine = _inputs(comm.rank)
    step(**dict(mine, p=mine["p"].clone(), m=mine["m"].clone()))  # warm
    if comm.rank == victim:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt()

        step._bind = interrupted
    else:
        time.sleep(0.3)  # in the agreement well before the victim's Ctrl-C
    out = _run(step, mine)
    out["broken"] = comm.broken
    if comm.rank == victim:
        time.sleep(3.0)  # alive: the peers must learn from the abort, not from this exit
    return out


def killed_while_peer_compiles(comm: Communicator, victim: int, watch_pids: bool) -> dict:
    """``victim`` is killed as it starts compiling its first step's kernels, while the peers
    compile theirs for far longer than the timeout (a cold Inductor cache): the peers notice
    during their compile. ``watch_pids=False`` hides the peers' pids, as for ranks on other
    hosts: then their heartbeat in the store stops."""
    if not watch_pids:
        comm.control.set_peer_pids({})
    step = cc.compile(fuse_RS_C_AG(program()), comm=comm, fused_kernels=True)
    for kernel in step.kernels._kernels.values():
        # stand-ins for torch.compile: the eager kernel, after dying (victim) or a long compile
        def compiled(*args, eager=kernel.eager, first=[True]):  # noqa: B006 - per kernel
            if first[0]:
                first[0] = False
                if comm.rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(30.0)
            return eager(*args)

        kernel.fn = compiled
    return _run(step, _inputs(comm.rank))


def differing_lr(comm: Communicator) -> dict:
    """The ranks' coconet.optim.AdamW differ in ``lr``: built so, the construction refuses on
    every rank (the param groups are compared when added); changed on one rank afterwards (a
    scheduler stepped on one rank only), the step's error names ``lr``, which the user set, not
    only the program's derived inputs (``step_size``, ``decay``)."""
    import coconet.optim
    from coconet.errors import ConfigError

    w = torch.nn.Parameter(torch.ones(8))
    try:
        coconet.optim.AdamW([w], lr=0.1 if comm.rank == 0 else 0.2, comm=comm)
        built = "no error"
    except ConfigError as exc:
        built = str(exc)
    opt = coconet.optim.AdamW([w], lr=0.1, comm=comm)
    if comm.rank == 1:
        opt.param_groups[0]["lr"] = 0.2
    w.sum().backward()
    before = w.detach().clone()
    try:
        opt.step()
        status, message = "no error", ""
    except RuntimeFault as exc:
        status, message = "RuntimeFault", str(exc)
    return dict(status=status, message=message, unchanged=torch.equal(before, w.detach()),
                built=built)
