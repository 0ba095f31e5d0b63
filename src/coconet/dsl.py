"""The coconet DSL: what users write.

A ``Tensor`` is a handle on an IR node. Declaring one (``Tensor("g", float32, [N], Local)``) makes
a program input; every operator and function below builds a new node, checking layouts, shapes and
dtypes at once and pointing errors at the line that wrote the op::

    N = Dim("N")
    g = Tensor("g", float32, [N], Local)          # this rank's gradient
    w = Tensor("w", float32, [N], Replicated)     # the weights, the same on every rank
    lr = Scalar("lr")                             # a runtime scalar, not a constant
    g_sum = all_reduce(g)                         # Local -> Replicated
    program = Program("sgd", [g, w, lr], [update(w, w - lr * g_sum)])
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence
from typing import Any

from coconet.errors import DSLError, DTypeError, capture_loc
from coconet.ir.node import Node, make_node
from coconet.ir.ops import Op, ReduceOp
from coconet.ir.types import Dim, DType, Layout, Replicated, Size, TensorType

__all__ = [
    "Scalar",
    "Tensor",
    "abs",
    "all_gather",
    "all_reduce",
    "axis_index",
    "broadcast",
    "cast",
    "clamp",
    "clip",
    "dropout",
    "round_stochastic",
    "eq",
    "erf",
    "exp",
    "expand_as",
    "ge",
    "gelu",
    "gt",
    "le",
    "log",
    "lt",
    "matmul",
    "matmul_tn",
    "max",
    "maximum",
    "mean",
    "minimum",
    "ne",
    "neg",
    "norm",
    "pow",
    "reduce",
    "reduce_scatter",
    "relu",
    "rsqrt",
    "scatter",
    "send",
    "sigmoid",
    "sign",
    "silu",
    "sqrt",
    "sum",
    "tanh",
    "transpose",
    "unsqueeze",
    "update",
    "where",
    "world_size",
]

Number = int | float


class Tensor:
    """A value of a coconet program: an input when declared, the result of an op otherwise.

    ``shape`` is the global (logical) shape; ``layout`` says how it is spread over the ranks.
    """

    __slots__ = ("node",)

    def __init__(
        self,
        name: str,
        dtype: DType,
        shape: Sequence[Size],
        layout: Layout = Replicated,
    ) -> None:
        loc = capture_loc()
        if not isinstance(name, str) or not name.isidentifier():
            raise DSLError(
                f"a tensor name must be an identifier, got {name!r}",
                op="Tensor",
                loc=loc,
                hint='name it like a Python variable: Tensor("w", float32, [N])',
            )
        if not isinstance(dtype, DType):
            raise DSLError(
                f"dtype must be a coconet DType, got {dtype!r}",
                op="Tensor",
                loc=loc,
                hint="use coconet.float32, float16, bfloat16, int32 or int64",
            )
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise DSLError(
                f"{name}: the shape is a list of sizes, got {type(shape).__name__} {shape!r}",
                op="Tensor",
                loc=loc,
                hint=f"Tensor({name!r}, dtype, [N]) for one dim, [] for a scalar",
            )
        shape = tuple(shape)
        for s in shape:
            ok = isinstance(s, Dim) or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)
            if not ok:
                raise DSLError(
                    f"{name}: sizes are ints >= 0 or Dims, got {s!r}",
                    op="Tensor",
                    loc=loc,
                    hint='a size is a fixed int or a symbolic Dim("N") bound when the step runs',
                )
        if not isinstance(layout, Layout):
            raise DSLError(
                f"{name}: layout must be Local, Replicated or Sliced(dim), got {layout!r}",
                op="Tensor",
                loc=loc,
                hint="coconet.Local, coconet.Replicated or coconet.Sliced(0)",
            )
        if layout.is_sliced and not -len(shape) <= layout.dim < len(shape):
            raise DSLError(
                f"{name}: Sliced(dim={layout.dim}) but the tensor has rank {len(shape)}",
                op="Tensor",
                loc=loc,
                hint="slice one of the tensor's dims",
            )
        if layout.is_sliced and layout.dim < 0:
            layout = Layout(layout.kind, layout.dim % len(shape), layout.axis)
        attrs = {"dtype": dtype, "shape": shape, "layout": layout}
        self.node = make_node(Op.INPUT, (), attrs, name=name, loc=loc)

    @classmethod
    def _wrap(cls, node: Node) -> Tensor:
        t = object.__new__(cls)
        t.node = node
        return t

    # -- what it is -----------------------------------------------------------------------------

    @property
    def type(self) -> TensorType:
        return self.node.type

    @property
    def dtype(self) -> DType:
        return self.node.type.dtype

    @property
    def shape(self) -> tuple[Size, ...]:
        return self.node.type.shape

    @property
    def layout(self) -> Layout:
        return self.node.type.layout

    @property
    def name(self) -> str | None:
        return self.node.name

    def named(self, name: str) -> Tensor:
        """The same value, with a name that printing, schedules and errors use."""
        _check_name("named", name)
        if self.node.op is Op.INPUT:
            raise DSLError(
                f"inputs are named where they are declared; this is the input {self.node.name!r}",
                op="named",
                loc=capture_loc(),
                hint="name a computed value, e.g. (x * 2.0).named('x2')",
            )
        return Tensor._wrap(self.node.renamed(name))

    def __repr__(self) -> str:
        return f"Tensor({self.node.describe()})"

    def __bool__(self) -> bool:
        raise DSLError(
            "a coconet Tensor has no truth value while the program is being built",
            loc=capture_loc(),
            hint="use where(cond, a, b) for a data-dependent choice",
        )

    # ``==`` and ``!=`` build comparisons like ``<`` (``where(x == 0, a, b)``), so a Tensor is
    # hashed by identity: the IR keys dicts and sets by Tensors, and a dict lookup compares
    # with ``is`` before ``==``, so it never builds a node (``x in [y]`` would: it raises, as
    # any use of a Tensor's truth value does).
    __hash__ = object.__hash__

    # -- operators ------------------------------------------------------------------------------

    def __add__(self, o):
        return _binary(Op.ADD, self, o)

    def __radd__(self, o):
        return _binary(Op.ADD, o, self)

    def __sub__(self, o):
        return _binary(Op.SUB, self, o)

    def __rsub__(self, o):
        return _binary(Op.SUB, o, self)

    def __mul__(self, o):
        return _binary(Op.MUL, self, o)

    def __rmul__(self, o):
        return _binary(Op.MUL, o, self)

    def __truediv__(self, o):
        return _binary(Op.DIV, self, o)

    def __rtruediv__(self, o):
        return _binary(Op.DIV, o, self)

    def __pow__(self, o):
        return _binary(Op.POW, self, o)

    def __rpow__(self, o):
        return _binary(Op.POW, o, self)

    def __neg__(self):
        return _unary(Op.NEG, self)

    def __lt__(self, o):
        return _binary(Op.LT, self, o)

    def __le__(self, o):
        return _binary(Op.LE, self, o)

    def __gt__(self, o):
        return _binary(Op.GT, self, o)

    def __ge__(self, o):
        return _binary(Op.GE, self, o)

    def __eq__(self, o):  # type: ignore[override] - a comparison node, as in torch
        return _binary(Op.EQ, self, o)

    def __ne__(self, o):  # type: ignore[override]
        return _binary(Op.NE, self, o)

    def __abs__(self):
        return _unary(Op.ABS, self)

    def __matmul__(self, o):
        return matmul(self, o)

    # -- method forms of reductions -------------------------------------------------------------

    def sum(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return _reduction(Op.SUM, self, dim, keepdim)

    def max(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return _reduction(Op.MAX, self, dim, keepdim)

    def norm(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return _reduction(Op.NORM, self, dim, keepdim)


def Scalar(name: str, dtype: DType = DType.float32) -> Tensor:  # noqa: N802 - a declaration
    """A runtime scalar input (learning rate, beta, step): Replicated, shape ``[]``."""
    t = Tensor.__new__(Tensor)
    Tensor.__init__(t, name, dtype, (), Replicated)
    return t


# ---------------------------------------------------------------------------------------------
# building nodes


def _node(x: Any, like: Node | None, op: Op) -> Node:
    if isinstance(x, Tensor):
        return x.node
    if isinstance(x, Dim):
        # ``x / N``: the size N as a 0-d value of the other operand's dtype, bound at run time
        return _size_node((x,), _like_dtype(like))
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise DSLError(
            f"operands must be coconet Tensors or Python numbers, got {type(x).__name__} {x!r}",
            op=str(op),
            loc=capture_loc(),
            hint="declare a runtime value with Tensor(...) or Scalar(...); constants are int/float",
        )
    dtype = DType.float32
    if like is not None:
        # A number takes the dtype of the tensor it meets; a float with an int tensor is an error
        # here, where the message can say it is the constant that does not fit.
        dtype = like.type.dtype
        if dtype is DType.bool:
            dtype = DType.int64
    if isinstance(x, float) and not dtype.is_float:
        raise DTypeError(
            f"the constant {x!r} is a float but the tensor is {dtype.value}",
            op=str(op),
            loc=capture_loc(),
            hint="cast(...) the tensor to a float dtype",
        )
    return make_node(Op.CONST, (), {"value": x, "dtype": dtype}, loc=capture_loc())


def _like_dtype(like: Node | None) -> DType:
    """The dtype a number (or a size) takes next to ``like``: its dtype, int64 next to bools."""
    if like is None:
        return DType.float32
    return DType.int64 if like.type.dtype is DType.bool else like.type.dtype


def _size_node(dims: tuple[Size, ...], dtype: DType) -> Node:
    """The product of ``dims`` as a 0-d value: a constant when every size is an int."""
    if all(isinstance(d, int) for d in dims):
        value = 1
        for d in dims:
            value *= d
        return make_node(Op.CONST, (), {"value": value, "dtype": dtype}, loc=capture_loc())
    return make_node(Op.SIZE, (), {"dims": tuple(dims), "dtype": dtype}, loc=capture_loc())


def _check_name(op: str, name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise DSLError(
            f"a value name must be an identifier, got {name!r}",
            op=op,
            loc=capture_loc(),
            hint="name it like a Python variable, e.g. name='g_sum'",
        )


def _wrap(op: Op, inputs: tuple[Node, ...], **attrs: Any) -> Tensor:
    name = attrs.pop("name", None)
    if name is not None:
        _check_name(str(op), name)
    return Tensor._wrap(make_node(op, inputs, attrs, name=name, loc=capture_loc()))


def _binary(op: Op, a: Any, b: Any) -> Tensor:
    la = a.node if isinstance(a, Tensor) else None
    lb = b.node if isinstance(b, Tensor) else None
    if la is None and lb is None:
        raise DSLError(
            f"at least one operand must be a coconet Tensor, got {a!r} and {b!r}",
            op=str(op),
            loc=capture_loc(),
            hint="compute constants in Python; an op of the DSL needs a Tensor operand",
        )
    return _wrap(op, (_node(a, lb, op), _node(b, la, op)))


def _unary(op: Op, x: Any, **attrs: Any) -> Tensor:
    return _wrap(op, (_node(x, None, op),), **attrs)


def _reduction(op: Op, x: Tensor, dim: int | None, keepdim: bool) -> Tensor:
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
        raise DSLError(
            f"dim must be an int or None, got {dim!r}",
            op=str(op),
            loc=capture_loc(),
            hint="dim=None reduces over every element, dim=0 over the first dim",
        )
    return _wrap(op, (_node(x, None, op),), dim=dim, keepdim=bool(keepdim))


def _check_axis(op: str, axis: Any) -> None:
    if axis is not None and not isinstance(axis, str):
        raise DSLError(
            f"axis must be a mesh axis name or None, got {axis!r}",
            op=op,
            loc=capture_loc(),
            hint="name an axis of the Mesh (Mesh(dp=2, tp=2): 'dp' or 'tp'); None is the world",
        )


# ---------------------------------------------------------------------------------------------
# computation


def neg(x: Tensor) -> Tensor:
    """``-x`` elementwise (``torch.neg``); the same as the unary ``-``."""
    return _unary(Op.NEG, x)


def sqrt(x: Tensor) -> Tensor:
    """The square root of each element (``torch.sqrt``; correctly rounded)."""
    return _unary(Op.SQRT, x)


def rsqrt(x: Tensor) -> Tensor:
    """``1 / sqrt(x)`` of each element (``torch.rsqrt``)."""
    return _unary(Op.RSQRT, x)


def exp(x: Tensor) -> Tensor:
    """``e`` to the power of each element (``torch.exp``)."""
    return _unary(Op.EXP, x)


def log(x: Tensor) -> Tensor:
    """The natural logarithm of each element (``torch.log``)."""
    return _unary(Op.LOG, x)


def abs(x: Tensor) -> Tensor:  # noqa: A001 - the DSL's name for it
    return _unary(Op.ABS, x)


def relu(x: Tensor) -> Tensor:
    """``max(x, 0)`` of each element (``torch.relu``)."""
    return _unary(Op.RELU, x)


def gelu(x: Tensor) -> Tensor:
    """GELU with the exact erf form (``torch.nn.functional.gelu``'s default)."""
    return _unary(Op.GELU, x)


def sign(x: Tensor) -> Tensor:
    """-1, 0 or 1 by the sign of each element (``torch.sign``; 0 for 0 and -0)."""
    return _unary(Op.SIGN, x)


def tanh(x: Tensor) -> Tensor:
    """The hyperbolic tangent of each element (``torch.tanh``)."""
    return _unary(Op.TANH, x)


def sigmoid(x: Tensor) -> Tensor:
    """``1 / (1 + exp(-x))`` (``torch.sigmoid``)."""
    return _unary(Op.SIGMOID, x)


def erf(x: Tensor) -> Tensor:
    """The error function of each element (``torch.erf``)."""
    return _unary(Op.ERF, x)


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` as one op (``torch.nn.functional.silu``)."""
    return _unary(Op.SILU, x)


def clamp(x: Tensor, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002 - torch's names
    """``x`` limited to ``[min, max]`` (either may be omitted; each a Tensor or a number).

    It is ``minimum(maximum(x, min), max)``, which is how ``torch.clamp`` defines it (``max``
    wins when ``min > max``; NaN stays NaN), so its rules, meaning and code are those two ops'.
    """
    if min is None and max is None:
        raise DSLError(
            "clamp needs a min, a max or both",
            op="clamp",
            loc=capture_loc(),
            hint="clamp(x, min=0.0), clamp(x, max=1.0) or clamp(x, -1.0, 1.0)",
        )
    out = x
    if min is not None:
        out = _binary(Op.MAXIMUM, out, min)
    if max is not None:
        out = _binary(Op.MINIMUM, out, max)
    return out


clip = clamp


def cast(x: Tensor, dtype: DType) -> Tensor:
    """``x`` converted to ``dtype`` (``Tensor.to``): mixed precision, e.g. a bfloat16 gradient
    accumulated in float32."""
    if not isinstance(dtype, DType):
        raise DSLError(
            f"cast takes a coconet DType, got {dtype!r}",
            op="cast",
            loc=capture_loc(),
            hint="coconet.float32, float16, bfloat16, int32 or int64",
        )
    return _unary(Op.CAST, x, dtype=dtype)


def pow(x: Any, exponent: Any) -> Tensor:  # noqa: A001
    return _binary(Op.POW, x, exponent)


def maximum(a: Any, b: Any) -> Tensor:
    """The larger of ``a`` and ``b``, element by element with broadcasting (``torch.maximum``);
    either may be a Python number."""
    return _binary(Op.MAXIMUM, a, b)


def minimum(a: Any, b: Any) -> Tensor:
    """The smaller of ``a`` and ``b``, element by element with broadcasting (``torch.minimum``);
    either may be a Python number."""
    return _binary(Op.MINIMUM, a, b)


def lt(a: Any, b: Any) -> Tensor:
    """``a < b`` element by element: a bool tensor (what ``where`` takes)."""
    return _binary(Op.LT, a, b)


def le(a: Any, b: Any) -> Tensor:
    """``a <= b`` element by element: a bool tensor (what ``where`` takes)."""
    return _binary(Op.LE, a, b)


def gt(a: Any, b: Any) -> Tensor:
    """``a > b`` element by element: a bool tensor (what ``where`` takes)."""
    return _binary(Op.GT, a, b)


def ge(a: Any, b: Any) -> Tensor:
    """``a >= b`` element by element: a bool tensor (what ``where`` takes)."""
    return _binary(Op.GE, a, b)


def eq(a: Any, b: Any) -> Tensor:
    """``a == b`` element by element: a bool tensor (what ``where`` takes)."""
    return _binary(Op.EQ, a, b)


def ne(a: Any, b: Any) -> Tensor:
    """``a != b`` element by element: a bool tensor (what ``where`` takes)."""
    return _binary(Op.NE, a, b)


def where(cond: Tensor, a: Any, b: Any) -> Tensor:
    """``a`` where ``cond`` holds, else ``b`` (CoCoNet's Ite)."""
    like = a.node if isinstance(a, Tensor) else b.node if isinstance(b, Tensor) else None
    return _wrap(
        Op.WHERE, (_node(cond, None, Op.WHERE), _node(a, like, Op.WHERE), _node(b, like, Op.WHERE))
    )


def dropout(x: Tensor, p: float, seed: Any = 0, step: Any = 0) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    The mask is a counter-based hash of (seed, step, the element's global index), so it is the same
    however the tensor is sliced or chunked. ``seed`` and ``step`` are int scalars or Python ints.
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise DSLError(
            f"dropout's p must be a Python number, got {p!r}",
            op="dropout",
            loc=capture_loc(),
            hint="p is fixed when the program is built, e.g. dropout(x, 0.1)",
        )
    return _wrap(Op.DROPOUT, _random_operands(Op.DROPOUT, x, seed, step), p=float(p))


def _random_operands(op: Op, x: Any, seed: Any, step: Any) -> tuple:
    """The operands of a counter-based random op (dropout, round_stochastic): ``x``, and its
    seed and step as integer scalars (a float is refused: the bits are keyed by integers)."""
    for role, v in (("seed", seed), ("step", step)):
        if isinstance(v, float):
            raise DTypeError(
                f"{op.value}'s {role} must be an integer scalar, got {v!r}",
                op=op.value,
                loc=capture_loc(),
                hint="declare it with Scalar(name, int64) or pass a Python int",
            )
    int_like = make_node(Op.CONST, (), {"value": 0, "dtype": DType.int64})
    return _node(x, None, op), _node(seed, int_like, op), _node(step, int_like, op)


def round_stochastic(x: Tensor, dtype: DType, seed: Any = 0, step: Any = 0) -> Tensor:
    """float32 ``x`` rounded to ``dtype`` (bfloat16) stochastically: up or down with
    probabilities proportional to the distance to each, so the rounding is unbiased (a mixed-
    precision optimizer's way to keep small updates on average). The random bits are a
    counter-based hash of (seed, step, the element's global index), as dropout's mask: the same
    however the tensor is sliced or chunked, on every rank."""
    if not isinstance(dtype, DType):
        raise DSLError(
            f"round_stochastic takes a coconet DType, got {dtype!r}",
            op="round_stochastic",
            loc=capture_loc(),
            hint="round_stochastic(x, coconet.bfloat16, seed, step)",
        )
    op = Op.ROUND_STOCHASTIC
    return _wrap(op, _random_operands(op, x, seed, step), dtype=dtype)


def _sum(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Sum over all elements, or over ``dim``. Over a sliced dim it gives Local partial sums."""
    return _reduction(Op.SUM, x, dim, keepdim)


def _max(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Maximum over all elements, or over ``dim``."""
    return _reduction(Op.MAX, x, dim, keepdim)


def mean(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The mean over all elements, or over ``dim``: the sum divided by the number of elements
    summed (a size: ``sum(x, dim) / N`` for a dim of size ``N``, bound when the step runs).

    Over a sliced dim the sum is this rank's partial sum, so the mean is a Local partial mean
    (``all_reduce`` adds them up to the mean); ``reorder`` moves it onto slices the same way.
    """
    total = _reduction(Op.SUM, x, dim, keepdim)
    if not x.dtype.is_float:
        raise DTypeError(
            f"mean needs a floating-point tensor, got {x.dtype.value}",
            op="mean",
            loc=capture_loc(),
            hint="cast(x, float32) first",
        )
    if dim is None or not x.type.rank:
        counted = tuple(x.shape)
    else:
        counted = (x.shape[dim % x.type.rank],)
    count = _size_node(counted, x.dtype)
    return _wrap(Op.DIV, (total.node, count))


def norm(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The L2 norm over all elements, or over ``dim``."""
    return _reduction(Op.NORM, x, dim, keepdim)


def matmul(x: Tensor, w: Tensor) -> Tensor:
    """``x[..., K] @ w[K, N]``."""
    return _wrap(Op.MATMUL, (_node(x, None, Op.MATMUL), _node(w, None, Op.MATMUL)))


def matmul_tn(x: Tensor, y: Tensor) -> Tensor:
    """``x[..., K]`` transposed times ``y[..., N]``, summed over every leading dim: ``[K, N]``.

    The gradient of ``matmul(x, w)``'s weight is ``matmul_tn(x, ct)``. Rows sliced alike give
    Local partial sums; a Replicated ``x`` with ``y`` sliced on its last dim gives Sliced(1)
    (column-parallel), ``x`` sliced on its last dim with a Replicated ``y`` Sliced(0)."""
    return _wrap(Op.MATMUL_TN, (_node(x, None, Op.MATMUL_TN), _node(y, None, Op.MATMUL_TN)))


def transpose(w: Tensor, name: str | None = None) -> Tensor:
    """The matrix ``w[K, N]`` as ``[N, K]`` (Sliced(0) becomes Sliced(1) and back)."""
    return _wrap(Op.TRANSPOSE, (_node(w, None, Op.TRANSPOSE),), name=name)


def unsqueeze(x: Tensor, dim: int, name: str | None = None) -> Tensor:
    """``x`` with a dim of size 1 inserted at ``dim`` (``torch.unsqueeze``)."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise DSLError(
            f"unsqueeze's dim must be an int, got {dim!r}",
            op="unsqueeze",
            loc=capture_loc(),
            hint="unsqueeze(x, 0) adds a leading dim of size 1",
        )
    return _wrap(Op.UNSQUEEZE, (_node(x, None, Op.UNSQUEEZE),), dim=dim, name=name)


def expand_as(x: Any, like: Tensor, name: str | None = None) -> Tensor:
    """``x`` broadcast to the shape of ``like`` as a new tensor (``like``'s values are unread)."""
    lk = like.node if isinstance(like, Tensor) else None
    return _wrap(
        Op.EXPAND_AS, (_node(x, lk, Op.EXPAND_AS), _node(like, None, Op.EXPAND_AS)), name=name
    )


sum = _sum  # noqa: A001 - the DSL's reduction; builtins.sum is still builtins.sum
max = _max  # noqa: A001

# ---------------------------------------------------------------------------------------------
# communication


def world_size(axis: str | None = None, dtype: DType = DType.float32) -> Tensor:
    """The number of ranks along mesh ``axis`` (the whole world for None) as a 0-d Replicated
    value, known when the program is compiled or simulated: ``g_sum / world_size()`` is the
    mean gradient whatever the world size, with no runtime scalar to pass."""
    _check_axis("world_size", axis)
    if not isinstance(dtype, DType):
        raise DSLError(
            f"world_size's dtype must be a coconet DType, got {dtype!r}",
            op="world_size",
            loc=capture_loc(),
            hint="coconet.float32 (the default) or coconet.int64",
        )
    return _wrap(Op.WORLD_SIZE, (), axis=axis, dtype=dtype)


def axis_index(axis: str | None = None, dtype: DType = DType.int64) -> Tensor:
    """This rank's index along mesh ``axis`` (its world rank for None), a 0-d Local value."""
    _check_axis("axis_index", axis)
    if not isinstance(dtype, DType):
        raise DSLError(
            f"axis_index's dtype must be a coconet DType, got {dtype!r}",
            op="axis_index",
            loc=capture_loc(),
            hint="coconet.int64 (the default) or coconet.float32",
        )
    return _wrap(Op.AXIS_INDEX, (), axis=axis, dtype=dtype)


def _reduce_op(op: Any, who: str) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise DSLError(
            f"op= must be a ReduceOp, got {op!r}",
            op=who,
            loc=capture_loc(),
            hint="ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD or ReduceOp.MEAN",
        )
    return op


def _collective(op: Op, x: Any, reduce_op: ReduceOp, who: str, **attrs: Any) -> Tensor:
    """A reducing collective; ``ReduceOp.MEAN`` is the SUM collective (named ``<name>_sum``)
    divided by ``world_size(axis)`` (named ``name``: the value the caller holds)."""
    if reduce_op is not ReduceOp.MEAN:
        return _wrap(op, (_node(x, None, op),), reduce_op=reduce_op, **attrs)
    if isinstance(x, Tensor) and not x.dtype.is_float:
        raise DTypeError(
            f"ReduceOp.MEAN needs a floating-point tensor, got {x.dtype.value}",
            op=who,
            loc=capture_loc(),
            hint="cast(x, float32) first, or reduce with ReduceOp.SUM",
        )
    name = attrs.pop("name", None)
    if name is not None:
        _check_name(who, name)
    total = _wrap(op, (_node(x, None, op),), reduce_op=ReduceOp.SUM, **attrs,
                  name=f"{name}_sum" if name else None)  # fmt: skip
    count = make_node(
        Op.WORLD_SIZE, (), {"axis": attrs.get("axis"), "dtype": total.dtype}, loc=capture_loc()
    )
    return _wrap(Op.DIV, (total.node, count), name=name)


def all_reduce(
    x: Tensor, op: ReduceOp = ReduceOp.SUM, axis: str | None = None, name: str | None = None
) -> Tensor:
    """Reduce the Local values of every rank of ``axis``; each rank gets the result (Replicated).

    ``op=ReduceOp.MEAN`` (the averaged gradient of DDP) is the sum divided by
    ``world_size(axis)``: the division is named ``name``, the all_reduce, a SUM that schedules
    split like any other, ``<name>_sum``."""
    _check_axis("all_reduce", axis)
    return _collective(
        Op.ALL_REDUCE, x, _reduce_op(op, "all_reduce"), "all_reduce", axis=axis, name=name
    )


def reduce_scatter(
    x: Tensor,
    op: ReduceOp = ReduceOp.SUM,
    axis: str | None = None,
    dim: int = 0,
    name: str | None = None,
) -> Tensor:
    """Reduce the Local values of ``axis``; rank i keeps the i-th part along ``dim`` (Sliced)."""
    _check_axis("reduce_scatter", axis)
    return _collective(
        Op.REDUCE_SCATTER,
        x,
        _reduce_op(op, "reduce_scatter"),
        "reduce_scatter",
        axis=axis,
        dim=dim,
        name=name,
    )


def all_gather(x: Tensor, axis: str | None = None, name: str | None = None) -> Tensor:
    """Concatenate the slices of a Sliced value on every rank of its axis (Replicated)."""
    _check_axis("all_gather", axis)
    if axis is None and isinstance(x, Tensor) and x.layout.is_sliced:
        axis = x.layout.axis
    return _wrap(Op.ALL_GATHER, (_node(x, None, Op.ALL_GATHER),), axis=axis, name=name)


def broadcast(x: Tensor, root: int = 0, axis: str | None = None, name: str | None = None) -> Tensor:
    """Every rank of ``axis`` gets the value of its ``root``-th rank (Replicated)."""
    _check_axis("broadcast", axis)
    return _wrap(Op.BROADCAST, (_node(x, None, Op.BROADCAST),), root=root, axis=axis, name=name)


def reduce(
    x: Tensor,
    root: int = 0,
    op: ReduceOp = ReduceOp.SUM,
    axis: str | None = None,
    name: str | None = None,
) -> Tensor:
    """The ``root``-th rank of ``axis`` gets the reduction; the other ranks hold zeros (Local)."""
    _check_axis("reduce", axis)
    return _collective(
        Op.REDUCE, x, _reduce_op(op, "reduce"), "reduce", root=root, axis=axis, name=name
    )


def send(x: Tensor, axis: str, name: str | None = None, reverse: bool = False) -> Tensor:
    """Point-to-point along a mesh axis: the result on rank i of ``axis`` is rank i-1's ``x``.

    This is a pipeline boundary: each stage sends to the next and receives from the previous.
    The first rank of the axis receives nothing and holds zeros. ``reverse=True`` sends the
    other way (rank i gets rank i+1's; the last holds zeros): a gradient going back a stage,
    the adjoint ``coconet.grad`` builds for a send.
    """
    if not isinstance(axis, str):
        raise DSLError(
            f"send needs the mesh axis to send along, got {axis!r}",
            op="send",
            loc=capture_loc(),
            hint="send(x, axis='pp'): rank i of the axis receives rank i-1's x",
        )
    if not isinstance(reverse, bool):
        raise DSLError(
            f"send's reverse must be True or False, got {reverse!r}",
            op="send",
            loc=capture_loc(),
            hint="reverse=True sends to the previous rank of the axis",
        )
    # reverse is stored only when set, so forward sends print and hash as they always did
    extra = {"reverse": True} if reverse else {}
    return _wrap(Op.SEND, (_node(x, None, Op.SEND),), axis=axis, name=name, **extra)


def scatter(x: Tensor, dim: int = 0, axis: str | None = None, name: str | None = None) -> Tensor:
    """This rank's slice of a Replicated value along ``dim`` (no communication)."""
    _check_axis("scatter", axis)
    return _wrap(Op.SCATTER, (_node(x, None, Op.SCATTER),), dim=dim, axis=axis, name=name)


def update(target: Tensor, value: Any) -> Tensor:
    """The new value of the input ``target``, applied only when the whole step has succeeded."""
    if not isinstance(target, Tensor):
        raise DSLError(
            f"update's first operand must be a coconet input Tensor, got {target!r}",
            op="update",
            loc=capture_loc(),
            hint="update(p, new_value) where p was declared with Tensor(...)",
        )
    return _wrap(Op.UPDATE, (target.node, _node(value, target.node, Op.UPDATE)))


_ = builtins  # the module shadows sum/max/abs/pow on purpose; builtins stays reachable
