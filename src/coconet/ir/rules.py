"""The typing rules of every op: dtype, global shape and layout inference.

``infer_type`` looks the op up in ``RULES`` (one entry per op) and raises a ``LayoutError``,
``ShapeError`` or ``DTypeError`` naming the op, the operands, the user's line and a hint when the
operands do not fit. The layout rules are CoCoNet's:

- all_reduce(Local) -> Replicated; reduce_scatter(Local) -> Sliced;
  all_gather(Sliced) -> Replicated;
  broadcast(Local) -> Replicated; reduce(Local) -> Local (the root holds the result);
  scatter(Replicated) -> Sliced; send keeps the layout within the other axes.
- Pointwise ops keep a common layout. A scalar (or any Replicated operand that is not spread along
  the sliced dim, such as a bias along another dim) combines with a Sliced operand; a Replicated
  operand that spans the sliced dim needs an explicit ``scatter``; Local with Sliced is an error;
  Local with Replicated is Local.
- Reductions over a sliced dim give Local partial results (reduce them with all_reduce); ``norm``
  over a sliced dim is refused since partial norms do not add up.
- matmul: Sliced(last) @ Sliced(0) -> Local partial sums (Megatron's row-parallel layer);
  Sliced(row) @ Replicated -> Sliced(row); Replicated @ Sliced(1) -> Sliced(last) (column-parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from coconet.errors import DSLError, DTypeError, LayoutError, ShapeError, SourceLoc
from coconet.ir.ops import BINARY, COMPARISONS, RANDOM, UNARY, Op, ReduceOp
from coconet.ir.types import (
    Dim,
    DType,
    Layout,
    Local,
    Replicated,
    Shape,
    Size,
    Sliced,
    TensorType,
    format_shape,
)

__all__ = ["RULES", "Operand", "infer_type"]


class Operand(Protocol):
    """What a typing rule reads of an operand: a ``Node``'s type, name and op (named here so
    that the rules do not import the node module that runs them)."""

    @property
    def type(self) -> TensorType: ...

    @property
    def name(self) -> str: ...

    @property
    def op(self) -> Op: ...


class _Violation(Exception):
    """Raised inside a rule; ``infer_type`` turns it into a user-facing error with context."""

    def __init__(self, kind: type, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.hint = hint


def infer_type(op: Op, inputs: tuple[Operand, ...], attrs: dict[str, Any], loc: SourceLoc | None):
    rule = RULES[op]
    try:
        return rule(inputs, attrs)
    except _Violation as v:
        details = [f"operand {i}: {n.describe()}" for i, n in enumerate(inputs)]
        raise v.kind(v.message, op=str(op), loc=loc, details=details, hint=v.hint) from None


# ---------------------------------------------------------------------------------------------
# shapes


def _same_size(a: Size, b: Size) -> bool:
    return a == b


def broadcast_shapes(shapes: list[Shape]) -> Shape:
    """Numpy broadcasting over int or symbolic sizes; a Dim only matches the same Dim (or 1)."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Size] = []
    for i in range(rank):
        size: Size = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if d == 1:
                continue
            if size == 1:
                size = d
            elif not _same_size(size, d):
                raise _Violation(
                    ShapeError,
                    "shapes do not broadcast: "
                    + " vs ".join(format_shape(x) for x in shapes)
                    + f" (dim {i} of the result: {size} vs {d})",
                    "sizes must be equal (the same Dim or the same int) or 1",
                )
        out.append(size)
    return tuple(out)


