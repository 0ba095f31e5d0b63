"""A communicator of one rank for unit tests that build ``coconet.nn`` layers in the test
process and never run their steps (construction, conversion, argument checks, pickling).

A real one needs a torch.distributed process group, which would outlive the test in the
process pytest runs every unit test in; a layer reads only the mesh and the rank of its
communicator until its first step compiles, so that is all this one has. A test that calls a
layer with a good input needs ranks of its own (tests/dist, ``coconet.runtime.spawn``)."""

from __future__ import annotations

from coconet import Mesh
from coconet.runtime.comm import Communicator


def one_rank_comm() -> Communicator:
    comm = Communicator.__new__(Communicator)  # without _build: no process group, no transport
    comm.mesh, comm.rank, comm.world, comm.members = Mesh.world(1), 0, 1, (0,)
    return comm
