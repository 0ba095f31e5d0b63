"""One place per op: its typing rule, local meaning, lowering, cost model and properties.

Every layer reads what it needs of an op from its ``OpSpec`` (``spec(op)``), never from an
ad-hoc set or an if-chain over ops of its own:

- the **typing rule** (``rule``): dtype, global shape and layout (``coconet.ir.rules``);
- the **local meaning** (``local``): what a computation op does to one rank's tensors
  (``coconet.ir.semantics``), shared by the simulator and the generated code; collectives have
  their group meaning there too (``semantics.COLLECTIVES``);
- the **lowering** (``lowering``: the form of code the emitter writes and the simulator runs) and,
  for communication, the **transport operation** it calls (``transport``) with the arguments it
  passes (``arguments``);
- the **cost model**: ``sent`` (bytes a rank sends, ring algorithms; ``coconet.accounting``) and
  ``work`` (bytes read and written and flops of the local computation, for cost models);
- its **vector-Jacobian rule** (``vjp``, ``coconet.ir.adjoints``): what ``coconet.grad`` builds
  for the op's operands from its cotangent;
- its **properties** (``Prop``): row-wise (``overlap`` may chunk it), kernel-able (may be part of
  a fused kernel), fresh result (a collective may reuse its buffer), reorderable (may run on
  slices before an all_gather), communicates, and the exactness classes of
  ``coconet.sim.exactness``.

A new op is its ``Op`` member, its typing rule, its local meaning, one ``OpSpec`` below and its DSL
function; a new collective also needs each transport's implementation. The check at the end of
this module names any op that lacks a part it needs, at import.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from coconet.ir import adjoints, semantics
from coconet.ir.ops import BINARY, LEAVES, RANDOM, UNARY, Op
from coconet.ir.rules import RULES
from coconet.ir.types import Layout, Sliced, TensorType

if TYPE_CHECKING:
    from coconet.ir.mesh import Mesh
    from coconet.ir.node import Node

__all__ = [
    "SPECS",
    "Arg",
    "CommCost",
    "CurveBytes",
    "Lowering",
    "OpSpec",
    "Prop",
    "Sizes",
    "Traffic",
    "Work",
    "missing_parts",
    "ops_with",
    "spec",
]


class Lowering(enum.Enum):
    """The form of an op in generated code (and in the simulator's dispatch)."""

    LEAF = "leaf"  # an input or a constant: nothing to compute
    SIZE = "size"  # a size known when the step runs (semantics.size_value), as a 0-d tensor
    POINTWISE = "pointwise"  # local(*operands), elementwise with broadcasting
    CAST = "cast"  # a dtype conversion
    RANDOM = "random"  # counter-based randomness needs the block's place in the whole tensor
    REDUCTION = "reduction"  # semantics.reduction(op, x, dim, keepdim)
    MATMUL = "matmul"
    FUNCTION = "function"  # semantics.FUNCTIONS[op](*operands, **the node's attributes)
    SCATTER = "scatter"  # this rank's slice: a view of its bounds
    UPDATE = "update"  # committed by the runtime after the step
    COLLECTIVE = "collective"  # a transport start/wait pair over a group
    POINT_TO_POINT = "point_to_point"  # a send along a mesh axis, start/wait


class Prop(enum.Flag):
    NONE = 0
    ROWWISE = enum.auto()  # row r of the result reads row r of its row-carrying operands
    KERNEL = enum.auto()  # local computation a fused kernel may contain
    FRESH = enum.auto()  # the result is a new tensor no one else holds
    REORDERABLE = enum.auto()  # may run on slices, before the all_gather (``reorder``)
    COMMUNICATES = enum.auto()  # moves data between ranks
    REASSOCIATES = enum.auto()  # its additions' order depends on the operand's shape and kernel
    ROUNDS_PER_KERNEL = enum.auto()  # not correctly rounded: vector and scalar loops differ


class Arg(enum.Enum):
    """An argument a communication op passes to its transport operation, besides its input."""

    REDUCE_OP = "reduce_op"  # the ReduceOp
    DIM = "dim"  # the dim the result is sliced along (reduce_scatter)
    GATHER_DIM = "gather_dim"  # the dim the input is sliced along (all_gather), and its parts
    ROOT = "root"  # the group rank that holds or receives the value
    AXIS = "axis"  # the mesh axis of the group
    DONATE = "donate"  # whether the transport may overwrite its input (a temporary)
    REVERSE = "reverse"  # a send to the previous rank of the axis (passed only when set)


class CurveBytes(enum.Enum):
    """The bytes one call of a communication op is measured and predicted by (the key of its
    calibrated curve, ``coconet.tune.cost``)."""

    INPUT = "input"  # its whole input (all_reduce, reduce_scatter, broadcast, reduce)
    OUTPUT = "output"  # its whole result (all_gather: its input is one rank's slice)
    OWN = "own"  # this rank's own value (send: a stage's activation)


class Traffic(enum.Enum):
    """How a communication op's bytes cross the links (the cluster model, ``coconet.tune``)."""

    RING = "ring"  # passes of a ring over the tensor (``CommCost.ring_passes``)
    ROOTED = "rooted"  # one pipelined pass of the whole tensor from or to a root
    POINT_TO_POINT = "point to point"  # one message to the next rank of the axis


@dataclass(frozen=True)
class CommCost:
    """What the cost model knows of a communication op: the bytes its curve is keyed by, how
    they travel, and whether it reads what it reduces (one memory pass)."""

    curve_bytes: CurveBytes
    traffic: Traffic
    ring_passes: int = 0  # Traffic.RING: one for reduce_scatter and all_gather, two for all_reduce
    reduces: bool = False


class Sizes(Protocol):
    """Concrete sizes of a program's values on a mesh (what ``sent`` and ``work`` measure)."""

    mesh: Mesh

    def full_bytes(self, ty: TensorType) -> int: ...

    def slice_bytes(self, ty: TensorType, layout: Layout, rank: int) -> int: ...

    def local_bytes(self, ty: TensorType, rank: int) -> int: ...

    def local_numel(self, ty: TensorType, rank: int) -> int: ...

    def local_shape(self, ty: TensorType, rank: int) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Work:
    """The local computation of one op on one rank: bytes it reads and writes, and flops."""

    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class OpSpec:
    op: Op
    lowering: Lowering
    props: Prop = Prop.NONE
    local: Callable | None = None  # the per-rank meaning of a POINTWISE op
    transport: str | None = None  # the transport operation a communication op starts
    arguments: tuple[Arg, ...] = ()  # what it passes besides its input, in this order
    sent: Callable[[Node, Sizes, int], int] | None = None  # bytes a rank sends (communication)
    comm_cost: CommCost | None = None  # how the cost model predicts it (communication)
    work: Callable[[Node, Sizes, int], Work] | None = None  # local bytes and flops (computation)
    # operands read whole when the op runs chunk by chunk (``overlap``): a matmul's weight,
    # dropout's seed and step; the others are chunked with the chain's rows
    whole_operands: frozenset[int] = frozenset()
    # the vector-Jacobian rule (coconet.ir.adjoints): (node, cotangent, builder) -> one gradient
    # contribution per operand (None where none flows); every op but a leaf and update has one
    vjp: adjoints.Rule | None = None
    # its rule takes a partial cotangent (Local values the ranks' add up to) of its Replicated
    # result as it is: all_gather reduce_scatters it (Megatron's sequence-parallel backward)
    # where an all_reduce and a scatter would move twice the bytes
    vjp_takes_partial: bool = False

    @property
    def rule(self) -> Callable:
        """The typing rule (``coconet.ir.rules``)."""
        return RULES[self.op]

    def has(self, prop: Prop) -> bool:
        return prop in self.props


# -- cost models ----------------------------------------------------------------------------------


def _elementwise_work(node: Node, sizes: Sizes, rank: int) -> Work:
    out = sizes.local_numel(node.type, rank)
    read = sum(sizes.local_bytes(i.type, rank) for i in node.inputs)
    return Work(read, sizes.local_bytes(node.type, rank), out)


def _reduction_work(node: Node, sizes: Sizes, rank: int) -> Work:
    (x,) = node.inputs
    flops = sizes.local_numel(x.type, rank) * (2 if node.op is Op.NORM else 1)
    return Work(sizes.local_bytes(x.type, rank), sizes.local_bytes(node.type, rank), flops)


def _matmul_work(node: Node, sizes: Sizes, rank: int) -> Work:
    a, b = node.inputs
    contracted = sizes.local_shape(a.type, rank)[-1]
    flops = 2 * sizes.local_numel(node.type, rank) * contracted
    read = sizes.local_bytes(a.type, rank) + sizes.local_bytes(b.type, rank)
    return Work(read, sizes.local_bytes(node.type, rank), flops)


def _matmul_tn_work(node: Node, sizes: Sizes, rank: int) -> Work:
    x, y = node.inputs
    rows = sizes.local_numel(x.type, rank) // max(sizes.local_shape(x.type, rank)[-1], 1)
    flops = 2 * sizes.local_numel(node.type, rank) * rows
    read = sizes.local_bytes(x.type, rank) + sizes.local_bytes(y.type, rank)
    return Work(read, sizes.local_bytes(node.type, rank), flops)


def _no_work(node: Node, sizes: Sizes, rank: int) -> Work:
    return Work()


def _ring_sent(passes: int) -> Callable[[Node, Sizes, int], int]:
    """Ring algorithms: each pass sends S - s (S the tensor's bytes, s this rank's slice):
    reduce_scatter and all_gather one pass, all_reduce two."""

    def sent(node: Node, sizes: Sizes, rank: int) -> int:
        axis = node.attr("axis")
        if sizes.mesh.axis_size(axis) == 1:
            return 0
        if node.type.rank == 0:  # a scalar all_reduce: its element out and back
            return 2 * node.type.dtype.itemsize
        if node.op is Op.REDUCE_SCATTER:
            sliced = node.type.layout
        elif node.op is Op.ALL_GATHER:
            sliced = node.inputs[0].type.layout
        else:
            sliced = Sliced(0, axis)
        return passes * (sizes.full_bytes(node.type) - sizes.slice_bytes(node.type, sliced, rank))

    return sent


def _rooted_sent(node: Node, sizes: Sizes, rank: int) -> int:
    """broadcast and reduce forward the whole tensor once (nothing in a group of one)."""
    return sizes.full_bytes(node.type) if sizes.mesh.axis_size(node.attr("axis")) > 1 else 0


def _send_sent(node: Node, sizes: Sizes, rank: int) -> int:
    """A stage sends its own value to the next stage; the last stage sends nothing (reverse:
    to the previous stage; the first sends nothing)."""
    axis = node.attr("axis")
    end = 0 if node.attr("reverse") else sizes.mesh.axis_size(axis) - 1
    return (
        0
        if sizes.mesh.index_in(rank, axis) == end
        else sizes.local_bytes(node.inputs[0].type, rank)
    )


# -- the table ------------------------------------------------------------------------------------

_COMPUTE = Prop.KERNEL | Prop.FRESH | Prop.ROWWISE | Prop.REORDERABLE
_ROUNDS = frozenset({Op.EXP, Op.LOG, Op.GELU, Op.POW, Op.TANH, Op.SIGMOID, Op.ERF, Op.SILU})


def _pointwise(op: Op) -> OpSpec:
    vjp = adjoints.RULES[op]
    if op is Op.CAST:
        # a cast to the same dtype returns its operand: not a fresh tensor
        return OpSpec(op, Lowering.CAST, _COMPUTE & ~Prop.FRESH, work=_elementwise_work, vjp=vjp)
    if op in RANDOM:
        return OpSpec(
            op, Lowering.RANDOM, _COMPUTE, work=_elementwise_work,
            whole_operands=frozenset({1, 2}), vjp=vjp,
        )
    if op is Op.EXPAND_AS:
        # not row-wise: its first operand may be one row spread over every row of the chunk
        props = Prop.KERNEL | Prop.FRESH
        return OpSpec(op, Lowering.POINTWISE, props, semantics.POINTWISE[op],
                      work=_elementwise_work, vjp=vjp)  # fmt: skip
    props = _COMPUTE | (Prop.ROUNDS_PER_KERNEL if op in _ROUNDS else Prop.NONE)
    return OpSpec(
        op, Lowering.POINTWISE, props, semantics.POINTWISE[op], work=_elementwise_work, vjp=vjp
    )


def _shape_op(op: Op) -> OpSpec:
    """unsqueeze and transpose: views (not fresh), that change which elements are rows."""
    return OpSpec(op, Lowering.FUNCTION, Prop.KERNEL, work=_no_work, vjp=adjoints.RULES[op])


def _collective(
    op: Op, *arguments: Arg, cost: CommCost, donate: bool = True, rowwise: bool = True
) -> OpSpec:
    props = Prop.COMMUNICATES | Prop.FRESH | (Prop.ROWWISE if rowwise else Prop.NONE)
    sent = _ring_sent(cost.ring_passes) if cost.traffic is Traffic.RING else _rooted_sent
    return OpSpec(
        op,
        Lowering.COLLECTIVE,
        props,
        transport=op.value,
        arguments=(*arguments, Arg.AXIS, *((Arg.DONATE,) if donate else ())),
        sent=sent,
        comm_cost=cost,
        work=_no_work,
        vjp=adjoints.RULES[op],
    )


_ROOTED = CommCost(CurveBytes.INPUT, Traffic.ROOTED)


SPECS: dict[Op, OpSpec] = {
    Op.INPUT: OpSpec(Op.INPUT, Lowering.LEAF),
    Op.CONST: OpSpec(Op.CONST, Lowering.LEAF),
    # computed once at the start of the step, from the bound sizes and the mesh, like an input
    Op.SIZE: OpSpec(Op.SIZE, Lowering.SIZE, work=_no_work),
    Op.WORLD_SIZE: OpSpec(Op.WORLD_SIZE, Lowering.SIZE, work=_no_work),
    Op.AXIS_INDEX: OpSpec(Op.AXIS_INDEX, Lowering.SIZE, work=_no_work),
    **{op: _pointwise(op) for op in UNARY | BINARY | {Op.WHERE, Op.EXPAND_AS}},
    **{op: _shape_op(op) for op in (Op.UNSQUEEZE, Op.TRANSPOSE)},
    **{
        op: OpSpec(
            op,
            Lowering.REDUCTION,
            _COMPUTE | (Prop.REASSOCIATES if op is not Op.MAX else Prop.NONE),
            work=_reduction_work,
            vjp=adjoints.RULES[op],
        )
        for op in (Op.SUM, Op.MAX, Op.NORM)
    },
    # Not reorderable: a matmul's operands are sliced by its own layout rules, not by reorder.
    Op.MATMUL: OpSpec(
        Op.MATMUL,
        Lowering.MATMUL,
        Prop.KERNEL | Prop.FRESH | Prop.ROWWISE | Prop.REASSOCIATES,
        work=_matmul_work,
        whole_operands=frozenset({1}),
        vjp=adjoints.RULES[Op.MATMUL],
    ),
    # contracts the rows: neither row-wise nor reorderable
    Op.MATMUL_TN: OpSpec(
        Op.MATMUL_TN,
        Lowering.FUNCTION,
        Prop.KERNEL | Prop.FRESH | Prop.REASSOCIATES,
        work=_matmul_tn_work,
        vjp=adjoints.RULES[Op.MATMUL_TN],
    ),
    Op.ALL_REDUCE: _collective(
        Op.ALL_REDUCE, Arg.REDUCE_OP, cost=CommCost(CurveBytes.INPUT, Traffic.RING, 2, True)
    ),
    Op.REDUCE_SCATTER: _collective(
        Op.REDUCE_SCATTER,
        Arg.REDUCE_OP,
        Arg.DIM,
        cost=CommCost(CurveBytes.INPUT, Traffic.RING, 1, True),
    ),
    # an all_gather's input is a slice it copies from: never donated
    Op.ALL_GATHER: replace(
        _collective(
            Op.ALL_GATHER, Arg.GATHER_DIM, cost=CommCost(CurveBytes.OUTPUT, Traffic.RING, 1),
            donate=False,
        ),
        vjp_takes_partial=True,
    ),
    Op.BROADCAST: _collective(Op.BROADCAST, Arg.ROOT, cost=_ROOTED),
    # reduce leaves zeros on the other ranks: not row-wise for overlap
    Op.REDUCE: _collective(Op.REDUCE, Arg.REDUCE_OP, Arg.ROOT, cost=_ROOTED, rowwise=False),
    Op.SEND: OpSpec(
        Op.SEND,
        Lowering.POINT_TO_POINT,
        Prop.COMMUNICATES | Prop.FRESH | Prop.ROWWISE | Prop.REORDERABLE,
        transport="send",
        arguments=(Arg.AXIS, Arg.REVERSE),
        sent=_send_sent,
        comm_cost=CommCost(CurveBytes.OWN, Traffic.POINT_TO_POINT),
        work=_no_work,
        vjp=adjoints.RULES[Op.SEND],
    ),
    Op.SCATTER: OpSpec(
        Op.SCATTER, Lowering.SCATTER, Prop.ROWWISE, work=_no_work, vjp=adjoints.RULES[Op.SCATTER]
    ),
    Op.UPDATE: OpSpec(Op.UPDATE, Lowering.UPDATE),
}


def spec(op: Op) -> OpSpec:
    """The spec of ``op``."""
    return SPECS[op]


def ops_with(prop: Prop) -> frozenset[Op]:
    """Every op that has ``prop``."""
    return frozenset(op for op, s in SPECS.items() if prop in s.props)


def missing_parts() -> list[str]:
    """What each op lacks, as sentences (empty when every op is complete)."""
    problems = [f"{op} has no OpSpec" for op in Op if op not in SPECS]
    for op, s in SPECS.items():
        if s.op is not op:
            problems.append(f"SPECS[{op}] describes {s.op}")
        if op not in RULES:
            problems.append(f"{op} has no typing rule (coconet.ir.rules.RULES)")
        if op not in LEAVES and op is not Op.UPDATE and s.vjp is None:
            problems.append(f"{op} has no vector-Jacobian rule (coconet.ir.adjoints.RULES)")
        if s.lowering is Lowering.FUNCTION and op not in semantics.FUNCTIONS:
            problems.append(f"{op} has no local meaning (coconet.ir.semantics.FUNCTIONS)")
        if s.lowering is Lowering.POINTWISE and s.local is None:
            problems.append(f"{op} has no local meaning (coconet.ir.semantics.POINTWISE)")
        if s.lowering is Lowering.COLLECTIVE and op not in semantics.COLLECTIVES:
            problems.append(f"{op} has no group meaning (coconet.ir.semantics.COLLECTIVES)")
        if s.has(Prop.COMMUNICATES) and (s.transport is None or s.sent is None):
            problems.append(f"{op} communicates but names no transport operation or bytes model")
        if s.has(Prop.COMMUNICATES) and s.comm_cost is None:
            problems.append(f"{op} communicates but has no cost model (CommCost)")
        ring = s.comm_cost is not None and s.comm_cost.traffic is Traffic.RING
        if ring and s.comm_cost.ring_passes < 1:
            problems.append(f"{op} is a ring collective without its number of ring passes")
        if s.lowering not in (Lowering.LEAF, Lowering.UPDATE) and s.work is None:
            problems.append(f"{op} has no work model (bytes and flops)")
    return problems


_problems = missing_parts()  # checked at import: an incomplete op never gets as far as a test
if _problems:  # pragma: no cover - an incomplete op is a bug in coconet itself
    raise ImportError("incomplete op specs: " + "; ".join(_problems))