def _norm_dim(dim: int, rank: int, what: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise _Violation(DSLError, f"{what} must be an int, got {dim!r}", "dim=0 is the first dim")
    if not -rank <= dim < max(rank, 1):
        raise _Violation(
            ShapeError,
            f"{what} {dim} is out of range for a tensor of rank {rank}",
            f"a dim is from {-rank} to {rank - 1}" if rank else "a scalar only has dim 0",
        )
    return dim % rank if rank else 0


# ---------------------------------------------------------------------------------------------
# dtypes


def _is_scalar(n: Operand) -> bool:
    return n.type.rank == 0


def _pointwise_dtype(inputs: tuple[Operand, ...]) -> DType:
    """Equal dtypes, except a 0-d float operand adopts the float dtype of the tensors (as torch)."""
    tensors = [n for n in inputs if not _is_scalar(n)] or list(inputs)
    dtypes = {n.type.dtype for n in tensors}
    if len(dtypes) > 1:
        raise _Violation(
            DTypeError,
            "operands have different element types: " + ", ".join(sorted(d.value for d in dtypes)),
            "cast(...) one operand so both have the same dtype",
        )
    (dtype,) = dtypes
    for n in inputs:
        if n.type.dtype.is_float != dtype.is_float or (n.type.dtype is DType.bool) != (
            dtype is DType.bool
        ):
            raise _Violation(
                DTypeError,
                f"cannot mix {n.type.dtype.value} with {dtype.value}",
                "cast(...) the scalar to the tensor's dtype",
            )
    return dtype


# ---------------------------------------------------------------------------------------------
# layouts


def _axis_fits(replicated_axis: str | None, axis: str | None) -> bool:
    """A value Replicated over the whole world is also replicated within any axis group."""
    return replicated_axis is None or replicated_axis == axis


def _merge_replicated(layouts: list[Layout]) -> Layout:
    axes = {lay.axis for lay in layouts} - {None}
    if not axes:
        return Replicated
    if len(axes) == 1:
        return Replicated(axes.pop())
    # Replicated over different axes: the result differs between some ranks.
    return Local


def pointwise_layout(inputs: tuple[Operand, ...], out_shape: Shape) -> Layout:
    rank = len(out_shape)
    sliced: list[tuple[Operand, int]] = []
    for n in inputs:
        lay = n.type.layout
        if lay.is_sliced:
            d = lay.dim + (rank - n.type.rank)
            if n.type.shape[lay.dim] != out_shape[d]:
                raise _Violation(
                    ShapeError,
                    f"the Sliced operand {n.describe()} is broadcast along its sliced dim "
                    f"{lay.dim}",
                    "slice a dim that the result keeps at full size",
                )
            sliced.append((n, d))
    if not sliced:
        layouts = [n.type.layout for n in inputs]
        if any(lay.is_local for lay in layouts):
            return Local
        return _merge_replicated(layouts)

    first, d = sliced[0]
    axis = first.type.layout.axis
    for n, dn in sliced[1:]:
        if dn != d or n.type.layout.axis != axis:
            raise _Violation(
                LayoutError,
                f"operands are sliced differently: {first.type.layout} vs {n.type.layout}",
                "all_gather one operand, or slice both along the same dim and axis",
            )
    for n in inputs:
        lay = n.type.layout
        if lay.is_sliced:
            continue
        if lay.is_local:
            raise _Violation(
                LayoutError,
                f"cannot combine a Local operand ({n.describe()}) with a Sliced one "
                f"({first.describe()})",
                "reduce the Local operand first: reduce_scatter(...) gives a Sliced value, "
                "all_reduce(...) a Replicated one",
            )
        j = d - (rank - n.type.rank)
        spans = 0 <= j < n.type.rank and n.type.shape[j] != 1
        if spans or not _axis_fits(lay.axis, axis):
            raise _Violation(
                LayoutError,
                f"cannot combine a Replicated operand ({n.describe()}) with a Sliced one "
                f"({first.describe()})",
                "wrap the Replicated operand in scatter(...) to take this rank's slice of it",
            )
    return Sliced(d, axis)


# ---------------------------------------------------------------------------------------------
# the rules, one per op


def _input(inputs, attrs) -> TensorType:
    return TensorType(attrs["dtype"], attrs["shape"], attrs["layout"])


def _const(inputs, attrs) -> TensorType:
    return TensorType(attrs["dtype"], (), Replicated)


def _size(op: Op) -> Callable:
    """``size`` (a product of Dims and ints) and ``world_size`` (the ranks of a mesh axis): 0-d
    values that every rank knows alike, so Replicated."""

    def rule(inputs, attrs) -> TensorType:
        dtype = attrs.get("dtype")
        if not isinstance(dtype, DType) or dtype is DType.bool:
            raise _Violation(
                DTypeError,
                f"a size is a number, got dtype {dtype!r}",
                "float32 (to divide by it) or int64",
            )
        if op is Op.SIZE:
            dims = attrs.get("dims")
            ok = isinstance(dims, tuple) and all(
                isinstance(d, Dim) or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)
                for d in dims
            )
            if not ok:
                raise _Violation(
                    DSLError,
                    f"a size is a product of Dims and ints >= 0, got {dims!r}",
                    "write x / N with N = Dim('N') a size of the program's tensors",
                )
        elif attrs.get("axis") is not None and not isinstance(attrs["axis"], str):
            raise _Violation(
                DSLError,
                f"axis must be a mesh axis name or None, got {attrs['axis']!r}",
                "world_size('dp') is the number of ranks along dp; world_size() the whole world",
            )
        return TensorType(dtype, (), Replicated)

    return rule


