"""Which transport carries each of a pipeline's channels: shared memory between stages of one
host, torch.distributed (gloo) otherwise.

A channel is a (source stage, destination stage) pair of the schedule: every message on it goes
one way, in order (``coconet.pipeline.check``'s untagged FIFO channels). It runs over shared
memory (``coconet.runtime.p2p.PeerChannels``) when both stages' ranks are in the shared-memory
group that routing found for this rank's host along the pipeline's axis, with the evidence
every group is routed by (hostname, boot id, PID namespace: ``coconet.runtime.routing``):

- the axis's group is on shared memory (all its ranks on one host, CPU, ``CommOptions(transport=
  ...)`` not forcing torch.distributed): every channel;
- it is hierarchical (it spans hosts): the channels between stages of this rank's host, over
  that host's shared-memory group; the others over gloo;
- it is on torch.distributed (forced, not on CPU, or a group over hosts that runs flat, as with
  ``algorithms="exact"``): every channel over gloo.

A channel's ring holds every message one ``step()`` puts on it (``slots`` = its messages per
schedule: a send never waits for a message of its own step, so the ring adds no wait the proof
did not allow) of its largest message's bytes; a ring that would need more than ``RING_BYTES``
goes over gloo instead, and ``Link.why`` says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from coconet.options import TransportKind, TransportPolicy
from coconet.pipeline.schedules import Step
from coconet.runtime.p2p import ChannelSpec

__all__ = ["RING_BYTES", "HostGroup", "Link", "channel_sizes", "host_group", "plan_links"]

# The most bytes one channel's ring may take (in its source's memory); a channel that needs more
# (huge activations x many micro-batches) goes over gloo. 256 MiB holds 8 micro-batches of a
# 2 x 2048 x 4096 float32 activation.
RING_BYTES = 256 << 20


class Link(NamedTuple):
    """How one channel runs, and why."""

    transport: TransportKind
    why: str


class HostGroup(NamedTuple):
    """The shared-memory group of this rank's host along the pipeline's axis: its members (the
    job's global ranks, in group order) and its ``ShmGroup`` (whose ``gather`` sets channels up).
    """

    ranks: tuple[int, ...]
    shm: object


def host_group(comm, axis: str | None) -> tuple[HostGroup | None, str]:
    """This rank's host group along ``axis`` as routing made it, or None and why there is none
    (see the module docstring)."""
    from coconet.runtime.shmem import ShmGroup

    transport, group = comm.route(axis)
    kind = transport.kind
    if kind is TransportKind.SHARED_MEMORY and isinstance(group.handle, ShmGroup):
        return HostGroup(tuple(group.ranks), group.handle), ""
    if kind is TransportKind.HIERARCHICAL:
        local = group.handle.local
        if isinstance(local.handle, ShmGroup):
            return HostGroup(tuple(local.ranks), local.handle), ""
        return None, "no other stage of the pipeline is on this rank's host"
    policy = comm.options.transport
    if policy is TransportPolicy.TORCH_DISTRIBUTED:
        return None, "CommOptions(transport='torch.distributed') forces it"
    if getattr(comm, "device", torch.device("cpu")).type != "cpu":
        return None, f"the communicator runs on {comm.device}, not CPU"
    return None, (f"the pipeline's group along {axis!r} runs on {kind.value} (its ranks span "
                  "hosts and it runs flat)")  # fmt: skip


def channel_sizes(schedule: Sequence[Sequence[Step]], element_size: int
                  ) -> dict[tuple[int, int], tuple[int, int]]:  # fmt: skip
    """(messages, largest message's bytes) per (source, destination) stage pair of the
    schedule: what one ``step()`` puts on each channel."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for src, steps in enumerate(schedule):
        for step in steps:
            for a in step:
                if a.peer is not None and a.kind.is_send:
                    count, most = out.get((src, a.peer), (0, 0))
                    out[(src, a.peer)] = (count + 1, max(most, math.prod(a.shape) * element_size))
    return out


def plan_links(
    schedule: Sequence[Sequence[Step]],
    ranks: Sequence[int],
    host: HostGroup | None,
    why_not: str,
    element_size: int,
    ring_bytes: int = RING_BYTES,
) -> tuple[dict[tuple[int, int], Link], list[ChannelSpec]]:
    """Every channel's ``Link`` (by (source, destination) stage), and the ``ChannelSpec``s of the
    channels on shared memory among ``host``'s members (by their index in it: all of them, so
    every member lays its memory out alike). ``ranks``: the job's global rank of each stage.
    The same on every rank of a host group, since it is made from the schedule they share."""
    members = {r: i for i, r in enumerate(host.ranks)} if host is not None else {}
    links: dict[tuple[int, int], Link] = {}
    specs: list[ChannelSpec] = []
    for (src, dst), (count, most) in sorted(channel_sizes(schedule, element_size).items()):
        if host is None:
            links[(src, dst)] = Link(TransportKind.TORCH_DISTRIBUTED, why_not)
            continue
        away = [s for s in (src, dst) if ranks[s] not in members]
        ring = count * most
        if away:
            links[(src, dst)] = Link(TransportKind.TORCH_DISTRIBUTED,
                                     f"stage {away[0]} is on another host")  # fmt: skip
        elif ring > ring_bytes:
            links[(src, dst)] = Link(
                TransportKind.TORCH_DISTRIBUTED,
                f"its ring of {count} messages of {most} bytes would take {ring / 2**20:.0f} MiB "
                f"(more than {ring_bytes / 2**20:.0f} MiB)",
            )
        else:
            links[(src, dst)] = Link(TransportKind.SHARED_MEMORY,
                                     "both stages on this host")  # fmt: skip
            specs.append(ChannelSpec(members[ranks[src]], members[ranks[dst]], count, most))
    return links, specs
