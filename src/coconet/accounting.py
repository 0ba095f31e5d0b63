"""What a program costs each rank: persistent memory and bytes sent per step.

Bytes sent follow the ring algorithms NCCL and gloo use for large tensors, counted per rank for a
tensor of S bytes over a group of W ranks where the rank's own slice is s:
reduce_scatter and all_gather send S - s each, so all_reduce (= reduce_scatter + all_gather)
sends 2 (S - s); broadcast and reduce forward the whole tensor once (S; nothing when W = 1);
send moves the rank's own value; scatter moves nothing; a scalar all_reduce counts its element
twice. With this model a split all_reduce sends exactly what the all_reduce sent, and a send of
a slice moves 1/T of the data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from coconet.errors import SimulationError
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.opspec import Prop, Work, spec
from coconet.ir.program import Program
from coconet.ir.types import Dim, Layout, TensorType, slice_bounds

__all__ = ["Accounting", "Counter", "account"]


@dataclass(frozen=True)
class Accounting:
    """Per-rank costs of one step of a program on a mesh, for given sizes."""

    persistent_bytes: tuple[int, ...]  # parameters and state (the inputs the program updates)
    sent_bytes: tuple[int, ...]  # bytes each rank sends in one step
    persistent_by_input: dict[str, tuple[int, ...]]  # updated input -> bytes on each rank
    sent_by_node: dict[str, tuple[int, ...]]  # communication node -> bytes each rank sends
    # computation node -> its local bytes read/written and flops on each rank (the op specs' model)
    work_by_node: dict[str, tuple[Work, ...]] = field(default_factory=dict)

    @property
    def max_persistent_bytes(self) -> int:
        return max(self.persistent_bytes)

    @property
    def max_sent_bytes(self) -> int:
        return max(self.sent_bytes)

    @property
    def max_flops(self) -> int:
        """Flops of the busiest rank's local computation in one step."""
        ranks = range(len(self.sent_bytes))
        return max(sum(w[r].flops for w in self.work_by_node.values()) for r in ranks)

    def __str__(self) -> str:
        return (
            f"persistent {self.max_persistent_bytes} B/rank, sends "
            f"{self.max_sent_bytes} B/rank/step"
        )


def account(program: Program, world: int | Mesh, sizes: Mapping[str, int]) -> Accounting:
    """Persistent bytes and bytes sent per rank; ``sizes`` binds every Dim (``{"N": 4096}``)."""
    mesh = world if isinstance(world, Mesh) else Mesh.world(world)
    counter = Counter(mesh, sizes)
    ranks = range(mesh.size)
    updated = {u.inputs[0].name for u in program.updates}
    by_input = {
        n.name: tuple(counter.local_bytes(n.type, r) for r in ranks)
        for n in program.inputs
        if n.name in updated
    }
    by_node = {
        n.name: tuple(counter.sent(n, r) for r in ranks)
        for n in program.nodes
        if spec(n.op).has(Prop.COMMUNICATES)
    }
    work = {
        n.name: tuple(counter.work(n, r) for r in ranks)
        for n in program.nodes
        if spec(n.op).has(Prop.KERNEL)
    }
    persistent = tuple(sum(v[r] for v in by_input.values()) for r in ranks)
    sent = tuple(sum(v[r] for v in by_node.values()) for r in ranks)
    return Accounting(persistent, sent, by_input, by_node, work)


class Counter:
    def __init__(self, mesh: Mesh, sizes: Mapping[str, int]) -> None:
        self.mesh = mesh
        self.sizes = sizes

    def shape(self, ty: TensorType) -> tuple[int, ...]:
        out = []
        for s in ty.shape:
            if isinstance(s, Dim):
                if s.name not in self.sizes:
                    raise SimulationError(
                        f"no size given for Dim {s.name!r}", hint=f"pass sizes={{'{s.name}': ...}}"
                    )
                out.append(self.sizes[s.name])
            else:
                out.append(s)
        return tuple(out)

    def full_bytes(self, ty: TensorType) -> int:
        return math.prod(self.shape(ty)) * ty.dtype.itemsize

    def slice_bytes(self, ty: TensorType, layout: Layout, rank: int) -> int:
        shape = list(self.shape(ty))
        lo, hi = slice_bounds(
            shape[layout.dim],
            self.mesh.axis_size(layout.axis),
            self.mesh.index_in(rank, layout.axis),
        )
        shape[layout.dim] = hi - lo
        return math.prod(shape) * ty.dtype.itemsize

    def local_bytes(self, ty: TensorType, rank: int) -> int:
        if ty.layout.is_sliced:
            return self.slice_bytes(ty, ty.layout, rank)
        return self.full_bytes(ty)

    def local_shape(self, ty: TensorType, rank: int) -> tuple[int, ...]:
        shape = list(self.shape(ty))
        if ty.layout.is_sliced:
            lay = ty.layout
            lo, hi = slice_bounds(
                shape[lay.dim], self.mesh.axis_size(lay.axis), self.mesh.index_in(rank, lay.axis)
            )
            shape[lay.dim] = hi - lo
        return tuple(shape)

    def local_numel(self, ty: TensorType, rank: int) -> int:
        return math.prod(self.local_shape(ty, rank))

    def sent(self, node: Node, rank: int) -> int:
        """Bytes ``rank`` sends for ``node``: the op spec's model (``coconet.ir.opspec``)."""
        model = spec(node.op).sent
        return model(node, self, rank) if model is not None else 0

    def work(self, node: Node, rank: int) -> Work:
        """Bytes read and written and flops of ``node``'s local computation on ``rank``."""
        model = spec(node.op).work
        return model(node, self, rank) if model is not None else Work()