def _pointwise(op: Op) -> Callable:
    def rule(inputs, attrs) -> TensorType:
        operands = inputs[:1] if op in RANDOM else inputs
        shape = broadcast_shapes([n.type.shape for n in operands])
        layout = pointwise_layout(operands, shape)
        dtype = _pointwise_dtype(operands)
        if op in COMPARISONS:
            return TensorType(DType.bool, shape, layout)
        if op is Op.CAST:
            return TensorType(attrs["dtype"], shape, layout)
        if op is Op.ROUND_STOCHASTIC:
            _check_round_stochastic(dtype, attrs)
            _check_seed_step("round_stochastic", inputs, "every rank rounds alike")
            return TensorType(attrs["dtype"], shape, layout)
        float_only = {Op.SQRT, Op.RSQRT, Op.EXP, Op.LOG, Op.GELU, Op.DIV, Op.DROPOUT, Op.POW}
        float_only |= {Op.TANH, Op.SIGMOID, Op.ERF, Op.SILU}
        if op in float_only and not dtype.is_float:
            raise _Violation(
                DTypeError,
                f"{op} needs a floating-point operand, got {dtype.value}",
                "cast(x, float32) first",
            )
        if dtype is DType.bool and op is not Op.CAST:
            raise _Violation(DTypeError, f"{op} does not take bool operands", "use where(...)")
        if op is Op.DROPOUT:
            _check_dropout(inputs, attrs)
        return TensorType(dtype, shape, layout)

    return rule


def _check_dropout(inputs, attrs) -> None:
    p = attrs["p"]
    if not 0.0 <= p < 1.0:
        raise _Violation(
            DSLError,
            f"dropout probability p={p} is not in [0, 1)",
            "p is the probability of zeroing an element, e.g. dropout(x, 0.1)",
        )
    _check_seed_step("dropout", inputs, "every rank draws the same mask")


def _check_round_stochastic(dtype: DType, attrs) -> None:
    """float32 rounded to bfloat16: the rounding drops the low 16 bits of the float32 pattern,
    which is what makes it exact in integers (float16's other exponent range has no such
    form)."""
    if dtype is not DType.float32 or attrs["dtype"] is not DType.bfloat16:
        raise _Violation(
            DTypeError,
            f"round_stochastic rounds float32 to bfloat16, got {dtype.value} to "
            f"{attrs['dtype'].value}",
            "cast(x, float32) first; for float16 use cast (round to nearest)",
        )


def _check_seed_step(op: str, inputs, why: str) -> None:
    """A counter-based random op's seed and step: integer scalars, Replicated."""
    for role, n in zip(("seed", "step"), inputs[1:], strict=True):
        if n.type.rank != 0 or n.type.dtype not in (DType.int64, DType.int32):
            raise _Violation(
                DTypeError,
                f"{op}'s {role} must be an integer scalar, got {n.describe()}",
                "declare it with Scalar(name, int64) or pass a Python int",
            )
        if not n.type.layout.is_replicated:
            raise _Violation(
                LayoutError,
                f"{op}'s {role} must be Replicated so {why}",
                f"declare {role} as a Scalar (Replicated), or pass a Python int",
            )


