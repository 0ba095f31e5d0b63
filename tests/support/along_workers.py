"""Rank bodies for tests/dist/test_dist_along.py: steps compiled with ``Communicator.along``
run by one group of a larger mesh while the other groups do other work."""

from __future__ import annotations

import os
import signal
import time

import torch

import coconet as cc
from coconet.errors import ConfigError, RuntimeFault
from coconet.testing import check_distributed


def groups_run_their_own_steps(comm) -> dict:
    """Mesh(pp=2, tp=2): the two tp groups compile and run different programs, a different
    number of times, each against the simulator; the pp groups then run one of their own."""
    from support import dist_programs as dp

    pp = comm.mesh.index_in(comm.rank, "pp")
    tp = comm.along("tp")
    out = {"rank": tp.rank, "world": tp.world, "members": list(tp.members),
           "cached": comm.along("tp") is tp, "repr": repr(tp)}  # fmt: skip
    errors = []
    if pp == 0:
        for seed in range(3):  # a step whose agreement must not wait for the other group
            r = check_distributed(dp.collectives(), dp.collectives_inputs(2, 5, seed=seed),
                                  comm=tp, verbose=False, fused_kernels=False)  # fmt: skip
            errors.append(r.max_rel_error)
    else:
        time.sleep(0.5)  # arrive late: the other group does not wait for this one
        r = check_distributed(dp.prod_and_ints(), dp.prod_and_ints_inputs(2, 4, seed=7),
                              comm=tp, verbose=False, fused_kernels=False)  # fmt: skip
        errors.append(r.max_rel_error)
    ppc = comm.along("pp")
    r = check_distributed(dp.collectives(), dp.collectives_inputs(2, 3, seed=11 + tp.rank),
                          comm=ppc, verbose=False, fused_kernels=False)  # fmt: skip
    errors.append(r.max_rel_error)
    out["errors"] = errors
    out["pp members"] = list(ppc.members)
    try:
        comm.along("dp")
    except ConfigError as e:
        out["bad axis"] = str(e)
    return out


def a_group_member_dies(comm, victim: int) -> dict:
    """``victim`` (a rank of the tp group of stage 0) dies in a step along tp: its peer gets a
    RuntimeFault within the timeout; the tp group of stage 1 is not disturbed and runs on."""
    N = cc.Dim("N")
    x = cc.Tensor("x", cc.float32, [N], cc.Local)
    program = cc.Program("sum_along_tp", [x], {"y": cc.all_reduce(x, axis="tp")})
    tp = comm.along("tp")
    step = cc.compile(program, comm=tp, fused_kernels=False)
    mine = torch.full((64,), float(comm.rank))
    step(x=mine)  # every group once
    t0 = time.perf_counter()
    try:
        for _ in range(5):
            if comm.rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            y = step(x=mine)["y"]
        status = "no error"
        value = y[0].item()
    except RuntimeFault as e:
        status, value = f"RuntimeFault: {str(e).splitlines()[0]}", None
    return {"status": status, "seconds": time.perf_counter() - t0, "value": value}
