"""Sizes at run time: binding symbolic Dims from every rank's input shapes, and per-rank geometry.

A rank holds only its own slice of a Sliced input, so no rank can know a global size alone. The
runtime gathers every rank's input shapes once (the start-of-step handshake); ``bind_sizes`` turns
them into global sizes (or names every inconsistency), and ``geometry`` derives what the generated
code needs on one rank: slice bounds for ``scatter``, part sizes for ``all_gather`` and the block
position for ``dropout``. Slices follow ``torch.tensor_split`` (``slice_bounds``), exactly as in the
simulator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.program import Program
from coconet.ir.types import Dim, Shape, format_shape, slice_bounds

__all__ = ["Geometry", "bind_sizes", "geometry", "resolve_shape"]


@dataclass(frozen=True)
class Geometry:
    """What the generated ``step`` reads about sizes on this rank (keyed by program value name).

    - ``sizes``: each Dim's global size;
    - ``bounds[v]``: ``(start, length)`` of this rank's slice, for ``scatter`` values;
    - ``parts[v]``: the part size of every rank of the group, for ``all_gather`` values;
    - ``shapes[v]`` / ``offsets[v]``: global shape and this rank's block start, for ``dropout``.
    """

    sizes: dict[str, int] = field(default_factory=dict)
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    offsets: dict[str, tuple[int, ...]] = field(default_factory=dict)


def resolve_shape(shape: Shape, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(sizes[s.name] if isinstance(s, Dim) else s for s in shape)


def bind_sizes(
    program: Program, mesh: Mesh, shapes: Sequence[Mapping[str, tuple[int, ...]]]
) -> tuple[dict[str, int], list[str]]:
    """Global Dim sizes from ``shapes[rank][input name]`` (each rank's local input shapes).

    Returns the sizes and a list of problems, each naming the ranks and inputs involved (empty when
    the shapes fit the program). Ranks disagreeing is a problem, as is a rank whose slice is not its
    ``tensor_split`` part of the global size.
    """
    sizes: dict[str, int] = {}
    where: dict[str, str] = {}
    problems: list[str] = []

    def bind(dim: Dim | int, value: int, what: str) -> None:
        if isinstance(dim, int):
            if dim != value:
                problems.append(f"{what} is {value}, the program declares {dim}")
            return
        if dim.name not in sizes:
            sizes[dim.name] = value
            where[dim.name] = what
        elif sizes[dim.name] != value:
            problems.append(
                f"size {dim.name} is {value} from {what} but {sizes[dim.name]} from "
                f"{where[dim.name]}"
            )

    for node in program.inputs:
        declared = node.type.shape
        lay = node.type.layout
        for rank, per_rank in enumerate(shapes):
            if node.name not in per_rank:
                continue
            local = per_rank[node.name]
            if len(local) != len(declared):
                problems.append(
                    f"rank {rank}: input {node.name!r} has {len(local)} dims "
                    f"{list(local)}, the program declares {format_shape(declared)}"
                )
                continue
            for d, (dd, size) in enumerate(zip(declared, local, strict=True)):
                if lay.is_sliced and d == lay.dim:
                    continue  # checked per group below
                bind(dd, size, f"rank {rank}'s {node.name!r} (dim {d})")
        if lay.is_sliced:
            _bind_sliced(node, mesh, shapes, bind, problems)
    return sizes, problems


def _bind_sliced(node: Node, mesh: Mesh, shapes, bind, problems: list[str]) -> None:
    lay = node.type.layout
    for group in mesh.groups(lay.axis):
        local = [shapes[r].get(node.name) for r in group]
        if any(s is None or len(s) != node.type.rank for s in local):
            return  # already reported
        total = sum(s[lay.dim] for s in local)
        for i, (r, s) in enumerate(zip(group, local, strict=True)):
            lo, hi = slice_bounds(total, len(group), i)
            if s[lay.dim] != hi - lo:
                problems.append(
                    f"rank {r}: input {node.name!r} ({lay}) holds {s[lay.dim]} elements along dim "
                    f"{lay.dim}; its part of the group's {total} is {hi - lo} "
                    f"(ranks {group} hold {[x[lay.dim] for x in local]})"
                )
        bind(node.type.shape[lay.dim], total, f"the slices of {node.name!r} on ranks {group}")


def geometry(program: Program, mesh: Mesh, rank: int, sizes: Mapping[str, int]) -> Geometry:
    """The sizes the generated code needs on ``rank``, given the bound Dim ``sizes``."""
    geo = Geometry(sizes=dict(sizes))
    for node in program.nodes:
        if node.op is Op.SCATTER:
            lay = node.type.layout
            total = resolve_shape(node.type.shape, sizes)[lay.dim]
            lo, hi = _bounds(mesh, rank, lay.axis, total)
            geo.bounds[node.name] = (lo, hi - lo)
        elif node.op is Op.ALL_GATHER:
            src = node.inputs[0].type.layout
            total = resolve_shape(node.type.shape, sizes)[src.dim]
            n = mesh.axis_size(src.axis)
            geo.parts[node.name] = tuple(
                hi - lo for lo, hi in (slice_bounds(total, n, i) for i in range(n))
            )
        elif node.op is Op.DROPOUT:
            gshape = resolve_shape(node.type.shape, sizes)
            offs = [0] * len(gshape)
            lay = node.type.layout
            if lay.is_sliced:
                offs[lay.dim] = _bounds(mesh, rank, lay.axis, gshape[lay.dim])[0]
            geo.shapes[node.name] = gshape
            geo.offsets[node.name] = tuple(offs)
    return geo


def _bounds(mesh: Mesh, rank: int, axis: str | None, total: int) -> tuple[int, int]:
    return slice_bounds(total, mesh.axis_size(axis), mesh.index_in(rank, axis))