def _where(inputs, attrs) -> TensorType:
    cond, a, b = inputs
    if cond.type.dtype is not DType.bool:
        raise _Violation(
            DTypeError,
            f"where's condition must be bool, got {cond.type.dtype.value}",
            "build it with a comparison such as gt(x, 0)",
        )
    shape = broadcast_shapes([n.type.shape for n in inputs])
    layout = pointwise_layout(inputs, shape)
    dtype = _pointwise_dtype((a, b))
    return TensorType(dtype, shape, layout)


def _reduction(op: Op) -> Callable:
    def rule(inputs, attrs) -> TensorType:
        (x,) = inputs
        ty = x.type
        dim, keepdim = attrs.get("dim"), attrs.get("keepdim", False)
        if op is Op.NORM and not ty.dtype.is_float:
            raise _Violation(DTypeError, "norm needs a floating-point tensor", "cast(x, float32)")
        if op is Op.SUM and ty.dtype is DType.bool:
            raise _Violation(
                DTypeError, "cannot sum bool tensors", "cast(x, int32) first to count the Trues"
            )
        if dim is None:
            shape: Shape = tuple(1 for _ in ty.shape) if keepdim else ()
        else:
            dim = _norm_dim(dim, ty.rank, "reduction dim")
            shape = ty.shape[:dim] + ((1,) if keepdim else ()) + ty.shape[dim + 1 :]
        lay = ty.layout
        if lay.is_sliced:
            if dim is None or dim == lay.dim:
                if op is Op.NORM:
                    raise _Violation(
                        LayoutError,
                        f"norm over the sliced dim {lay.dim} of a Sliced tensor needs the other "
                        "ranks' parts",
                        "write sqrt(all_reduce(sum(x * x))): partial sums of squares add up",
                    )
                # Each rank's reduction of its own part: a partial result, reduced by all_reduce.
                return TensorType(ty.dtype, shape, Local)
            new_dim = lay.dim if (keepdim or dim > lay.dim) else lay.dim - 1
            return TensorType(ty.dtype, shape, Sliced(new_dim, lay.axis))
        return TensorType(ty.dtype, shape, lay)

    return rule


def _matmul(inputs, attrs) -> TensorType:
    a, b = inputs
    ta, tb = a.type, b.type
    if tb.rank != 2 or ta.rank < 1:
        raise _Violation(
            ShapeError,
            f"matmul takes x[..., K] @ w[K, N]; got {format_shape(ta.shape)} @ "
            f"{format_shape(tb.shape)}",
            "w is a matrix; x has at least one dim",
        )
    if not _same_size(ta.shape[-1], tb.shape[0]):
        raise _Violation(
            ShapeError,
            f"inner sizes differ: {format_shape(ta.shape)} @ {format_shape(tb.shape)} "
            f"({ta.shape[-1]} vs {tb.shape[0]})",
        )
    dtype = _pointwise_dtype((a, b))
    if dtype is DType.bool:
        raise _Violation(DTypeError, "matmul does not take bool operands", "cast(x, float32) first")
    shape = ta.shape[:-1] + (tb.shape[1],)
    la, lb = ta.layout, tb.layout
    last = len(shape) - 1
    if la.is_sliced and lb.is_sliced:
        if la.dim == ta.rank - 1 and lb.dim == 0 and la.axis == lb.axis:
            return TensorType(dtype, shape, Local)  # partial sums: the row-parallel layer
        raise _Violation(
            LayoutError,
            f"matmul of {la} by {lb}: only x sliced on its last dim by w sliced on dim 0 "
            "(the contraction dim) gives partial sums",
            "slice x on its last dim and w on dim 0, or all_gather one of them",
        )
    if la.is_sliced:
        if la.dim == ta.rank - 1:
            raise _Violation(
                LayoutError,
                "x is sliced on the contraction dim but w is not",
                "slice w on dim 0 as well (scatter(w, dim=0)) to get partial sums",
            )
        if lb.is_local or not _axis_fits(lb.axis, la.axis):
            raise _Violation(
                LayoutError,
                f"matmul of {la} by {lb}",
                "w must be Replicated to multiply row slices of x",
            )
        return TensorType(dtype, shape, Sliced(la.dim, la.axis))
    if lb.is_sliced:
        if lb.dim == 0:
            raise _Violation(
                LayoutError,
                "w is sliced on the contraction dim but x is not",
                "slice x on its last dim as well (scatter(x, dim=-1))",
            )
        if la.is_local or not _axis_fits(la.axis, lb.axis):
            raise _Violation(
                LayoutError, f"matmul of {la} by {lb}", "x must be Replicated for column slices"
            )
        return TensorType(dtype, shape, Sliced(last, lb.axis))
    if la.is_local or lb.is_local:
        return TensorType(dtype, shape, Local)
    return TensorType(dtype, shape, _merge_replicated([la, lb]))


