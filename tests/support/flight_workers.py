"""Rank bodies for tests/dist/test_dist_flight.py: a rank that stalls past the timeout, or is
killed, before a bare all_reduce; every rank's flight recorder dumps into ``directory``."""

from __future__ import annotations

import os
import signal
import time

import torch

from coconet.errors import RuntimeFault
from coconet.ir.ops import ReduceOp
from coconet.runtime import CommOptions, Communicator

TIMEOUT = 2.0


def stall_or_kill(comm, how: str, directory: str) -> dict:
    os.environ["COCONET_FLIGHT_DIR"] = directory
    c = Communicator(None, CommOptions(timeout=TIMEOUT))
    x = torch.ones(4)
    for k in range(3):
        c.wait(c.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label=f"x{k}"))
    if comm.rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(TIMEOUT + 1.5)
    started = time.monotonic()
    try:
        c.wait(c.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=False, label="late"))
        return {"status": "finished"}
    except RuntimeFault as exc:
        c.abort(f"rank {comm.rank}: {type(exc).__name__}")  # what a script's exit tells its peers
        return {"status": "fault", "message": str(exc), "seconds": time.monotonic() - started,
                "calls": c.guard.recorder.seq}  # fmt: skip
