"""Chunk-by-chunk execution of an overlapped chain, as the schedule's ``overlap`` defines it.

Chunk c of a value (see ``coconet.schedule.overlap``): for a value Sliced on dim 0, part c of the
rank's own rows; for a whole value with N rows, the union over the ranks i of the chunk axis of
part c of rank i's block of rows. Running the chain's ops on these chunks and putting the rows
back gives the unchunked result, which is what the simulator checks a chunked schedule against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coconet.ir.group import Group
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.opspec import Lowering, spec
from coconet.ir.types import slice_bounds

__all__ = ["ChunkPlan", "assemble_rows", "chunk_rows", "local_rows", "read_in_chunks"]

PerRank = list[torch.Tensor]


def chunk_rows(rows: int, parts: int, chunks: int, c: int) -> torch.Tensor:
    """Rows of chunk ``c`` of a whole value of ``rows`` rows spread in ``parts`` blocks."""
    pieces = []
    for i in range(parts):
        lo, hi = slice_bounds(rows, parts, i)
        sub_lo, sub_hi = slice_bounds(hi - lo, chunks, c)
        pieces.append(torch.arange(lo + sub_lo, lo + sub_hi, dtype=torch.int64))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def read_in_chunks(consumer: Node, k: int, value: Node, members: set[str], rows) -> bool:
    """Whether operand ``k`` of chain member ``consumer`` is read chunk by chunk (else whole).

    Chain members are; so are outside values with the chain's rows (``rows``): activations and
    residuals. Weights (matmul's second operand), dropout's seed and step, biases and scalars are
    read whole.
    """
    if value.name in members:
        return True
    if k in spec(consumer.op).whole_operands:
        return False  # a matmul's weight, dropout's seed and step
    ty = value.type
    if spec(consumer.op).lowering is Lowering.REDUCTION:
        # Overlap only admits reductions that keep the rows: the operand's rows are the
        # result's, whatever the ranks (``sum(x[B, H], dim=1)`` is [B]).
        return ty.rank > 0 and ty.shape[0] == rows and ty.shape[0] != 1
    return (
        ty.rank == consumer.type.rank and ty.rank > 0 and ty.shape[0] == rows and ty.shape[0] != 1
    )


def assemble_rows(pieces: list[torch.Tensor], order: torch.Tensor | None) -> torch.Tensor:
    """A value from its chunks: ``order`` lists the local row of each row of the concatenated
    chunks (None: the chunks are consecutive rows already)."""
    if order is None:
        return torch.cat(pieces)
    # each chunk copied once, straight to its rows (a concatenation first would copy twice)
    first = pieces[0]
    out = first.new_empty((sum(p.shape[0] for p in pieces), *first.shape[1:]))
    start = 0
    for piece in pieces:
        stop = start + piece.shape[0]
        out.index_copy_(0, order[start:stop], piece)
        start = stop
    return out


class ChunkPlan:
    """How the members of one overlap group and the values they read are cut into chunks."""

    def __init__(self, group: Group, nodes: dict[str, Node], mesh: Mesh) -> None:
        self.chunks = group.chunks
        self.members = [nodes[m] for m in group.members]
        self.names = set(group.members)
        self.rows = self.members[0].type.shape[0]
        # The chunk axis comes from the values sliced on rows: members, and also operands read
        # from outside in chunks (the reduce_scatter before an overlapped all_gather): whole
        # values must then be chunked as the union of part c of every rank's block.
        sliced = [
            n.type.layout
            for n in self.members
            if n.type.layout.is_sliced and n.type.layout.dim == 0
        ] + [
            i.type.layout
            for m in self.members
            for k, i in enumerate(m.inputs)
            if i.name not in self.names
            and i.type.layout.is_sliced
            and i.type.layout.dim == 0
            and self.is_chunked(m, k, i)
        ]
        self.axis = sliced[0].axis if sliced else None
        self.parts = mesh.axis_size(self.axis) if sliced else 1
        self.mesh = mesh

    def is_chunked(self, consumer: Node, k: int, value: Node) -> bool:
        """Whether operand ``k`` of ``consumer`` is cut in chunks (else it is read whole)."""
        return read_in_chunks(consumer, k, value, self.names, self.rows)

    def local_and_global(
        self, node: Node, local_rows: int, global_rows: int, rank: int, c: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(local row indices, global row indices) of chunk ``c`` of rank's block of ``node``."""
        lay = node.type.layout
        if lay.is_sliced and lay.dim == 0:
            lo, hi = slice_bounds(local_rows, self.chunks, c)
            start = slice_bounds(
                global_rows, self.mesh.axis_size(lay.axis), self.mesh.index_in(rank, lay.axis)
            )[0]
            local = torch.arange(lo, hi, dtype=torch.int64)
            return local, local + start
        rows = chunk_rows(local_rows, self.parts, self.chunks, c)
        return rows, rows

    def run(
        self,
        values: dict[str, PerRank],
        world: int,
        global_rows: Callable[[Node], int],
        evaluate: Callable[[Node, dict[str, PerRank], dict[int, torch.Tensor]], PerRank],
    ) -> dict[str, PerRank]:
        """Evaluate the chain chunk by chunk; returns each member's whole per-rank value."""
        pieces: dict[str, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {
            m.name: [[] for _ in range(world)] for m in self.members
        }
        for c in range(self.chunks):
            scope: dict[str, PerRank] = {}
            for m in self.members:
                for k, i in enumerate(m.inputs):
                    if i.name in scope or i.name in self.names:
                        continue
                    if self.is_chunked(m, k, i):
                        scope[i.name] = [
                            values[i.name][r].index_select(
                                0,
                                self.local_and_global(
                                    i, values[i.name][r].shape[0], global_rows(i), r, c
                                )[0],
                            )
                            for r in range(world)
                        ]
                    else:
                        scope[i.name] = values[i.name]
                # Global rows of this member's chunk on each rank (dropout keys on them).
                rows: dict[int, torch.Tensor] = {}
                for r in range(world):
                    full = global_rows(m)
                    local_n = local_rows(m, full, self.mesh, r)
                    local, glob = self.local_and_global(m, local_n, full, r, c)
                    rows[r] = glob
                    pieces[m.name][r].append((local, glob))
                out = evaluate(m, scope, rows)
                scope[m.name] = out
                for r in range(world):
                    local, _ = pieces[m.name][r][-1]
                    pieces[m.name][r][-1] = (local, out[r])
        result: dict[str, PerRank] = {}
        for m in self.members:
            per_rank = []
            for r in range(world):
                parts = pieces[m.name][r]
                n = sum(len(idx) for idx, _ in parts)
                sample = parts[0][1]
                whole = sample.new_empty((n, *sample.shape[1:]))
                for idx, chunk in parts:
                    whole.index_copy_(0, idx, chunk)
                per_rank.append(whole)
            result[m.name] = per_rank
        return result


def local_rows(node: Node, global_rows: int, mesh: Mesh, rank: int) -> int:
    """How many rows of ``node`` (with ``global_rows`` in all) ``rank`` holds."""
    lay = node.type.layout
    if lay.is_sliced and lay.dim == 0:
        lo, hi = slice_bounds(global_rows, mesh.axis_size(lay.axis), mesh.index_in(rank, lay.axis))
        return hi - lo
    return global_rows