def _matmul_tn(inputs, attrs) -> TensorType:
    """``x[..., K]`` transposed times ``y[..., N]``, summed over every leading dim: ``[K, N]``.

    Layouts (what the gradient of a matmul's weight needs):

    - rows of both sliced alike (a sequence-parallel or data-parallel weight gradient): Local
      partial sums, added up by ``all_reduce``;
    - ``x`` Replicated, ``y`` Sliced on its last dim (column-parallel): Sliced(1);
    - ``x`` Sliced on its last dim, ``y`` Replicated (row-parallel): Sliced(0);
    - otherwise Local if either is Local, else Replicated.
    """
    x, y = inputs
    tx, ty = x.type, y.type
    if tx.rank < 1 or tx.rank != ty.rank:
        raise _Violation(
            ShapeError,
            f"matmul_tn takes x[..., K] and y[..., N] with the same leading dims; got "
            f"{format_shape(tx.shape)} and {format_shape(ty.shape)}",
            "both operands carry the same rows: the activations and the output gradient",
        )
    if any(not _same_size(a, b) for a, b in zip(tx.shape[:-1], ty.shape[:-1], strict=True)):
        raise _Violation(
            ShapeError,
            f"leading dims differ: {format_shape(tx.shape)} vs {format_shape(ty.shape)}",
            "the rows summed over must be the same rows",
        )
    dtype = _pointwise_dtype((x, y))
    if dtype is DType.bool:
        raise _Violation(DTypeError, "matmul_tn does not take bool operands", "cast(x, float32)")
    shape = (tx.shape[-1], ty.shape[-1])
    lx, ly = tx.layout, ty.layout
    last = tx.rank - 1
    if lx.is_sliced and ly.is_sliced:
        if lx.dim == ly.dim and lx.dim != last and lx.axis == ly.axis:
            return TensorType(dtype, shape, Local)  # each rank's rows: partial sums
        raise _Violation(
            LayoutError,
            f"matmul_tn of {lx} by {ly}: only rows sliced alike give partial sums",
            "slice both operands' rows along the same dim and axis, or all_gather one of them",
        )
    for sliced, other, out_dim in ((lx, ly, 0), (ly, lx, 1)):
        if not sliced.is_sliced:
            continue
        if sliced.dim != last:
            raise _Violation(
                LayoutError,
                f"matmul_tn of {lx} by {ly}: one operand's rows are sliced, the other's are not",
                "scatter(...) the other operand along the same rows",
            )
        if other.is_local or not _axis_fits(other.axis, sliced.axis):
            raise _Violation(
                LayoutError,
                f"matmul_tn of {lx} by {ly}",
                "the operand that is not sliced must be Replicated over the sliced one's axis",
            )
        return TensorType(dtype, shape, Sliced(out_dim, sliced.axis))
    if lx.is_local or ly.is_local:
        return TensorType(dtype, shape, Local)
    return TensorType(dtype, shape, _merge_replicated([lx, ly]))


