"""Sizes at run time: binding symbolic Dims from every rank's input shapes, and per-rank geometry.

A rank holds only its own slice of a Sliced input, so no rank can know a global size alone. The
runtime gathers every rank's input shapes once (the start-of-step handshake); ``bind_sizes`` turns
them into global sizes (or names every inconsistency), and ``geometry`` derives what the generated
code needs on one rank: slice bounds for ``scatter``, part sizes for ``all_gather`` and the block
position for ``dropout``. Slices follow ``torch.tensor_split`` (``slice_bounds``), exactly as in the
simulator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from coconet.ir import semantics
from coconet.ir.chunks import ChunkPlan, chunk_rows, local_rows
from coconet.ir.group import Group, GroupKind
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.opspec import Arg, Lowering, spec
from coconet.ir.program import Program
from coconet.ir.types import Dim, Shape, format_shape, slice_bounds

__all__ = ["Geometry", "bind_alike", "bind_sizes", "geometry", "resolve_shape"]


@dataclass(frozen=True)
class Geometry:
    """What the generated ``step`` reads about sizes on this rank (keyed by program value name).

    - ``sizes``: each Dim's global size;
    - ``values[v]``: the integer of a ``size``, ``world_size`` or ``axis_index`` value
      (``semantics.size_value``);
    - ``bounds[v]``: ``(start, length)`` of this rank's slice, for ``scatter`` values;
    - ``parts[v]``: the part size of every rank of the group, for ``all_gather`` values;
    - ``shapes[v]`` / ``offsets[v]``: global shape and this rank's block start, for ``dropout``;
    - for the chunk loops of overlapped chains, keyed ``"<loop>/<value>"``, one entry per chunk:
      ``chunk_rows`` (this rank's local rows of a value read in chunks), ``chunk_global_rows``
      (their global rows, for dropout), ``chunk_bounds`` and ``chunk_parts`` (scatter and
      all_gather of a chunk); ``chunk_order`` puts a member's chunks back in row order (None when
      they are consecutive). The chunks are the simulator's (``coconet.ir.chunks``).
    """

    sizes: dict[str, int] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    offsets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    chunk_rows: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    chunk_global_rows: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    chunk_bounds: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    chunk_parts: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    chunk_order: dict[str, torch.Tensor | None] = field(default_factory=dict)

    def digest(self) -> str:
        """A text that differs whenever any field does, index tensors included (their repr
        elides long ones): what keys a kept rehearsal (``KernelSet.manifest_for``)."""
        h = hashlib.sha256()
        for f in fields(self):
            h.update(f"{f.name}={_exact(getattr(self, f.name))!r};".encode())
        return h.hexdigest()[:20]


def _exact(value):
    """``value`` with every tensor written out in full (its dtype and every element)."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return tuple((k, _exact(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return tuple(_exact(v) for v in value)
    return value


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
    where: dict[str, tuple] = {}
    problems: list[str] = []

    # Where a size came from: (rank, input, dim) or (group, input), worded only for a problem
    # (a decoder binds new sizes at every token: the words cost more than the binding)
    def said(what: tuple) -> str:
        if len(what) == 3:
            return f"rank {what[0]}'s {what[1]!r} (dim {what[2]})"
        return f"the slices of {what[1]!r} on ranks {what[0]}"

    def bind(dim: Dim | int, value: int, what: tuple) -> None:
        if isinstance(dim, int):
            if dim != value:
                problems.append(f"{said(what)} is {value}, the program declares {dim}")
            return
        if dim.name not in sizes:
            sizes[dim.name] = value
            where[dim.name] = what
        elif sizes[dim.name] != value:
            problems.append(
                f"size {dim.name} is {value} from {said(what)} but {sizes[dim.name]} from "
                f"{said(where[dim.name])}"
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
                bind(dd, size, (rank, node.name, d))
        if lay.is_sliced:
            _bind_sliced(node, mesh, shapes, bind, problems)
    return sizes, problems


def bind_alike(
    program: Program, mesh: Mesh, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, int] | None:
    """``bind_sizes`` where every rank has ``shapes`` (a tensor-parallel layer's activations):
    the global Dim sizes, or None where they do not fit the program (``bind_sizes`` says why).

    One pass over the inputs, not one per rank: alike slices of a sliced dim are ``tensor_split``'s
    parts of their sum (its parts of ``k * n`` are ``k`` each), so the whole is the slice's
    length times the group's size, and every other dim binds to its own length. A decoder binds
    new sizes at every token, each layer's program once per length (``Verdicts.propose``)."""
    sizes: dict[str, int] = {}
    for node in program.inputs:
        local = shapes.get(node.name)
        if local is None:
            continue
        declared = node.type.shape
        if len(local) != len(declared):
            return None
        lay = node.type.layout
        for d, (dim, size) in enumerate(zip(declared, local, strict=True)):
            if lay.is_sliced and d == lay.dim:
                size *= mesh.axis_size(lay.axis)
            if isinstance(dim, int):
                if dim != size:
                    return None
            elif sizes.setdefault(dim.name, size) != size:
                return None
    return sizes


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
        bind(node.type.shape[lay.dim], total, (group, node.name))


def geometry(program: Program, mesh: Mesh, rank: int, sizes: Mapping[str, int]) -> Geometry:
    """The sizes the generated code needs on ``rank``, given the bound Dim ``sizes``."""
    geo = Geometry(sizes=dict(sizes))
    for node in program.nodes:
        form = spec(node.op)
        if form.lowering is Lowering.SIZE:
            geo.values[node.name] = semantics.size_value(node, sizes, mesh, rank)
        elif form.lowering is Lowering.SCATTER:  # its bounds
            lay = node.type.layout
            total = resolve_shape(node.type.shape, sizes)[lay.dim]
            lo, hi = _bounds(mesh, rank, lay.axis, total)
            geo.bounds[node.name] = (lo, hi - lo)
        elif Arg.GATHER_DIM in form.arguments:  # the parts it gathers, and the whole's shape
            geo.shapes[node.name] = resolve_shape(node.type.shape, sizes)
            src = node.inputs[0].type.layout
            total = resolve_shape(node.type.shape, sizes)[src.dim]
            n = mesh.axis_size(src.axis)
            geo.parts[node.name] = tuple(
                hi - lo for lo, hi in (slice_bounds(total, n, i) for i in range(n))
            )
        elif form.lowering is Lowering.RANDOM:  # the block's place in the whole tensor
            gshape = resolve_shape(node.type.shape, sizes)
            offs = [0] * len(gshape)
            lay = node.type.layout
            if lay.is_sliced:
                offs[lay.dim] = _bounds(mesh, rank, lay.axis, gshape[lay.dim])[0]
            geo.shapes[node.name] = gshape
            geo.offsets[node.name] = tuple(offs)
    for k, group in enumerate(program.groups, start=1):
        if group.kind is GroupKind.OVERLAP:
            _chunk_geometry(geo, f"overlap_{k}", program, group, mesh, rank, sizes)
    return geo


def _chunk_geometry(
    geo: Geometry,
    loop: str,
    program: Program,
    group: Group,
    mesh: Mesh,
    rank: int,
    sizes: Mapping[str, int],
) -> None:
    by_name = {n.name: n for n in program.nodes}
    plan = ChunkPlan(group, by_name, mesh)
    values = {m: by_name[m] for m in group.members}
    for member in list(values.values()):
        for k, i in enumerate(member.inputs):
            if i.op is not Op.CONST and plan.is_chunked(member, k, i):
                values.setdefault(i.name, i)
    for name, node in values.items():
        total = resolve_shape(node.type.shape, sizes)[0]
        held = local_rows(node, total, mesh, rank)
        pairs = [plan.local_and_global(node, held, total, rank, c) for c in range(plan.chunks)]
        key = f"{loop}/{name}"
        geo.chunk_rows[key] = tuple(local for local, _ in pairs)
        geo.chunk_global_rows[key] = tuple(glob for _, glob in pairs)
        order = torch.cat([local for local, _ in pairs])
        consecutive = torch.equal(order, torch.arange(held, dtype=order.dtype))
        geo.chunk_order[key] = None if consecutive else order
        form = spec(node.op)
        if form.lowering is Lowering.SCATTER and name in group.members:
            # this rank's part of the chunk of the whole input (rows of every rank's block)
            lay = node.type.layout
            whole = resolve_shape(node.inputs[0].type.shape, sizes)[0]
            geo.chunk_bounds[key] = tuple(
                _start_length(
                    _bounds(
                        mesh, rank, lay.axis, len(chunk_rows(whole, plan.parts, plan.chunks, c))
                    )
                )
                for c in range(plan.chunks)
            )
        elif Arg.GATHER_DIM in form.arguments and name in group.members:
            axis = node.inputs[0].type.layout.axis
            n = mesh.axis_size(axis)
            geo.chunk_parts[key] = tuple(
                tuple(hi - lo for lo, hi in (slice_bounds(len(local), n, i) for i in range(n)))
                for local, _ in pairs
            )


def _start_length(bounds: tuple[int, int]) -> tuple[int, int]:
    return bounds[0], bounds[1] - bounds[0]


def _bounds(mesh: Mesh, rank: int, axis: str | None, total: int) -> tuple[int, int]:
    return slice_bounds(total, mesh.axis_size(axis), mesh.index_in(rank, axis))
