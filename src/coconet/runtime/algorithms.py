"""The ways to run all_reduce, reduce, reduce_scatter and all_gather over a torch.distributed
group.

gloo's own reduce_scatter and all_gather are several times slower than its all_reduce or
all_to_all for large tensors on one host (2 ranks over loopback, 64 MiB: ~80-130 ms each, against
~45-55 ms for all_reduce and ~25-35 ms for all_to_all), so each has alternatives built from
the fast collectives; the communicator measures them and picks one per size class
(``coconet.runtime.torchdist.ALGORITHMS`` registers them per op and ``Algorithm``). all_reduce
and reduce have all_to_all forms too, which reduce in rank order: bitwise what the simulator
computes.

Every function takes ``x0``, the tensor with the collective's dim moved to the front and made
contiguous, the group's process group and layout (``parts``: each member's part size along dim 0,
``index``: this rank's position) and returns a ``Pending``: the torch work handles in flight and a
``finish`` that turns the buffers into the result once they completed. Uneven parts follow
``torch.tensor_split``.

Reduction order: the ``all_to_all`` forms sum the received parts locally in rank order, which is
exactly the simulator's order (bitwise equal results); the others reduce in gloo's order (equal
within rounding; with 2 ranks a sum has one order, so they are exact too). Gathers only move data
and are exact whatever the algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from coconet.ir.ops import ReduceOp
from coconet.ir.semantics import reduce_values
from coconet.runtime.transport import Pending, wait_work

__all__ = ["TORCH_REDUCE_OP", "offsets"]

TORCH_REDUCE_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
}


def offsets(parts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for p in parts:
        out.append(acc)
        acc += p
    return out


# -- reduce_scatter: x0 is this rank's whole (Local) tensor; the result is its part of the sum ---


def rs_native(x0, op: ReduceOp, pg, parts, index, donate) -> Pending:
    out = x0.new_empty((parts[index], *x0.shape[1:]))
    if len(set(parts)) == 1:
        w = dist.reduce_scatter_single(out, x0, op=TORCH_REDUCE_OP[op], group=pg, async_op=True)
    else:  # the list form takes uneven parts
        chunks = list(x0.split(list(parts)))
        w = dist.reduce_scatter(out, chunks, op=TORCH_REDUCE_OP[op], group=pg, async_op=True)
    return Pending([w], lambda: out)


def rs_all_reduce(x0, op: ReduceOp, pg, parts, index, donate) -> Pending:
    buf = x0 if donate else x0.clone()
    w = dist.all_reduce(buf, op=TORCH_REDUCE_OP[op], group=pg, async_op=True)
    start = offsets(parts)[index]
    return Pending([w], lambda: buf.narrow(0, start, parts[index]))


def rs_all_to_all(x0, op: ReduceOp, pg, parts, index, donate) -> Pending:
    mine = parts[index]
    out = x0.new_empty((mine * len(parts), *x0.shape[1:]))
    w = dist.all_to_all_single(out, x0, [mine] * len(parts), list(parts), group=pg, async_op=True)
    # Every member's copy of my part arrived, in rank order: reduce them as the simulator does.
    return Pending([w], lambda: reduce_values(op, list(out.split(mine))) if mine else out[:0])


# -- all_gather: x0 is this rank's part; the result is the concatenation of every part ----------


def ag_native(x0, pg, parts, index) -> Pending:
    n, widest = len(parts), max(parts)
    if len(set(parts)) == 1:
        out = x0.new_empty((widest * n, *x0.shape[1:]))
        w = dist.all_gather_single(out, x0, group=pg, async_op=True)
        return Pending([w], lambda: out)
    # gloo's all_gather needs equal sizes: pad every part to the widest, then drop the padding.
    padded = x0.new_zeros((widest, *x0.shape[1:]))
    padded[: parts[index]].copy_(x0)
    buf = x0.new_empty((widest * n, *x0.shape[1:]))
    w = dist.all_gather_single(buf, padded, group=pg, async_op=True)

    def finish():
        return torch.cat([buf.narrow(0, i * widest, p) for i, p in enumerate(parts)])

    return Pending([w], finish)


def ag_all_reduce(x0, pg, parts, index) -> Pending:
    # Each rank contributes its part at its place and zeros elsewhere: a sum of one value and
    # zeros is that value exactly, so this is still pure data movement.
    out = x0.new_zeros((sum(parts), *x0.shape[1:]))
    out.narrow(0, offsets(parts)[index], parts[index]).copy_(x0)
    w = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=pg, async_op=True)
    return Pending([w], lambda: out)


def ag_all_to_all(x0, pg, parts, index) -> Pending:
    n = len(parts)
    out = x0.new_empty((sum(parts), *x0.shape[1:]))
    send = x0.repeat(n, *([1] * (x0.dim() - 1))) if x0.dim() else x0
    w = dist.all_to_all_single(out, send, list(parts), [parts[index]] * n, group=pg, async_op=True)
    return Pending([w], lambda: out)


# -- all_reduce: x0 is this rank's whole (Local) tensor, flattened ---------------------------------


def ar_native(x0, op: ReduceOp, pg, parts, index, donate) -> Pending:
    buf = x0 if donate else x0.clone()
    w = dist.all_reduce(buf, op=TORCH_REDUCE_OP[op], group=pg, async_op=True)
    return Pending([w], lambda: buf)


def ar_all_to_all(x0, op: ReduceOp, pg, parts, index, donate) -> Pending:
    """reduce_scatter by all_to_all (each rank reduces its part in rank order, as the simulator
    does), then all_gather by all_to_all: bitwise equal to the simulator for every op."""
    first = rs_all_to_all(x0, op, pg, parts, index, donate)

    def finish():
        second = ag_all_to_all(first.finish().contiguous(), pg, parts, index)
        for w in second.works:
            wait_work(w)
        return second.finish()

    return Pending(first.works, finish)


# -- reduce: the root (index ``root`` of the group) gets the reduction, the others zeros ---------


def rd_native(x0, op: ReduceOp, pg, parts, index, donate, root) -> Pending:
    buf = x0 if donate else x0.clone()
    dst = dist.get_global_rank(pg, root) if pg is not None else root
    w = dist.reduce(buf, dst=dst, op=TORCH_REDUCE_OP[op], group=pg, async_op=True)
    return Pending([w], lambda: buf if index == root else buf.zero_())


def rd_all_to_all(x0, op: ReduceOp, pg, parts, index, donate, root) -> Pending:
    whole = ar_all_to_all(x0, op, pg, parts, index, donate)

    def finish():
        out = whole.finish()  # every rank: the second phase is a collective too
        return out if index == root else out.zero_()

    return Pending(whole.works, finish)