def _transpose(inputs, attrs) -> TensorType:
    (x,) = inputs
    ty = x.type
    if ty.rank != 2:
        raise _Violation(
            ShapeError,
            f"transpose takes a matrix, got shape {format_shape(ty.shape)}",
            "transpose swaps the two dims of a weight w[K, N]",
        )
    lay = ty.layout
    if lay.is_sliced:
        lay = Sliced(1 - lay.dim, lay.axis)
    return TensorType(ty.dtype, (ty.shape[1], ty.shape[0]), lay)


def _unsqueeze(inputs, attrs) -> TensorType:
    (x,) = inputs
    ty = x.type
    dim = _norm_dim(attrs.get("dim"), ty.rank + 1, "unsqueeze dim")
    lay = ty.layout
    if lay.is_sliced and lay.dim >= dim:
        lay = Sliced(lay.dim + 1, lay.axis)
    return TensorType(ty.dtype, ty.shape[:dim] + (1,) + ty.shape[dim:], lay)


def _expand_as(inputs, attrs) -> TensorType:
    """``a`` broadcast to the shape of ``b`` (``b``'s values are not read).

    The layout is ``b``'s when ``b`` is Sliced and ``a`` does not span the sliced dim: each rank
    spreads its own ``a`` over its own part (``a`` may be Local there: the gradient of a sum over
    a sliced dim spreads each rank's partial cotangent over that rank's part). Otherwise the
    pointwise rule."""
    a, b = inputs
    shape = broadcast_shapes([a.type.shape, b.type.shape])
    if shape != b.type.shape:
        raise _Violation(
            ShapeError,
            f"expand_as: {format_shape(a.type.shape)} does not broadcast to "
            f"{format_shape(b.type.shape)}",
            "each dim of the first operand is 1 or the second's size",
        )
    lb, la = b.type.layout, a.type.layout
    if lb.is_sliced and not la.is_sliced:
        j = lb.dim - (b.type.rank - a.type.rank)
        if 0 <= j < a.type.rank and a.type.shape[j] != 1:
            raise _Violation(
                LayoutError,
                f"expand_as of {a.describe()} over the Sliced {b.describe()}: it spans the sliced "
                f"dim {lb.dim}",
                "scatter(...) the first operand along that dim",
            )
        if la.is_replicated and not _axis_fits(la.axis, lb.axis):
            raise _Violation(
                LayoutError, f"expand_as of {la} over {lb}", "replicate it over the same axis"
            )
        return TensorType(a.type.dtype, shape, lb)
    return TensorType(a.type.dtype, shape, pointwise_layout((a, b), shape))


def _axis_index(inputs, attrs) -> TensorType:
    dtype = attrs.get("dtype")
    if not isinstance(dtype, DType) or dtype is DType.bool:
        raise _Violation(DTypeError, f"a rank index is a number, got dtype {dtype!r}", "int64")
    if attrs.get("axis") is not None and not isinstance(attrs["axis"], str):
        raise _Violation(
            DSLError,
            f"axis must be a mesh axis name or None, got {attrs['axis']!r}",
            "axis_index('tp') is this rank's index along tp; axis_index() its world rank",
        )
    return TensorType(dtype, (), Local)  # it differs between ranks


def _collective_input_local(op: Op, x: Operand) -> None:
    lay = x.type.layout
    if lay.is_local:
        return
    if lay.is_replicated:
        raise _Violation(
            LayoutError,
            f"{op} expects a Local input; this tensor is already {lay}",
            f"drop the {op}: every rank already holds the same value",
        )
    raise _Violation(
        LayoutError,
        f"{op} expects a Local input; this tensor is {lay}",
        "all_gather(...) turns a Sliced value into a Replicated one",
    )


def _check_reduce_op(attrs, dtype: DType) -> None:
    if not isinstance(attrs.get("reduce_op"), ReduceOp):
        raise _Violation(
            DSLError,
            f"op= must be a ReduceOp, got {attrs.get('reduce_op')!r}",
            "use ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD or ReduceOp.MEAN",
        )
    if attrs["reduce_op"] is ReduceOp.MEAN:
        # The DSL builds a mean as the sum divided by world_size(axis): no node carries MEAN.
        raise _Violation(
            DSLError,
            "a collective node reduces with SUM, MAX, MIN or PROD; MEAN is a sum divided by the "
            "group's size",
            "call coconet.all_reduce(x, ReduceOp.MEAN) (or reduce_scatter / reduce), which "
            "builds that division",
        )
    if dtype is DType.bool:
        raise _Violation(DTypeError, "cannot reduce bool tensors", "cast(x, int32) first")


