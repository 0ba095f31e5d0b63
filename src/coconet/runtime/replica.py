"""``HostReplica``: one physical copy, per host, of a Replicated tensor every rank of a group maps.

A data-parallel step over shared memory ends with an all_gather of the new parameters: every rank
copies every peer's new slice into its own copy of the parameters, so the ranks of one host hold
``world`` identical copies and each step writes all of them. When the parameters live in memory
that every rank of the host maps, each rank writes only its own slice and the gather is gone:
there is nothing to copy. To keep the step all-or-nothing (a failed step leaves the parameters as
they were on every rank), the copy is **double-buffered**: the step reads the ``live`` buffer and
writes each rank's new slice into the ``spare`` one, and the commit — once every rank voted to
commit — ``flip``s which buffer is live. A step that fails never flips, so the live buffer is
untouched.

What that means for the tensors that view it:

- every rank of the host sees one memory: a write by one rank (``p.data.mul_(2)``, loading a
  state dict on one rank) is a write on all of them;
- a flip moves the live values to the other buffer: the caller's tensor passed to the step is
  re-pointed (``Tensor.set_``); views of it taken before the step keep pointing at the old
  buffer, which the next step overwrites (``coconet.optim`` re-points its parameters itself).

The memory lives in the segment of the group's first rank (``SymmetricMemory`` with a size of 0
for the others); it is freed when the last rank that maps it exits, as every segment is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coconet.runtime.symmem import SymmetricMemory

__all__ = ["HostReplica"]

_PAGE = 4096
# The second buffer starts half a page past a page boundary: a step reads one buffer and writes
# the other at the same index, and two streams whose addresses agree in their low 12 bits make
# the CPU's loads wait on unrelated stores (4K aliasing: ~4% of a 16M Adam step here, measured
# A/B in one run).
_SKEW = _PAGE // 2


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _second(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one buffer, the second buffer's byte offset)."""
    one = max(1, _numel(shape)) * dtype.itemsize
    return one, -(-one // _PAGE) * _PAGE + _SKEW


def replica_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """The owner's segment size for a replica of ``shape``: its two buffers."""
    one, second = _second(shape, dtype)
    return second + one


class HostReplica:
    """A double-buffered tensor of ``shape`` in ``mem``'s rank-``owner`` segment (see the module
    docstring): ``live()`` holds the values, a step writes ``spare()``, its commit ``flip``s."""

    def __init__(
        self, mem: SymmetricMemory, shape: Sequence[int], dtype: torch.dtype, owner: int = 0
    ) -> None:
        self._mem, self.owner = mem, owner
        self.shape, self.dtype = tuple(int(s) for s in shape), dtype
        numel = _numel(self.shape)
        _, second = _second(self.shape, dtype)
        # never handed out: live()/spare() return fresh views, so a caller's set_ on one cannot
        # re-point these
        self._buffers = (
            mem.buffer(owner, dtype, numel, 0),
            mem.buffer(owner, dtype, numel, second),
        )
        self._live = 0

    def live(self) -> torch.Tensor:
        """The current values (a new view of the live buffer)."""
        return self._buffers[self._live].view(self.shape)

    def spare(self) -> torch.Tensor:
        """The buffer the next step writes (a new view of it)."""
        return self._buffers[1 - self._live].view(self.shape)

    @property
    def spare_index(self) -> int:
        """Which of the two buffers ``spare()`` is now (0 or 1)."""
        return 1 - self._live

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the whole live buffer (the only tensor a step may flip)."""
        live = self._buffers[self._live]
        return (
            t.data_ptr() == live.data_ptr()
            and t.numel() == live.numel()
            and t.dtype == self.dtype
            and t.is_contiguous()
        )

    def buffers(self) -> tuple[int, int]:
        """The two buffers' data pointers (how a transport recognises a tensor as this one)."""
        return self._buffers[0].data_ptr(), self._buffers[1].data_ptr()

    def flip(self) -> None:
        """The spare buffer becomes the live one (the commit of a step that wrote it)."""
        self._live = 1 - self._live

    def close(self) -> None:
        self._buffers = ()
        self._mem.close()
