"""Groups: the schedule's annotations on a program (fused kernels and overlapped chains).

A group names program nodes; it does not change what they compute. ``FUSE`` asks the compiler for
one kernel (with a collective inside: one fused collective, CoCoNet's FusedAllReduce). ``OVERLAP``
asks for the chain to run chunk by chunk along ``chunk_dim`` of its values, so that the
communication of chunk i is in flight while chunk i+1 computes. ``DEFER`` holds one collective (its
first member) and the computations that land its value in inputs: the collective is started at the
end of the step and waited for at the start of the next call (``coconet.schedule.defer``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Group", "GroupKind"]


class GroupKind(enum.Enum):
    FUSE = "fuse"
    OVERLAP = "overlap"
    DEFER = "defer"


@dataclass(frozen=True)
class Group:
    kind: GroupKind
    members: tuple[str, ...]  # node names, in program order
    chunks: int = 1

    def __str__(self) -> str:
        extra = f", chunks={self.chunks}" if self.kind is GroupKind.OVERLAP else ""
        return f"{self.kind.value}({', '.join(self.members)}{extra})"