def _all_reduce(inputs, attrs) -> TensorType:
    (x,) = inputs
    _collective_input_local(Op.ALL_REDUCE, x)
    _check_reduce_op(attrs, x.type.dtype)
    return TensorType(x.type.dtype, x.type.shape, Replicated(attrs.get("axis")))


def _reduce_scatter(inputs, attrs) -> TensorType:
    (x,) = inputs
    _collective_input_local(Op.REDUCE_SCATTER, x)
    _check_reduce_op(attrs, x.type.dtype)
    dim = _norm_dim(attrs["dim"], x.type.rank, "reduce_scatter dim")
    if x.type.rank == 0:
        raise _Violation(ShapeError, "cannot reduce_scatter a scalar", "use all_reduce")
    return TensorType(x.type.dtype, x.type.shape, Sliced(dim, attrs.get("axis")))


def _all_gather(inputs, attrs) -> TensorType:
    (x,) = inputs
    lay = x.type.layout
    if not lay.is_sliced:
        hint = (
            "all_reduce(...) combines Local values"
            if lay.is_local
            else "drop the all_gather: the value is already whole on every rank"
        )
        raise _Violation(
            LayoutError, f"all_gather expects a Sliced input; this tensor is {lay}", hint
        )
    if attrs.get("axis") != lay.axis:
        raise _Violation(
            LayoutError,
            f"all_gather over axis {attrs.get('axis')!r} of a tensor sliced over {lay.axis!r}",
            "gather over the axis the tensor is sliced on (leave axis= unset)",
        )
    return TensorType(x.type.dtype, x.type.shape, Replicated(lay.axis))


def _broadcast(inputs, attrs) -> TensorType:
    (x,) = inputs
    _collective_input_local(Op.BROADCAST, x)
    _check_root(attrs)
    return TensorType(x.type.dtype, x.type.shape, Replicated(attrs.get("axis")))


def _reduce(inputs, attrs) -> TensorType:
    (x,) = inputs
    _collective_input_local(Op.REDUCE, x)
    _check_reduce_op(attrs, x.type.dtype)
    _check_root(attrs)
    return TensorType(x.type.dtype, x.type.shape, Local)


def _check_root(attrs) -> None:
    root = attrs["root"]
    if not isinstance(root, int) or isinstance(root, bool) or root < 0:
        raise _Violation(
            DSLError,
            f"root must be a rank index >= 0, got {root!r}",
            "root is the index of a rank within its group along the axis: root=0 is the first",
        )


def _send(inputs, attrs) -> TensorType:
    (x,) = inputs
    axis = attrs["axis"]
    lay = x.type.layout
    if lay.is_local:
        return x.type
    if lay.axis is None or lay.axis == axis:
        raise _Violation(
            LayoutError,
            f"send along {axis!r} of a value that is {lay}: the receiving stage's ranks would "
            "hold parts of a different stage's value",
            f"send values that are Local, or {lay.kind.value} over another mesh axis than {axis!r}",
        )
    return x.type


def _scatter(inputs, attrs) -> TensorType:
    (x,) = inputs
    lay = x.type.layout
    axis = attrs.get("axis")
    if not lay.is_replicated:
        hint = (
            "reduce_scatter(...) gives this rank's slice of the sum of Local values"
            if lay.is_local
            else "the value is already sliced"
        )
        raise _Violation(
            LayoutError, f"scatter expects a Replicated input; this tensor is {lay}", hint
        )
    if not _axis_fits(lay.axis, axis):
        raise _Violation(
            LayoutError,
            f"scatter over axis {axis!r} of a value replicated over {lay.axis!r}",
            f"scatter over the axis the value is replicated on: scatter(x, axis={lay.axis!r})",
        )
    if x.type.rank == 0:
        raise _Violation(ShapeError, "cannot scatter a scalar", "scalars combine with slices as is")
    dim = _norm_dim(attrs["dim"], x.type.rank, "scatter dim")
    return TensorType(x.type.dtype, x.type.shape, Sliced(dim, axis))


