"""The vector-Jacobian rule of every op: what ``coconet.grad`` builds for its operands.

A rule takes the node, its cotangent ``ct`` (a node of the node's shape, already in a layout
that holds the node's whole cotangent: see ``coconet.grad``) and a ``Builder`` that makes nodes
at the user's line; it returns one contribution per operand, or ``None`` where no gradient
flows (comparisons, integer operands, dropout's seed). A contribution may still have the
operand's broadcast shape (``coconet.grad`` sums it back to the operand's shape) and any layout
the typing rules give it; ``coconet.grad`` reads from the layouts whether it is the operand's
cotangent itself or a partial one the ranks' values add up to (Megatron's conjugate f/g and
DTensor's Partial placement, inferred rather than asked for).

The rules are torch's own backward formulas (``tools/autograd/derivatives.yaml``) wherever a
choice exists: ``relu`` passes the gradient where the result is positive, ``abs`` multiplies by
``sign``, ``maximum`` splits it evenly between equal operands, ``max`` (``amax``) spreads it
evenly over the elements equal to the maximum, ``norm`` gives 0 where the norm is 0.

Collectives transpose by layout: ``all_reduce``'s Replicated cotangent is each rank's Local
cotangent (no communication); ``reduce_scatter``'s is ``all_gather``-ed; ``all_gather``'s is
scattered (no communication); ``scatter``'s is ``all_gather``-ed; ``broadcast``'s goes to its
root; ``reduce``'s is broadcast from its root; ``send``'s is a send the other way
(``reverse=True``: the gradient goes back a stage).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from coconet.errors import DifferentiationError, SourceLoc
from coconet.ir.node import Node, make_node
from coconet.ir.ops import COMPARISONS, Op, ReduceOp
from coconet.ir.types import DType

__all__ = ["RULES", "Builder", "Rule"]


class Builder:
    """Makes the nodes of a rule at one source line (the forward op's: errors point there)."""

    def __init__(self, loc: SourceLoc | None) -> None:
        self.loc = loc

    def op(self, op: Op, *inputs: Node, **attrs: Any) -> Node:
        return make_node(op, tuple(inputs), attrs, loc=self.loc)

    def num(self, value: float, like: Node) -> Node:
        """A constant of ``like``'s dtype."""
        return make_node(Op.CONST, (), {"value": value, "dtype": like.type.dtype}, loc=self.loc)

    def add(self, a: Node, b: Node) -> Node:
        return self.op(Op.ADD, a, b)

    def sub(self, a: Node, b: Node) -> Node:
        return self.op(Op.SUB, a, b)

    def mul(self, a: Node, b: Node) -> Node:
        return self.op(Op.MUL, a, b)

    def div(self, a: Node, b: Node) -> Node:
        return self.op(Op.DIV, a, b)

    def neg(self, a: Node) -> Node:
        return self.op(Op.NEG, a)

    def where(self, cond: Node, a: Node, b: Node) -> Node:
        return self.op(Op.WHERE, cond, a, b)

    def zero_where(self, cond: Node, a: Node) -> Node:
        """``a`` where ``cond`` is false, 0 where it holds (``masked_fill(cond, 0)``)."""
        return self.where(cond, self.num(0.0, a), a)

    def expand_as(self, a: Node, b: Node) -> Node:
        return self.op(Op.EXPAND_AS, a, b)

    def sum(self, x: Node, dim: int | None = None, keepdim: bool = False) -> Node:
        return self.op(Op.SUM, x, dim=dim, keepdim=keepdim)

    def world_size(self, axis: str | None, like: Node) -> Node:
        return self.op(Op.WORLD_SIZE, axis=axis, dtype=like.type.dtype)

    def reduced(self, ct: Node, n: Node) -> Node:
        """The cotangent of a reduction ``n`` spread back over its operand's shape."""
        (x,) = n.inputs
        dim = n.attr("dim")
        if dim is not None and not n.attr("keepdim") and x.type.rank:
            ct = self.op(Op.UNSQUEEZE, ct, dim=dim % x.type.rank)
        return self.expand_as(ct, x)


# (node, cotangent, builder) -> one contribution per operand
Rule = Callable[[Node, Node, Builder], tuple[Node | None, ...]]


def _unary(derivative: Callable[[Node, Node, Builder], Node]) -> Rule:
    """A one-operand op whose contribution is ``ct * derivative(x, y)`` (y: the result)."""

    def rule(n: Node, ct: Node, b: Builder) -> tuple[Node | None, ...]:
        return (b.mul(ct, derivative(n.inputs[0], n, b)),)

    return rule


def _gelu(x: Node, y: Node, b: Builder) -> Node:
    # torch's exact-GELU backward: cdf(x) + x * pdf(x)
    cdf = b.mul(b.add(b.op(Op.ERF, b.mul(x, b.num(math.sqrt(0.5), x))), b.num(1.0, x)),
                b.num(0.5, x))  # fmt: skip
    pdf = b.mul(b.op(Op.EXP, b.mul(b.mul(x, x), b.num(-0.5, x))),
                b.num(1.0 / math.sqrt(2.0 * math.pi), x))  # fmt: skip
    return b.add(cdf, b.mul(x, pdf))


def _silu(x: Node, y: Node, b: Builder) -> Node:
    s = b.op(Op.SIGMOID, x)
    return b.mul(s, b.add(b.num(1.0, x), b.mul(x, b.sub(b.num(1.0, x), s))))


def _no_gradient(n: Node, ct: Node, b: Builder) -> tuple[Node | None, ...]:
    return tuple(None for _ in n.inputs)


def _cast(n: Node, ct: Node, b: Builder) -> tuple[Node | None, ...]:
    (x,) = n.inputs
    if not x.type.dtype.is_float:
        return (None,)
    return (b.op(Op.CAST, ct, dtype=x.type.dtype),)


def _dropout(n: Node, ct: Node, b: Builder) -> tuple[Node | None, ...]:
    # The same mask (same seed, step, shape and layout: the same global indices), and scale.
    _, seed, step = n.inputs
    return (b.op(Op.DROPOUT, ct, seed, step, p=n.attr("p")), None, None)


def _round_stochastic(n: Node, ct: Node, b: Builder) -> tuple[Node | None, ...]:
    # straight through, as a cast's: the rounding's expected value is its operand
    x = n.inputs[0]
    return (b.op(Op.CAST, ct, dtype=x.type.dtype), None, None)


def _relu(n: Node, ct: Node, b: Builder) -> tuple[Node | None, ...]:
    return (b.where(b.op(Op.GT, n, b.num(0.0, n)), ct, b.num(0.0, ct)),)


def _abs(n: Node, ct: Node, b: Builder) -> tuple[Node | None, ...]:
    return (b.mul(ct, b.op(Op.SIGN, n.inputs[0])),)


def _add(n, ct, b):
    return ct, ct


def _sub(n, ct, b):
    return ct, b.neg(ct)


def _mul(n, ct, b):
    x, y = n.inputs
    return b.mul(ct, y), b.mul(ct, x)


def _div(n, ct, b):
    x, y = n.inputs
    return b.div(ct, y), b.div(b.neg(b.mul(ct, x)), b.mul(y, y))


def _pow(n, ct, b):
    x, e = n.inputs
    # torch: 0 where the exponent is 0 (else 0 * inf); the exponent's part 0 where x == 0 and
    # the exponent is >= 0 (the limit, not log(0) * 0 = nan)
    dx = b.zero_where(
        b.op(Op.EQ, e, b.num(0.0, e)),
        b.mul(b.mul(ct, e), b.op(Op.POW, x, b.sub(e, b.num(1.0, e)))),
    )
    false = make_node(Op.CONST, (), {"value": False, "dtype": DType.bool}, loc=b.loc)
    at_zero = b.where(b.op(Op.EQ, x, b.num(0.0, x)), b.op(Op.GE, e, b.num(0.0, e)), false)
    de = b.zero_where(at_zero, b.mul(b.mul(ct, n), b.op(Op.LOG, x)))
    return dx, de


def _extremum(first_wins: Op) -> Rule:
    """maximum (``first_wins`` GT) and minimum (LT): the gradient goes to the winning operand,
    split evenly where both are equal (torch's rule)."""

    def rule(n, ct, b):
        x, y = n.inputs
        half = b.mul(ct, b.num(0.5, ct))
        tie = b.op(Op.EQ, x, y)
        zero = b.num(0.0, ct)
        dx = b.where(tie, half, b.where(b.op(first_wins, x, y), ct, zero))
        dy = b.where(tie, half, b.where(b.op(first_wins, y, x), ct, zero))
        return dx, dy

    return rule


def _where(n, ct, b):
    cond, _, _ = n.inputs
    zero = b.num(0.0, ct)
    return None, b.where(cond, ct, zero), b.where(cond, zero, ct)


def _expand_as(n, ct, b):
    return ct, None  # coconet.grad sums ct back to the first operand's shape


def _sum(n, ct, b):
    return (b.reduced(ct, n),)


def _amax(n, ct, b):
    # torch's amax: the gradient spread evenly over the elements equal to the maximum
    (x,) = n.inputs
    hit = b.op(Op.EQ, x, b.reduced(n, n))
    count = b.op(Op.SUM, b.op(Op.CAST, hit, dtype=x.type.dtype), dim=n.attr("dim"),
                 keepdim=n.attr("keepdim"))  # fmt: skip
    return (b.where(hit, b.reduced(b.div(ct, count), n), b.num(0.0, ct)),)


def _norm(n, ct, b):
    (x,) = n.inputs
    scale = b.zero_where(b.op(Op.EQ, n, b.num(0.0, n)), b.div(ct, n))
    return (b.mul(x, b.reduced(scale, n)),)


def _matmul(n, ct, b):
    x, w = n.inputs
    return b.op(Op.MATMUL, ct, b.op(Op.TRANSPOSE, w)), b.op(Op.MATMUL_TN, x, ct)


def _matmul_tn(n, ct, b):
    x, y = n.inputs  # n = x^T y over the rows
    return b.op(Op.MATMUL, y, b.op(Op.TRANSPOSE, ct)), b.op(Op.MATMUL, x, ct)


def _transpose(n, ct, b):
    if ct.op is Op.MATMUL_TN:
        # (x^T y)^T = y^T x, made directly: a linear layer's weight gradient then comes out in
        # the weight's own [out, in] layout (as torch's linear backward makes it), not as a
        # transposed view, which autograd copies into the parameter's layout (a strided copy:
        # 6.8 ms for a 2048 x 1024 weight here, more than its share of the matmul)
        x, y = ct.inputs
        return (b.op(Op.MATMUL_TN, y, x),)
    return (b.op(Op.TRANSPOSE, ct),)


def _unsqueeze(n, ct, b):
    return (b.sum(ct, n.attr("dim")),)  # a sum over the size-1 dim: the squeeze, exactly


def _refuse(n: Node, what: str, hint: str) -> DifferentiationError:
    where = f" ({n.name})" if n.name else ""
    return DifferentiationError(f"{what}{where}", op=str(n.op), loc=n.loc, hint=hint)


def _extremum_collective(n: Node, ct: Node, b: Builder) -> Node:
    """all_reduce(MAX/MIN): the gradient to the ranks holding the extremum, split evenly."""
    (x,) = n.inputs
    hit = b.op(Op.EQ, x, n)
    count = b.op(Op.ALL_REDUCE, b.op(Op.CAST, hit, dtype=x.type.dtype), reduce_op=ReduceOp.SUM,
                 axis=n.attr("axis"))  # fmt: skip
    return b.where(hit, b.div(ct, count), b.num(0.0, ct))


def _all_reduce(n, ct, b):
    op = n.attr("reduce_op")
    if op is ReduceOp.SUM:
        return (ct,)  # the Replicated cotangent is every rank's own: no communication
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        return (_extremum_collective(n, ct, b),)
    raise _refuse(n, "all_reduce(PROD) has no gradient rule",
                  "reduce with SUM, MAX or MIN; a product's gradient needs the others' factors")


def _reduce_scatter(n, ct, b):
    if n.attr("reduce_op") is not ReduceOp.SUM:
        raise _refuse(n, f"reduce_scatter({n.attr('reduce_op')}) has no gradient rule",
                      "reduce_scatter with SUM, or all_reduce(MAX) and scatter")
    return (b.op(Op.ALL_GATHER, ct, axis=n.attr("axis")),)


def _all_gather(n, ct, b):
    lay = n.inputs[0].type.layout
    if ct.type.layout.is_local:  # a partial cotangent (the op spec's vjp_takes_partial)
        return (b.op(Op.REDUCE_SCATTER, ct, reduce_op=ReduceOp.SUM, dim=lay.dim, axis=lay.axis),)
    return (b.op(Op.SCATTER, ct, dim=lay.dim, axis=lay.axis),)


def _scatter(n, ct, b):
    return (b.op(Op.ALL_GATHER, ct, axis=n.type.layout.axis),)


def _broadcast(n, ct, b):
    # Only the root's value was read: its rank gets the whole cotangent, the others zeros.
    index = b.op(Op.AXIS_INDEX, axis=n.attr("axis"), dtype=DType.int64)
    root = make_node(Op.CONST, (), {"value": n.attr("root"), "dtype": DType.int64}, loc=b.loc)
    return (b.where(b.op(Op.EQ, index, root), ct, b.num(0.0, ct)),)


def _reduce(n, ct, b):
    if n.attr("reduce_op") is not ReduceOp.SUM:
        raise _refuse(n, f"reduce({n.attr('reduce_op')}) has no gradient rule", "reduce with SUM")
    if ct.type.layout.is_local:
        # only the root's result was the sum: every rank's input gets the root's cotangent
        return (b.op(Op.BROADCAST, ct, root=n.attr("root"), axis=n.attr("axis")),)
    return (ct,)


def _send(n, ct, b):
    # stage i's value went to stage i + 1: its gradient comes back from there (and the other
    # way for a reverse send); the stage that received zeros gives nothing back
    extra = {} if n.attr("reverse") else {"reverse": True}
    return (b.op(Op.SEND, ct, axis=n.attr("axis"), **extra),)


RULES: dict[Op, Rule] = {
    Op.NEG: lambda n, ct, b: (b.neg(ct),),
    Op.SQRT: lambda n, ct, b: (b.div(ct, b.mul(n, b.num(2.0, n))),),  # torch: ct / (2 y)
    Op.RSQRT: _unary(lambda x, y, b: b.mul(b.num(-0.5, y), b.mul(b.mul(y, y), y))),
    Op.EXP: _unary(lambda x, y, b: y),
    Op.LOG: _unary(lambda x, y, b: b.div(b.num(1.0, x), x)),
    Op.ABS: _abs,
    Op.RELU: _relu,
    Op.GELU: _unary(_gelu),
    Op.SIGN: _no_gradient,
    Op.TANH: _unary(lambda x, y, b: b.sub(b.num(1.0, y), b.mul(y, y))),
    Op.SIGMOID: _unary(lambda x, y, b: b.mul(b.sub(b.num(1.0, y), y), y)),
    Op.ERF: _unary(lambda x, y, b: b.mul(b.num(2.0 / math.sqrt(math.pi), x),
                                         b.op(Op.EXP, b.neg(b.mul(x, x))))),  # fmt: skip
    Op.SILU: _unary(_silu),
    Op.CAST: _cast,
    Op.DROPOUT: _dropout,
    Op.ROUND_STOCHASTIC: _round_stochastic,
    Op.ADD: _add,
    Op.SUB: _sub,
    Op.MUL: _mul,
    Op.DIV: _div,
    Op.POW: _pow,
    Op.MAXIMUM: _extremum(Op.GT),
    Op.MINIMUM: _extremum(Op.LT),
    **{op: _no_gradient for op in COMPARISONS},
    Op.WHERE: _where,
    Op.EXPAND_AS: _expand_as,
    Op.UNSQUEEZE: _unsqueeze,
    Op.TRANSPOSE: _transpose,
    Op.SUM: _sum,
    Op.MAX: _amax,
    Op.NORM: _norm,
    Op.MATMUL: _matmul,
    Op.MATMUL_TN: _matmul_tn,
    Op.ALL_REDUCE: _all_reduce,
    Op.REDUCE_SCATTER: _reduce_scatter,
    Op.ALL_GATHER: _all_gather,
    Op.BROADCAST: _broadcast,
    Op.REDUCE: _reduce,
    Op.SEND: _send,
    Op.SCATTER: _scatter,
}
