"""``OnePassChannel``: a transport's one-pass entry points along one axis, as one object.

A transport's collectives go through the ``Transport`` protocol (start, then wait). A transport
whose ``one_pass`` is true (shared memory's) also runs forms of its own
(``coconet.codegen.forms``): a fused collective as one pass, whose kernel reads the peers' rows
of its slice and writes its slot of the gather, and an all_reduce whose consumer reads the
result where each slice's owner reduced it (``OnePassTransport``: what the channel calls).
Generated code reaches them through ``comm.one_pass(axis)``, which returns this channel; every
call runs under the communicator's fault guard, so a dead or stalled peer is a ``RuntimeFault``
as for any collective.

One unit's calls, in order::

    parts, slot = channel.begin(x, gather_shape=..., gather_dtype=..., gather_parts=..., label=)
    ... the kernel reads ``parts``, writes ``slot`` ...
    y = channel.finish(shape=..., dtype=..., parts=..., label=..., published=False)

or ``channel.begin(x, label=)`` ... ``channel.end(label=)`` (no gather), or
``slot = channel.slot(shape=..., dtype=..., parts=..., label=)`` ... ``channel.finish(...)`` (no
reduce_scatter). ``channel.reduce_in_place(x, reduce_op, label=)`` is the all_reduce read in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from coconet.ir.ops import ReduceOp
from coconet.runtime.transport import Group, Published, Transport

__all__ = ["OnePassChannel", "OnePassTransport"]

# (op, label, axis, fn, *args) -> fn(*args), a transport failure turned into a RuntimeFault
Guard = Callable[..., Any]


class OnePassTransport(Transport, Protocol):
    """A transport that runs the one-pass forms (``Transport.one_pass``): what its channel
    calls (``coconet.runtime.shmem.SharedMemoryTransport`` has them)."""

    def fused_reduce_scatter(
        self,
        x: torch.Tensor,
        group: Group,
        *,
        gather_shape: Sequence[int] | None,
        gather_dtype: torch.dtype | None,
        gather_parts: Sequence[int] | None,
        gather_into: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]: ...

    def fused_reduce_scatter_end(self, group: Group) -> None: ...

    def fused_all_gather_begin(
        self,
        group: Group,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        parts: Sequence[int],
        into: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def fused_all_gather(
        self,
        group: Group,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        parts: Sequence[int],
        published: bool,
    ) -> torch.Tensor | Published: ...

    def all_reduce_parts(self, x: torch.Tensor, group: Group, *, reduce_op: ReduceOp
                         ) -> Published: ...  # fmt: skip


class OnePassChannel:
    """The one-pass entry points of a transport on one group (see the module docstring)."""

    def __init__(self, transport: OnePassTransport, group: Group, guard: Guard) -> None:
        self._transport, self._group, self._guard = transport, group, guard

    @property
    def axis(self) -> str | None:
        return self._group.axis

    def begin(
        self,
        x: torch.Tensor,
        *,
        label: str,
        gather_shape: Sequence[int] | None = None,
        gather_dtype: torch.dtype | None = None,
        gather_parts: Sequence[int] | None = None,
        gather_into: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Open a unit with a reduce_scatter of ``x``: (every peer's rows of this rank's slice,
        this rank's slot of the gather, or None when the unit has none: ``end`` closes it).
        ``gather_into``: the input a published gather is committed into (a host replica's live
        buffer makes the slot its spare buffer, ``coconet.runtime.replica``)."""
        return self._guard(
            "reduce_scatter",
            label,
            self.axis,
            self._transport.fused_reduce_scatter,
            x,
            self._group,
            gather_shape=gather_shape,
            gather_dtype=gather_dtype,
            gather_parts=gather_parts,
            gather_into=gather_into,
        )

    def end(self, *, label: str) -> None:
        """Close a unit that has no gather (its kernel has read the peers' rows)."""
        end = self._transport.fused_reduce_scatter_end
        self._guard("reduce_scatter", label, self.axis, end, self._group)

    def slot(
        self,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        parts: Sequence[int],
        label: str,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Open a unit that has no reduce_scatter: this rank's slot of a gather of ``shape``
        (its kernel writes there; ``into`` as ``begin``'s ``gather_into``)."""
        begin = self._transport.fused_all_gather_begin
        return self._guard(
            "all_gather", label, self.axis, begin, self._group, shape=shape, dtype=dtype,
            parts=parts, into=into,
        )

    def finish(
        self,
        *,
        shape: Sequence[int],
        dtype: torch.dtype,
        parts: Sequence[int],
        label: str,
        published: bool = False,
    ) -> torch.Tensor | Published:
        """The gathered result, once every slot is written (``published``: left in the peers'
        slots for the commit to copy, see ``Published``)."""
        gather = self._transport.fused_all_gather
        return self._guard(
            "all_gather", label, self.axis, gather, self._group, shape=shape, dtype=dtype,
            parts=parts, published=published,
        )

    def reduce_in_place(self, x: torch.Tensor, reduce_op: ReduceOp, *, label: str) -> Published:
        """All-reduce ``x`` and leave the result where each slice's owner reduced it (a
        ``Published`` of flat slices, in order), for a consumer kernel to read in place. Nothing
        else may communicate on the group until the caller releases it."""
        parts = self._transport.all_reduce_parts
        return self._guard(
            "all_reduce", label, self.axis, parts, x, self._group, reduce_op=reduce_op
        )