def _update(inputs, attrs) -> TensorType:
    target, value = inputs
    if target.op is not Op.INPUT:
        raise _Violation(
            DSLError,
            "update's first operand must be a program input (a parameter or state tensor)",
            "update(p, new_value) where p was declared with Tensor(...)",
        )
    tt, tv = target.type, value.type
    if tt.dtype is not tv.dtype:
        raise _Violation(
            DTypeError,
            f"the new value of {target.name} is {tv.dtype.value}, the tensor is {tt.dtype.value}",
            f"cast(value, {tt.dtype.value})",
        )
    try:
        shape = broadcast_shapes([tt.shape, tv.shape])
    except _Violation:
        shape = None
    if shape != tt.shape or (tv.layout.is_sliced and tv.shape != tt.shape):
        raise _Violation(
            ShapeError,
            f"the new value of {target.name} has shape {format_shape(tv.shape)}, the tensor "
            f"{format_shape(tt.shape)}",
            "a Sliced new value must have the tensor's shape: slices do not broadcast"
            if tv.layout.is_sliced
            else "the new value must have the tensor's shape, or broadcast to it",
        )
    if tt.layout != tv.layout and not _update_layout_fits(target, value):
        hint = (
            "all_gather(...) the new value, or keep the tensor sliced (as_slice)"
            if tv.layout.is_sliced
            else "all_reduce(...) or broadcast(...) the new value so every rank stores the same"
            if tv.layout.is_local
            else "scatter(...) the new value to keep this rank's slice of it"
            if tt.layout.is_sliced and _axis_fits(tv.layout.axis, tt.layout.axis)
            else "declare the tensor with the layout of its new value"
        )
        raise _Violation(
            LayoutError,
            f"the new value of {target.name} is {tv.layout}, the tensor is {tt.layout}",
            hint,
        )
    return tt


def _update_layout_fits(target: Operand, value: Operand) -> bool:
    """A Replicated new value fits any target it combines with pointwise into the target's layout:
    a Local one, a Sliced one when it does not span the sliced dim (``update(s, 0.0)``), or one
    replicated over a single axis when the value is replicated over the whole world."""
    if not value.type.layout.is_replicated:
        return False
    try:
        return pointwise_layout((target, value), target.type.shape) == target.type.layout
    except _Violation:
        return False


RULES: dict[Op, Callable[[tuple, dict], TensorType]] = {
    Op.INPUT: _input,
    Op.CONST: _const,
    Op.SIZE: _size(Op.SIZE),
    Op.WORLD_SIZE: _size(Op.WORLD_SIZE),
    Op.AXIS_INDEX: _axis_index,
    **{op: _pointwise(op) for op in UNARY | BINARY},
    Op.WHERE: _where,
    Op.EXPAND_AS: _expand_as,
    Op.UNSQUEEZE: _unsqueeze,
    Op.TRANSPOSE: _transpose,
    **{op: _reduction(op) for op in (Op.SUM, Op.MAX, Op.NORM)},
    Op.MATMUL: _matmul,
    Op.MATMUL_TN: _matmul_tn,
    Op.ALL_REDUCE: _all_reduce,
    Op.REDUCE_SCATTER: _reduce_scatter,
    Op.ALL_GATHER: _all_gather,
    Op.BROADCAST: _broadcast,
    Op.REDUCE: _reduce,
    Op.SEND: _send,
    Op.SCATTER: _scatter,
    Op.UPDATE: _update,
}

missing = set(Op) - set(RULES)
if missing:  # pragma: no cover - a new op without a rule is a bug in coconet itself
    raise ImportError(f"ops without a typing rule: {sorted(o.value for o in missing)}")
