"""A fully sharded block: its parameters as flat segments, each rank storing its slice.

A ``Block`` is one module's parameters (a transformer layer; the root's are those of no other
block), laid out as flat **segments**, one per kind of parameter (dtype; once an optimizer
takes them, its param group too: each segment is one optimizer step's bucket). Each rank keeps
its slice of every segment (``Segment.shard``, the program's ``Sliced`` layout: the first
``N % world`` ranks hold one element more). Each segment also has a whole buffer, ``full``,
whose storage is **freed between uses** (resized to zero bytes) and refilled by an all_gather
of the slices before the block's forward and its backward: the parameters are views of it for
good, so their shapes never change and what autograd saved in the forward (a view of a weight,
``weight.t()``) sees the gathered values again in the backward. Outside those windows a
parameter's values are not there: read them with ``FullyShardedModel.gathered()``.

The gather of a segment is started (``start_gather``) and completed (``finish_gather``) apart,
so that the next block's gather can run while this one computes, where the transport
progresses on its own (torch.distributed); over shared memory a start completes at once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coconet.ir.types import slice_bounds

__all__ = ["Block", "Segment", "Unsharded"]


class Unsharded(enum.Enum):
    """Where a block's whole parameters are."""

    FREED = "freed"  # only the slices are stored
    GATHERING = "gathering"  # a gather was started (prefetch), not yet waited
    WHOLE = "whole"  # gathered: the parameters hold their values


@dataclass
class Segment:
    """One flat run of a block's parameters of one kind, sliced over the ranks."""

    key: tuple  # what its parameters share: (dtype,) or (param group, dtype)
    members: list[int]  # indices into Block.params, in the segment's order
    offsets: list[int]  # each member's start in the segment
    size: int  # elements
    parts: list[int]  # every rank's slice size (the program's Sliced layout)
    bounds: tuple[int, int]  # this rank's slice [lo, hi) of the segment
    shard: torch.Tensor  # this rank's slice of the values, stored for good
    full: torch.Tensor  # the whole segment; storage freed between uses
    # the all_gathers started and not waited (Comm Work), at most one
    pending: Any = None
    # the gradient of the whole segment while a backward fills it (a view of a buffer the
    # optimizer's step reads in place), None outside
    grad: torch.Tensor | None = None
    # what the optimizer keeps for this segment (its compiled step, state slices, step count):
    # set by coconet.optim.sharded when an optimizer takes the segment's parameters
    owner: Any = None
    numels: list[int] = field(default_factory=list)  # each member's elements

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def span(self, j: int) -> tuple[int, int]:
        """Member ``j``'s (an index into ``members``) elements in the segment."""
        return self.offsets[j], self.offsets[j] + self.numels[j]


