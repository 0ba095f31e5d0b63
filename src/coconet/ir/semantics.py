"""What each op does to tensors (plain torch): one rank's computation, one group's collective.

The simulator applies these per virtual rank and per group; generated code calls the same local
functions, so there is one definition of each op's meaning (``coconet.ir.opspec`` points here).
Reductions across ranks run in rank order (``reduce_values``): the order the simulator defines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from coconet.ir.ops import Op, ReduceOp
from coconet.ir.types import Dim, slice_bounds
from coconet.random import dropout_mask, round_stochastic

__all__ = [
    "COLLECTIVES",
    "FUNCTIONS",
    "POINTWISE",
    "apply_dropout",
    "apply_round_stochastic",
    "combine",
    "reduce_values",
    "reduction",
    "size_value",
]

POINTWISE: dict[Op, Callable[..., torch.Tensor]] = {
    Op.NEG: torch.neg,
    Op.SQRT: torch.sqrt,
    Op.RSQRT: torch.rsqrt,
    Op.EXP: torch.exp,
    Op.LOG: torch.log,
    Op.ABS: torch.abs,
    Op.RELU: torch.relu,
    Op.GELU: F.gelu,
    Op.SIGN: torch.sign,
    Op.TANH: torch.tanh,
    Op.SIGMOID: torch.sigmoid,
    Op.ERF: torch.erf,
    Op.SILU: F.silu,
    Op.ADD: torch.add,
    Op.SUB: torch.sub,
    Op.MUL: torch.mul,
    Op.DIV: torch.div,
    Op.POW: torch.pow,
    Op.MAXIMUM: torch.maximum,
    Op.MINIMUM: torch.minimum,
    Op.LT: torch.lt,
    Op.LE: torch.le,
    Op.GT: torch.gt,
    Op.GE: torch.ge,
    Op.EQ: torch.eq,
    Op.NE: torch.ne,
    Op.WHERE: torch.where,
    # a fresh tensor: expand alone would alias a's storage and have zero strides
    Op.EXPAND_AS: lambda a, b: a.expand_as(b).clone(),
}


def _matmul_tn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows = math.prod(x.shape[:-1])  # not reshape(-1, ...): a part may hold no element
    return torch.matmul(x.reshape(rows, x.shape[-1]).t(), y.reshape(rows, y.shape[-1]))


# Local ops whose meaning needs the node's static attributes: FUNCTIONS[op](*operands, **attrs)
FUNCTIONS: dict[Op, Callable[..., torch.Tensor]] = {
    Op.UNSQUEEZE: lambda x, dim: x.unsqueeze(dim),
    Op.TRANSPOSE: lambda x: x.t(),
    Op.MATMUL_TN: _matmul_tn,
}


def size_value(node: Any, sizes: Mapping[str, int], mesh: Any, rank: int) -> int:
    """The integer a ``size``, ``world_size`` or ``axis_index`` node stands for on ``rank``: the
    product of its sizes (each Dim at its bound global size, whatever slice a rank holds), the
    number of ranks along its mesh axis (the whole world for ``axis=None``), or the rank's index
    along that axis."""
    if node.op is Op.WORLD_SIZE:
        return mesh.axis_size(node.attr("axis"))
    if node.op is Op.AXIS_INDEX:
        return mesh.index_in(rank, node.attr("axis"))
    return math.prod(sizes[d.name] if isinstance(d, Dim) else d for d in node.attr("dims"))


def apply_dropout(
    x: torch.Tensor,
    p: float,
    seed: int | torch.Tensor,
    step: int | torch.Tensor,
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...],
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dropout of the block ``x`` that starts at ``offsets`` in a tensor of ``global_shape``
    (``rows``: the block's global row indices, when they are not contiguous)."""
    if p == 0.0:
        return x.clone()
    keep = dropout_mask(seed, step, p, global_shape, tuple(x.shape), offsets, x.device, rows)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


