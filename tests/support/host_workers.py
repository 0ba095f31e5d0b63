"""Rank bodies for tests/dist/test_hosts.py (run by ``support.hosts.Hosts``: each host its own
namespaces and /dev/shm, torchrun agents with --nnodes)."""

from __future__ import annotations

import os
import signal

import coconet as cc
from coconet.ir.ops import Op
from coconet.options import CommOptions
from coconet.runtime import Communicator
from coconet.runtime.symmem import host_identity
from support import dist_workers


def where(comm: Communicator, mesh_axes: dict[str, int]) -> dict:
    """This rank's host as coconet's evidence sees it, and the transport of the world and of
    each axis of a ``mesh_axes`` mesh over the same processes (and the host count its
    algorithm choices are keyed by)."""
    mesh = Communicator(cc.Mesh(**mesh_axes), CommOptions(timeout=60))
    out = {
        "rank": comm.rank,
        "host": host_identity(),
        "world": comm.transport_of(None).value,
        "mesh": {axis: mesh.transport_of(axis).value for axis in mesh_axes},
        # the hosts its measured algorithm choices are keyed by (coconet.runtime.tuning)
        "key_hosts": {str(axis): mesh.tuning_key(Op.ALL_REDUCE, ">16MiB", axis).hosts
                      for axis in (None, *mesh_axes)},
    }
    mesh.close()
    return out


def _kill_my_host(kill) -> None:
    """Every process of this rank's host but its PID 1 (the torchrun agent, which cannot be
    killed from inside its PID namespace), this one last: the host's ranks die at once."""
    me = os.getpid()
    for entry in os.listdir("/proc"):  # the host's own procfs: its PID namespace only
        if entry.isdigit() and int(entry) not in (1, me):
            try:
                kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass
    kill(me, signal.SIGKILL)


def host_dies(comm: Communicator, victim: int, where: str) -> dict:
    """Rank ``victim`` kills its whole host at ``where`` ("all_gather": mid-step; "commit":
    before the commit vote), in the fused Adam step (``dist_workers.fault_peer_dies``): the
    ranks of the other host must get a fault within the timeout, their tensors as they were."""
    if comm.rank == victim:
        real = os.kill

        def kill(pid, sig):  # the victim's own SIGKILL becomes its host's
            if pid == os.getpid() and sig == signal.SIGKILL:
                _kill_my_host(real)
            real(pid, sig)

        os.kill = kill
    return dist_workers.fault_peer_dies(comm, victim, where)

