"""Ranks for the randomized Ctrl-C trials (tests/dist/test_dist_interrupts.py).

One pair of processes runs many trials. In each, both ranks make a fresh communicator and step a
small compiled program in a loop; the victim is sent SIGINT by a timer at a random moment (inside
a step, in its local checks, in the agreement, the commit, or between steps: wherever it lands).
The victim must raise ``KeyboardInterrupt`` promptly (a Ctrl-C never acted on is *lost*), and the
peer must get a ``RuntimeFault`` promptly (told by the victim's abort, not at its timeout). The
ranks meet again through the job's store (never through the broken communicator) and start the
next trial on a new communicator.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import torch
import torch.distributed as dist

import coconet as cc
from coconet.errors import RuntimeFault
from coconet.runtime import Communicator

N = 256
STEPS = 400  # a trial's bound: far past the signal (a lost Ctrl-C runs them all)


def program() -> cc.Program:
    n = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [n], cc.Local)
    p = cc.Tensor("p", cc.float32, [n], cc.Replicated)
    m = cc.Tensor("m", cc.float32, [n], cc.Replicated)
    lr, beta = cc.Scalar("lr"), cc.Scalar("beta")
    g_sum = cc.all_reduce(g, name="g_sum")
    m_new = (beta * m + g_sum).named("m_new")
    p_new = (p - lr * m_new).named("p_new")
    return cc.Program("momentum", [g, p, m, lr, beta], [cc.update(p, p_new), cc.update(m, m_new)])


def _meet(store, tag: str, world: int, rank: int) -> None:
    store.set(f"sigint/{tag}/{rank}", "1")
    store.wait([f"sigint/{tag}/{r}" for r in range(world)])


def trials(comm: Communicator, victim: int, count: int, seed: int, schedule: str) -> list[dict]:
    """``count`` trials (see the module); one dict per trial on each rank."""
    from coconet.schedule import fuse_RS_C_AG

    store = dist.distributed_c10d._get_default_store()
    rng = random.Random(seed)
    program_ = program()
    target = fuse_RS_C_AG(program_) if schedule == "fuse_RS_C_AG" else program_
    options, mesh = comm.options, comm.mesh
    comm.close()  # each trial makes its own
    out = []
    for k in range(count):
        _meet(store, f"{seed}/{k}/start", comm.world, comm.rank)
        trial = Communicator(mesh, options)
        step = cc.compile(target, comm=trial, fused_kernels=False)
        g = torch.full((N,), float(trial.rank + 1))
        p, m = torch.ones(N), torch.zeros(N)
        step(g=g, p=p, m=m, lr=0.01, beta=0.9)  # the first step: agreed and warm
        delay = rng.uniform(0.0, 0.02)
        sent = [None]

        def interrupt(sent=sent) -> None:
            sent[0] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(delay, interrupt) if trial.rank == victim else None
        status, raised_at, steps = "finished", None, 0
        try:
            if timer is not None:
                timer.start()
            for steps in range(1, STEPS + 1):  # noqa: B007 - counted for the report
                step(g=g, p=p, m=m, lr=0.01, beta=0.9)
        except KeyboardInterrupt:
            status, raised_at = "KeyboardInterrupt", time.monotonic()
            if not trial.broken:
                # raised between two steps: the script leaves, and its peers see it go; here
                # the process stays for the next trial, so it says so itself
                trial.abort("interrupted between steps")
                status = "KeyboardInterrupt between steps"
        except RuntimeFault as exc:
            status, raised_at = "RuntimeFault", time.monotonic()
            first = str(exc).splitlines()[0]
            status += f": {first[:120]}"
        finally:
            if timer is not None:
                timer.join()
        # the peer's fault must come from the victim's abort: both report monotonic times
        # (one clock on one host)
        store.set(f"sigint/{seed}/{k}/raised/{trial.rank}", repr(raised_at))
        if sent[0] is not None:
            store.set(f"sigint/{seed}/{k}/sent", repr(sent[0]))
        _meet(store, f"{seed}/{k}/end", comm.world, comm.rank)
        sent_at = float(store.get(f"sigint/{seed}/{k}/sent").decode())
        # Rank 0 holds the store: it waits until every rank is done reading it (a rank still
        # reading when rank 0's process ends would see the connection reset).
        store.set(f"sigint/{seed}/{k}/read/{trial.rank}", "1")
        if trial.rank == 0:
            store.wait([f"sigint/{seed}/{k}/read/{r}" for r in range(comm.world)])
        out.append(
            dict(
                status=status,
                steps=steps,
                after_signal=None if raised_at is None else raised_at - sent_at,
            )
        )
        trial.close()
    return out