def apply_round_stochastic(
    x: torch.Tensor,
    dtype: torch.dtype,
    seed: int | torch.Tensor,
    step: int | torch.Tensor,
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...],
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The block ``x`` (float32, at ``offsets`` in a tensor of ``global_shape``) rounded to
    ``dtype`` (bfloat16) stochastically (``coconet.random.round_stochastic``)."""
    del dtype  # (bfloat16: the rules refuse any other)
    return round_stochastic(x, seed, step, global_shape, offsets, rows)


def reduction(op: Op, x: torch.Tensor, dim: int | None, keepdim: bool) -> torch.Tensor:
    dims = tuple(range(x.dim())) if dim is None else (dim,)
    if op is Op.SUM:
        return torch.sum(x, dim=dims, keepdim=keepdim) if x.dim() else x.clone()
    if op is Op.MAX:
        if x.dim() and any(x.shape[d] == 0 for d in dims):
            # An empty part (uneven slicing, more ranks than elements): the identity of max, so
            # that all_reduce(MAX) of the partial results is still the maximum of the whole.
            shape = torch.sum(x, dim=dims, keepdim=keepdim).shape
            if x.dtype == torch.bool:
                lowest: float | int | bool = False
            elif x.dtype.is_floating_point:
                lowest = float("-inf")
            else:
                lowest = torch.iinfo(x.dtype).min
            return torch.full(shape, lowest, dtype=x.dtype, device=x.device)
        return torch.amax(x, dim=dims, keepdim=keepdim) if x.dim() else x.clone()
    return torch.linalg.vector_norm(x, dim=dims if x.dim() else None, keepdim=keepdim)


def combine(op: ReduceOp, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if op is ReduceOp.SUM:
        return a + b
    if op is ReduceOp.MAX:
        return torch.maximum(a, b)
    if op is ReduceOp.MIN:
        return torch.minimum(a, b)
    return a * b


_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def reduce_values(op: ReduceOp, values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reduce in rank order: the order the simulator defines (and re-associated schedules match
    within a stated tolerance). 16-bit floats accumulate in float32 and are rounded once at the
    end, as the transports do. The result is always a new tensor."""
    dtype = values[0].dtype
    wide = _WIDE.get(dtype)
    if wide is None:
        acc = values[0].clone()
        for v in values[1:]:
            acc = combine(op, acc, v)
        return acc
    acc = values[0].to(wide)
    for v in values[1:]:
        acc = combine(op, acc, v.to(wide))
    return acc.to(dtype)


# -- collectives: the values of one group (in group-rank order) -> each member's result ---------
# The simulator runs these per mesh group; they are what every transport must compute (bitwise
# with rank-ordered reductions). ``root`` is a group rank, checked by the caller.


def _all_reduce(node, vals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    total = reduce_values(node.attr("reduce_op"), vals)
    return [total.clone() for _ in vals]


def _reduce_scatter(node, vals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    total = reduce_values(node.attr("reduce_op"), vals)
    dim = node.type.layout.dim
    out = []
    for i in range(len(vals)):
        lo, hi = slice_bounds(total.shape[dim], len(vals), i)
        out.append(total.narrow(dim, lo, hi - lo).clone())
    return out


def _all_gather(node, vals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    whole = torch.cat(list(vals), dim=node.inputs[0].type.layout.dim)
    return [whole.clone() for _ in vals]


def _broadcast(node, vals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [vals[node.attr("root")].clone() for _ in vals]


def _reduce(node, vals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    total = reduce_values(node.attr("reduce_op"), vals)
    root = node.attr("root")
    return [total.clone() if i == root else torch.zeros_like(total) for i in range(len(vals))]


COLLECTIVES: dict[Op, Callable[..., list[torch.Tensor]]] = {
    Op.ALL_REDUCE: _all_reduce,
    Op.REDUCE_SCATTER: _reduce_scatter,
    Op.ALL_GATHER: _all_gather,
    Op.BROADCAST: _broadcast,
    Op.REDUCE: _reduce,
}
