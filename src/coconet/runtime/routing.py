"""Routing: which transport runs each of a rank's groups, from evidence every rank contributes.

Every rank creates every group of the mesh over torch.distributed, in the same order (as it
requires): that group is the transport of groups that span hosts and the control channel of the
others. A group whose ranks all share one host (the same hostname, boot id and PID namespace:
``coconet.runtime.symmem.host_identity``, exchanged once) runs on shared memory instead, on CPU;
``CommOptions.transport`` can force either. Every member of a group sees the same hosts, so they
all choose alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

import torch

from coconet.errors import ConfigError
from coconet.ir.mesh import Mesh
from coconet.options import CommOptions, TransportPolicy
from coconet.runtime.shmem import SharedMemoryTransport, ShmGroup, torch_gather
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import Group, Transport

__all__ = ["Route", "control_group", "mesh_groups", "route_groups"]


class Route(NamedTuple):
    """The transport of one of this rank's groups, and the group as that transport holds it."""

    transport: Transport
    group: Group


def mesh_groups(
    mesh: Mesh, rank: int, world: int, torch_transport: TorchDistributedTransport
) -> dict[str | None, Group]:
    """This rank's group along each axis of ``mesh`` (None: the whole world), over
    torch.distributed. Collective: every rank creates every group, in the same order."""
    everyone = tuple(range(world))
    groups = {None: Group(None, everyone, rank, torch_transport.new_group(everyone, world))}
    for axis in mesh.names:
        for ranks in mesh.groups(axis):
            handle = torch_transport.new_group(ranks, world)
            if rank in ranks:
                groups[axis] = Group(axis, tuple(ranks), ranks.index(rank), handle)
    return groups


def route_groups(
    groups: dict[str | None, Group],
    hosts: Mapping[int, object],
    device: torch.device,
    options: CommOptions,
    torch_transport: TorchDistributedTransport,
    shm: SharedMemoryTransport,
) -> dict[str | None, Route]:
    """The route of each group: shared memory when its ranks share a host (``hosts``: every
    rank's host identity, by the job's global rank) and run on CPU, unless
    ``options.transport`` says otherwise."""
    policy = options.transport
    cpu = device.type == "cpu" and hasattr(os, "memfd_create")
    cache_dir = None if options.cache_dir is None else str(options.cache_dir)
    routes: dict[str | None, Route] = {}
    for axis, group in groups.items():
        one_host = len({hosts[r] for r in group.ranks}) == 1
        if policy is TransportPolicy.SHARED_MEMORY and not (one_host and cpu):
            spread = sorted({hosts[r] for r in group.ranks})
            raise ConfigError(
                f"CommOptions(transport='shared memory'), but the group along axis {axis!r} "
                + (f"spans {len(spread)} hosts" if not one_host else "is not on CPU"),
                op="CommOptions",
                details=[f"hosts: {spread}"],
                hint="use transport='auto' (shared memory where it can, torch.distributed "
                "elsewhere)",
            )
        use_shm = (
            group.size > 1 and one_host and cpu and policy is not TransportPolicy.TORCH_DISTRIBUTED
        )
        if use_shm:
            state = ShmGroup(
                group.index, group.size, torch_gather(group.handle), options.timeout, cache_dir
            )
            routes[axis] = Route(shm, Group(axis, group.ranks, group.index, state))
        else:
            routes[axis] = Route(torch_transport, group)
    return routes


def control_group(world: Route, timeout: float) -> Group | None:
    """A shared-memory group of the whole world for the control messages, of its own (None when
    the world does not run on shared memory)."""
    if not isinstance(world.transport, SharedMemoryTransport):
        return None
    g = world.group
    state = ShmGroup(g.index, g.size, g.handle.gather, timeout, g.handle.cache_dir)
    return Group(None, g.ranks, g.index, state)
