"""Fully sharded state in torch's distributed checkpoint format (``torch.distributed.checkpoint``).

Each parameter (and each optimizer state tensor of it) is saved as a 1-D tensor of its
``numel`` elements of which each rank holds the part its slices hold: a ``ShardedTensor``
whose local shard is a **view of this rank's slice** (no copy on save; ``dcp.load`` writes
straight into the slices), with its global offset. A parameter's part on a rank is any
contiguous range (``coconet.fsdp.blocks``: the segments are sliced as the programs slice them,
``tensor_split``'s sizes), which torch's ``DTensor`` cannot describe (its ``Shard`` is
``torch.chunk``'s even split) and ``ShardedTensor`` can (torch warns that it is deprecated in
favour of DTensor). DCP reads by offsets, so a checkpoint saved at one world size loads at any
other, and each rank reads only its own parts.

The flat tensors are flattened parameters: loadable into the same model fully sharded at any
world size; for the model unsharded (or torch's optimizer), save the gathered
``state_dict()`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from coconet.errors import ConfigError
from coconet.fsdp.blocks import Block, Segment

__all__ = ["flat_parts", "local_of", "sharded", "whole_world"]


def whole_world(comm: Any, what: str) -> None:
    """DCP's sharded tensors are over the default process group: refuse another."""
    if not dist.is_initialized() or comm.world != dist.get_world_size():
        raise ConfigError(
            f"{what}: the model is sharded over {comm.world} of the job's "
            f"{dist.get_world_size() if dist.is_initialized() else 1} ranks, and torch's "
            "sharded checkpoints here are over the whole job",
            op="coconet.fsdp",
            hint="save the gathered state_dict() instead",
        )


def flat_parts(b: Block) -> Iterator[tuple[int, Segment, int, int]]:
    """For each parameter of ``b``: (its index, its segment, the start of its part on this
    rank within the parameter, the part's start within this rank's slice); the part is empty
    where the slice does not reach the parameter (start and length then 0)."""
    for i in range(len(b.params)):
        s, j = b.where[i]
        seg = b.segments[s]
        a, z = seg.span(j)
        lo, hi = seg.bounds
        x, y = max(a, lo), min(z, hi)
        if x < y:
            yield i, seg, x - a, x - lo
        else:
            yield i, seg, 0, -1


def sharded(local: torch.Tensor | None, offset: int, numel: int, rank: int) -> Any:
    """A 1-D ``ShardedTensor`` of ``numel`` elements whose part on this rank is ``local``
    (a view) at ``offset`` (None: no part here)."""
    import warnings

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    shards = []
    if local is not None and local.numel():
        meta = ShardMetadata([offset], [local.numel()], f"rank:{rank}/{local.device.type}")
        shards.append(Shard(local, meta))
    with warnings.catch_warnings():  # (torch's deprecation of ShardedTensor: module docstring)
        warnings.simplefilter("ignore", FutureWarning)
        return init_from_local_shards(shards, [numel])


def local_of(t: Any) -> torch.Tensor | None:
    """The part of a loaded ``ShardedTensor`` on this rank (None: none)."""
    shards = t.local_shards()
    return shards[0].tensor if shards else None