class Block:
    """A module's parameters, fully sharded (see the module docstring). ``comm``: the
    communicator the slices are spread over (every rank builds the same blocks in the same
    order)."""

    def __init__(self, index: int, name: str, module: torch.nn.Module,
                 params: Sequence[torch.nn.Parameter], names: Sequence[str], comm: Any,
                 root: bool = False) -> None:  # fmt: skip
        self.index, self.name, self.module, self.root = index, name, module, root
        self.params = list(params)
        self.names = list(names)
        self.shapes = [tuple(p.shape) for p in self.params]
        self.comm = comm
        self.state = Unsharded.WHOLE  # the parameters hold their values until first sharded
        self.owner_model: Any = None  # the FullyShardedModel (what an optimizer finds)
        # a backward's progress through the block: the parameters whose gradient arrived,
        # whether it was gathered for it, whether its step ran
        self.arrived: set[int] = set()
        self.prepared = False
        self.reduced = False
        self.segments: list[Segment] = []
        self.where: list[tuple[int, int]] = []  # per parameter: (segment, member index)
        values = [p.detach().reshape(-1) for p in self.params]
        self.layout([(p.dtype,) for p in self.params], values)

    # -- layout --------------------------------------------------------------------------------

    def layout(self, keys: Sequence[tuple], values: Sequence[torch.Tensor]) -> None:
        """Lay the parameters out as one segment per distinct key (in first-appearance order:
        the same on every rank), from ``values`` (each parameter's whole, flattened), keep
        this rank's slices and make each parameter a view of its segment's whole buffer
        (which holds ``values`` afterwards: the block is gathered)."""
        comm = self.comm
        order: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            order.setdefault(tuple(key), []).append(i)
        segments: list[Segment] = []
        where: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        for s, (key, members) in enumerate(order.items()):
            dtype = self.params[members[0]].dtype
            numels = [self.params[i].numel() for i in members]
            offsets = [sum(numels[:j]) for j in range(len(numels))]
            size = sum(numels)
            parts = [b - a for a, b in (slice_bounds(size, comm.world, r)
                                        for r in range(comm.world))]  # fmt: skip
            lo, hi = slice_bounds(size, comm.world, comm.rank)
            full = torch.empty(size, dtype=dtype, device=comm.device)
            with torch.no_grad():
                for j, i in enumerate(members):
                    full[offsets[j] : offsets[j] + numels[j]].copy_(values[i])
                    where[i] = (s, j)
            seg = Segment(tuple(key), members, offsets, size, parts, (lo, hi),
                          full[lo:hi].clone(), full, numels=numels)  # fmt: skip
            segments.append(seg)
        self.segments, self.where = segments, where
        with torch.no_grad():
            for i, p in enumerate(self.params):
                s, j = where[i]
                seg = segments[s]
                a, z = seg.span(j)
                p.data = seg.full[a:z].view(self.shapes[i])
        self.state = Unsharded.WHOLE

    def values(self) -> list[torch.Tensor]:
        """Each parameter's whole values, flattened (the block must be gathered)."""
        out = []
        for i in range(len(self.params)):
            s, j = self.where[i]
            a, z = self.segments[s].span(j)
            out.append(self.segments[s].full[a:z])
        return out

    # -- gathering -----------------------------------------------------------------------------

    def start_gather(self) -> None:
        """Start the all_gather of every segment's slices (collective: every rank starts the
        same block's at the same point). No-op unless freed."""
        if self.state is not Unsharded.FREED:
            return
        for s, seg in enumerate(self.segments):
            seg.full.untyped_storage().resize_(seg.size * seg.full.element_size())
            seg.pending = self.comm.all_gather_start(
                seg.shard, dim=0, parts=seg.parts, axis=None, out=seg.full,
                label=f"coconet.fsdp gather of {self.name} (segment {s})")  # fmt: skip
        self.state = Unsharded.GATHERING

    def finish_gather(self) -> None:
        """Complete the gather (starting it first if it was not): the parameters hold their
        values."""
        if self.state is Unsharded.WHOLE:
            return
        self.start_gather()
        with torch.no_grad():
            for seg in self.segments:
                work, seg.pending = seg.pending, None
                whole = self.comm.wait(work)
                if whole.data_ptr() != seg.full.data_ptr():  # (written there where it can be)
                    seg.full.copy_(whole)
        self.state = Unsharded.WHOLE

    def free(self) -> None:
        """Free the whole buffers (the slices stay): the parameters' values are gone until the
        next gather. A gather still in flight is completed first (its buffers are written)."""
        if self.state is Unsharded.GATHERING:
            self.finish_gather()
        for seg in self.segments:
            storage = seg.full.untyped_storage()
            if storage.resizable():
                storage.resize_(0)
            else:  # pinned by a view outside torch (``.numpy()`` of a parameter): a new buffer
                self._rebuffer(seg)
        self.state = Unsharded.FREED

    def _rebuffer(self, seg: Segment) -> None:
        """A new, freed whole buffer for ``seg``, its parameters views of it (the old one stays
        with whoever holds a view of it)."""
        full = torch.empty(seg.size, dtype=seg.full.dtype, device=seg.full.device)
        with torch.no_grad():
            for j, i in enumerate(seg.members):
                a, z = seg.span(j)
                self.params[i].data = full[a:z].view(self.shapes[i])
        full.untyped_storage().resize_(0)
        seg.full = full

    @torch.no_grad()
    def take_slices(self) -> None:
        """This rank's slices from the whole buffers (the block gathered and written in place
        on every rank alike: a ``load_state_dict``, an initialisation under ``gathered()``)."""
        for seg in self.segments:
            lo, hi = seg.bounds
            seg.shard.copy_(seg.full[lo:hi])

    # -- what it holds -------------------------------------------------------------------------

    def stored_part(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's stored part of parameter ``p`` (flattened; a view of its slice, empty
        where the slice does not reach it): what a rank holds of ``p`` between uses."""
        i = next(k for k, q in enumerate(self.params) if q is p)
        s, j = self.where[i]
        seg = self.segments[s]
        a, z = seg.span(j)
        lo, hi = seg.bounds
        x, y = max(a, lo), min(z, hi)
        return seg.shard[x - lo : y - lo] if x < y else seg.shard[:0]

    def stored_bytes(self) -> int:
        """Bytes this rank stores for good (the slices)."""
        return sum(seg.shard.numel() * seg.shard.element_size() for seg in self.segments)

    def whole_bytes(self) -> int:
        """Bytes of the block gathered."""
        return sum(seg.size * seg.full.element_size() for seg in self.segments)
