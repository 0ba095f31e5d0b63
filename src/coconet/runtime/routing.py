"""Routing: which transport runs each of a rank's groups, from evidence every rank contributes.

Every rank creates every group of the mesh over torch.distributed, in the same order (as it
requires): that group is the transport of groups that span hosts and the control channel of the
others. A group whose ranks all share one host (the same hostname, boot id and PID namespace:
``coconet.runtime.symmem.host_identity``, exchanged once) runs on shared memory instead, on CPU;
``CommOptions.transport`` can force either. A group that spans hosts runs hierarchically
(``coconet.runtime.hierarchy``): in two levels by local index where every host holds as many of
its ranks, through one leader per host where they do not (``levels_plan``); for it every rank
also creates, after the host identities are known, the torch.distributed group of each host's
members (the shared-memory group's setup channel; ``host_levels``). Every member of a group sees
the same hosts, so they all choose alike, and every rank creates the same groups in the same
order.

Point-to-point channels are routed here too (``peer_plan``): each (source, destination) pair of
a group that will carry messages (a pipeline's stage boundaries) runs over shared memory when
both ranks are in the shared-memory group that routing made for this rank's host along that
axis, over torch.distributed's pair messages otherwise (``Link.why`` says which and why).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from coconet.errors import ConfigError
from coconet.ir.mesh import Mesh
from coconet.options import AlgorithmPolicy, CommOptions, TransportKind, TransportPolicy
from coconet.runtime.hierarchy import CrossHost, HierarchicalTransport, HierGroup, HostLayout
from coconet.runtime.p2p import ChannelSpec, Link, PeerPlan
from coconet.runtime.shmem import SharedMemoryTransport, ShmGroup, control_area, torch_gather
from coconet.runtime.torchdist import TorchDistributedTransport
from coconet.runtime.transport import Group, Transport

__all__ = ["RING_BYTES", "Levels", "Route", "control_group", "host_group", "host_levels",
           "levels_plan", "mesh_groups", "peer_plan", "plan_links", "route_groups"]  # fmt: skip


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


class Levels(NamedTuple):
    """How one of this rank's groups runs over its hosts: its layout and plan, this rank's
    host's members (with their torch.distributed process group, the shared-memory group's
    setup channel) and whom this rank exchanges with across hosts, point to point: its
    counterparts with the same local index (``CrossHost.BY_LOCAL_INDEX``; no group of their
    own) or the hosts' leaders (``CrossHost.THROUGH_LEADERS``; two leaders have a process
    group of their own, for their all_reduce)."""

    layout: HostLayout
    plan: CrossHost
    local: Group
    cross: Group


def _cpu(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(os, "memfd_create")


def wants_levels(options: CommOptions, device: torch.device) -> bool:
    """Whether groups that span hosts may run hierarchically with these options (the same on
    every rank: every rank must create the same groups)."""
    return (
        _cpu(device)
        and options.transport in (TransportPolicy.AUTO, TransportPolicy.HIERARCHICAL)
        and options.algorithms is not AlgorithmPolicy.EXACT
    )


def _in_rank_order(ranks: tuple[int, ...], positions: list[int]) -> bool:
    return [ranks[p] for p in positions] == sorted(ranks[p] for p in positions)


def levels_plan(ranks: tuple[int, ...], layout: HostLayout) -> CrossHost | None:
    """How a group of ``ranks`` (the job's, in group order) runs over its hosts (None: flat, or
    one host): the layout's plan (``HostLayout.plan``), where each host's members come in
    global-rank order (torch numbers a process group's members so, and the shared-memory
    group's index is the member's local index). Two levels by local index also want each
    local index's members in global-rank order (conservative: the exchanges address global
    ranks and need no group); a homogeneous layout without it goes through leaders, which
    exchange among the leaders alone."""
    plan = layout.plan
    if plan is None or not all(
        _in_rank_order(ranks, layout.members(h)) for h in range(layout.hosts)
    ):
        return None
    if plan is CrossHost.BY_LOCAL_INDEX and not all(
        _in_rank_order(ranks, layout.counterparts(local)) for local in range(layout.per_host)
    ):
        return CrossHost.THROUGH_LEADERS
    return plan


def host_levels(
    mesh: Mesh,
    rank: int,
    world: int,
    hosts: Mapping[int, object],
    torch_transport: TorchDistributedTransport,
) -> dict[str | None, Levels]:
    """This rank's ``Levels`` of each of its groups that run over hosts (``levels_plan``).
    Collective: every rank creates the process groups of every host's members (2 or more) of
    every such group of the mesh, in the same order (as ``mesh_groups``: the world, then each
    axis's groups in mesh order; each host in host order), each set of ranks once, whichever
    plan the group takes: every rank sees the same hosts, so every rank creates the same
    groups. Across hosts the exchanges are point to point (no group), but for two leaders
    (``CrossHost.THROUGH_LEADERS`` over 2 hosts) every rank also makes their process group, after
    the hosts' (their all_reduce is gloo's: ``hierarchy.HierarchicalTransport._leaders_across``)."""
    made: dict[tuple[int, ...], Any] = {}

    def level(ranks: tuple[int, ...]) -> Any:
        if ranks not in made:
            made[ranks] = torch_transport.new_group(ranks, world)
        return made[ranks]

    out: dict[str | None, Levels] = {}
    every: list[tuple[str | None, list[int]]] = [(None, list(range(world)))]
    every += [(axis, ranks) for axis in mesh.names for ranks in mesh.groups(axis)]
    for axis, group_ranks in every:
        ranks = tuple(group_ranks)
        layout = HostLayout.of([hosts[r] for r in ranks])
        plan = levels_plan(ranks, layout)
        if plan is None:
            continue
        local_sets = [tuple(ranks[p] for p in layout.members(h)) for h in range(layout.hosts)]
        for s in local_sets:
            if len(s) > 1:  # (a host of one has no inside level)
                level(s)
        # two leaders all_reduce on gloo (``_leaders_across``): their group
        leaders = tuple(ranks[q] for q in layout.leaders)
        pair = level(leaders) if plan is CrossHost.THROUGH_LEADERS and len(leaders) == 2 else None
        if rank in ranks:
            p = ranks.index(rank)
            h, lo = layout.host_of[p], layout.local_of[p]
            across = (
                layout.counterparts(lo) if plan is CrossHost.BY_LOCAL_INDEX else layout.leaders
            )
            out[axis] = Levels(
                layout,
                plan,
                Group(axis, local_sets[h], lo, made.get(local_sets[h])),
                Group(axis, tuple(ranks[q] for q in across), h, pair),
            )
    return out


def route_groups(
    groups: dict[str | None, Group],
    hosts: Mapping[int, object],
    device: torch.device,
    options: CommOptions,
    torch_transport: TorchDistributedTransport,
    shm: SharedMemoryTransport,
    hier: HierarchicalTransport | None = None,
    levels: Mapping[str | None, Levels] | None = None,
) -> dict[str | None, Route]:
    """The route of each group: shared memory when its ranks share a host (``hosts``: every
    rank's host identity, by the job's global rank) and run on CPU; hierarchical (``hier``)
    when it has ``levels`` (``host_levels``: two levels or through leaders); torch.distributed
    otherwise; unless ``options.transport`` says otherwise."""
    policy = options.transport
    cpu = _cpu(device)
    cache_dir = None if options.cache_dir is None else str(options.cache_dir)
    levels = levels or {}
    routes: dict[str | None, Route] = {}
    for axis, group in groups.items():
        one_host = len({hosts[r] for r in group.ranks}) == 1
        if policy is TransportPolicy.HIERARCHICAL and not one_host and (
            axis not in levels or hier is None
        ):
            layout = HostLayout.of([hosts[r] for r in group.ranks])
            raise ConfigError(
                f"CommOptions(transport='hierarchical'), but the group along axis {axis!r} "
                "cannot run over its hosts hierarchically",
                op="CommOptions",
                details=[
                    f"its ranks by host: "
                    f"{[[group.ranks[p] for p in layout.members(h)] for h in range(layout.hosts)]}",
                    f"algorithms: {options.algorithms}, device: {device}",
                ],
                hint="the hierarchical transport needs CPU, algorithms other than 'exact' (its "
                "sums are over hosts of each host's sum, not in rank order) and each host's "
                "ranks of the group in increasing order; transport='auto' runs such a group "
                "flat",
            )
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
                group.index, group.size, torch_gather(group.handle), options.timeout, cache_dir,
                ranks=group.ranks,
            )
            routes[axis] = Route(shm, Group(axis, group.ranks, group.index, state))
        elif axis in levels and hier is not None and not one_host:
            lv = levels[axis]
            local = None  # a host of one: no inside level
            if lv.local.size > 1:
                local = ShmGroup(
                    lv.local.index, lv.local.size, torch_gather(lv.local.handle),
                    options.timeout, cache_dir, ranks=lv.local.ranks,
                )
            state = HierGroup(
                layout=lv.layout,
                plan=lv.plan,
                local=Group(axis, lv.local.ranks, lv.local.index, local),
                cross=lv.cross,
                flat=group,
            )
            routes[axis] = Route(hier, Group(axis, group.ranks, group.index, state))
        else:
            routes[axis] = Route(torch_transport, group)
    return routes


def control_group(world: Route, timeout: float) -> Group | None:
    """A shared-memory group of the whole world for the control messages, of its own (None when
    the world does not run on shared memory). Collective: its segment is made here, with room
    for the largest control round (``shmem.control_area``: a small all_reduce may ride with the
    agreement), so that no round ever has to grow it."""
    if not isinstance(world.transport, SharedMemoryTransport):
        return None
    g = world.group
    state = ShmGroup(g.index, g.size, g.handle.gather, timeout, g.handle.cache_dir,
                     ranks=g.ranks)  # fmt: skip
    state.reserve(control_area(g.size))
    return Group(None, g.ranks, g.index, state)


# -- point-to-point channels -----------------------------------------------------------------------

# The most bytes one point-to-point channel's ring may take (in its source's memory); a channel
# that needs more (huge activations x many micro-batches) goes over torch.distributed. 256 MiB
# holds 8 micro-batches of a 2 x 2048 x 4096 float32 activation.
RING_BYTES = 256 << 20


def host_group(route: Route, policy: TransportPolicy, device: torch.device, member: str = "rank"
               ) -> tuple[Group | None, str]:  # fmt: skip
    """This rank's shared-memory group of its host in ``route``'s group, as routing made it
    (its handle a ``ShmGroup``), or None and why there is none:

    - the group is on shared memory (all its ranks on one host, CPU, ``CommOptions(transport=
      ...)`` not forcing torch.distributed): the whole group;
    - it is hierarchical (it spans hosts): the members on this rank's host, over that host's
      shared-memory group;
    - it is on torch.distributed (forced, not on CPU, or a group over hosts that runs flat, as
      with ``algorithms="exact"``): none.

    ``member`` names a member of the group in the reason (a pipeline's "stage")."""
    transport, group = route
    kind = transport.kind
    if kind is TransportKind.SHARED_MEMORY and isinstance(group.handle, ShmGroup):
        return group, ""
    if kind is TransportKind.HIERARCHICAL:
        local = group.handle.local
        if isinstance(local.handle, ShmGroup):
            return local, ""
        return None, f"no other {member} of the group is on this rank's host"
    if policy is TransportPolicy.TORCH_DISTRIBUTED:
        return None, "CommOptions(transport='torch.distributed') forces it"
    if device.type != "cpu":
        return None, f"the communicator runs on {device}, not CPU"
    return None, (f"the group along {group.axis!r} runs on {kind.value} (its ranks span "
                  "hosts and it runs flat)")  # fmt: skip


def plan_links(
    channels: Mapping[tuple[int, int], tuple[int, int]],
    ranks: Sequence[int],
    host: Sequence[int] | None,
    why_not: str,
    ring_bytes: int = RING_BYTES,
    member: str = "rank",
) -> tuple[dict[tuple[int, int], Link], list[ChannelSpec]]:
    """Every channel's ``Link`` and the ``ChannelSpec``s of those on shared memory among the
    host's members (by their index in it: all of them, so every member lays its memory out
    alike). ``channels``: (messages, largest message's bytes) per (source, destination) index in
    the group, what one round puts on each (its ring holds them all); ``ranks``: the job's global
    rank of each member of the group; ``host``: the job's ranks of this rank's host group (None:
    no channel on shared memory, for ``why_not``). The same on every rank of a host group that
    is given the same channels."""
    members = {r: i for i, r in enumerate(host)} if host is not None else {}
    links: dict[tuple[int, int], Link] = {}
    specs: list[ChannelSpec] = []
    for (src, dst), (count, most) in sorted(channels.items()):
        if host is None:
            links[(src, dst)] = Link(TransportKind.TORCH_DISTRIBUTED, why_not)
            continue
        away = [s for s in (src, dst) if ranks[s] not in members]
        ring = count * most
        if away:
            links[(src, dst)] = Link(TransportKind.TORCH_DISTRIBUTED,
                                     f"{member} {away[0]} is on another host")  # fmt: skip
        elif ring > ring_bytes:
            links[(src, dst)] = Link(
                TransportKind.TORCH_DISTRIBUTED,
                f"its ring of {count} messages of {most} bytes would take {ring / 2**20:.0f} MiB "
                f"(more than {ring_bytes / 2**20:.0f} MiB)",
            )
        else:
            links[(src, dst)] = Link(TransportKind.SHARED_MEMORY,
                                     f"both {member}s on this host")  # fmt: skip
            specs.append(ChannelSpec(members[ranks[src]], members[ranks[dst]], count, most))
    return links, specs


def peer_plan(
    route: Route,
    channels: Mapping[tuple[int, int], tuple[int, int]],
    options: CommOptions,
    device: torch.device,
    member: str = "rank",
    ring_bytes: int = RING_BYTES,
) -> PeerPlan:
    """Routing's verdict on the point-to-point ``channels`` of ``route``'s group (``host_group``
    and ``plan_links``): the one place that decides which transport carries each."""
    host, why_not = host_group(route, options.transport, device, member)
    links, specs = plan_links(channels, route.group.ranks,
                              None if host is None else host.ranks, why_not, ring_bytes,
                              member)  # fmt: skip
    return PeerPlan(links, specs, host if specs else None)
