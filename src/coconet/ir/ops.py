"""The op enum of the IR, its named groups, and the reduction operators of collectives."""

from __future__ import annotations

import enum

__all__ = [
    "BINARY",
    "COLLECTIVES",
    "COMMUNICATION",
    "COMPARISONS",
    "COMPUTATION",
    "LEAVES",
    "POINTWISE",
    "REDUCTIONS",
    "SHAPES",
    "SIZES",
    "UNARY",
    "Op",
    "ReduceOp",
]


class Op(enum.Enum):
    # Members are singletons compared by identity, so they hash by identity: Enum's own hash
    # (of the member's name, in Python) made every op-keyed lookup ~3x slower, and a small
    # step makes dozens (str hashes differ between processes anyway: nothing relies on them)
    __hash__ = object.__hash__

    # leaves
    INPUT = "input"
    CONST = "const"
    # sizes known when the step runs, as 0-d values: a product of Dims, a mesh axis's rank count
    SIZE = "size"
    WORLD_SIZE = "world_size"
    # this rank's index along a mesh axis, as a 0-d value (Local: it differs between ranks)
    AXIS_INDEX = "axis_index"
    # pointwise, one operand
    NEG = "neg"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    EXP = "exp"
    LOG = "log"
    ABS = "abs"
    RELU = "relu"
    GELU = "gelu"
    SIGN = "sign"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    ERF = "erf"
    SILU = "silu"
    CAST = "cast"
    DROPOUT = "dropout"  # operands: x, seed, step (the mask is keyed by seed, step, element index)
    # operands: x (float32), seed, step; attr dtype (bfloat16): x rounded to dtype up or down at
    # random, with the probabilities of its distance to each (keyed as dropout's mask)
    ROUND_STOCHASTIC = "round_stochastic"
    # pointwise, two operands
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    POW = "pow"
    MAXIMUM = "maximum"
    MINIMUM = "minimum"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    # pointwise, three operands (CoCoNet's Ite)
    WHERE = "where"
    # the first operand broadcast to the second's shape (the second's values are not read): how
    # a gradient spreads a reduced value back over what was reduced
    EXPAND_AS = "expand_as"
    # shape ops with static attributes (their gradients need them): a size-1 dim inserted at
    # ``dim``; a matrix transposed
    UNSQUEEZE = "unsqueeze"
    TRANSPOSE = "transpose"
    # reductions over all elements or one dim
    SUM = "sum"
    MAX = "max"
    NORM = "norm"
    MATMUL = "matmul"
    # x[..., K] transposed times y[..., N], summed over every leading dim: [K, N] (the gradient
    # of a matmul's weight; x.reshape(-1, K).T @ y.reshape(-1, N))
    MATMUL_TN = "matmul_tn"
    # communication
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SEND = "send"  # point-to-point along a mesh axis: stage i receives stage i-1's value
    # this rank's slice of a replicated value (no communication)
    SCATTER = "scatter"
    # the new value of an input tensor, applied when the whole step has succeeded
    UPDATE = "update"

    def __str__(self) -> str:
        return self.value


class ReduceOp(enum.Enum):
    __hash__ = object.__hash__  # as Op's

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    # The DSL's collectives take MEAN and build the SUM collective divided by the group's size
    # (``world_size(axis)``); IR nodes carry only the four above, which every transport has.
    MEAN = "mean"

    def __str__(self) -> str:
        return self.value


SIZES = frozenset({Op.SIZE, Op.WORLD_SIZE, Op.AXIS_INDEX})
LEAVES = frozenset({Op.INPUT, Op.CONST}) | SIZES
UNARY = frozenset(
    {Op.NEG, Op.SQRT, Op.RSQRT, Op.EXP, Op.LOG, Op.ABS, Op.RELU, Op.GELU, Op.CAST, Op.DROPOUT}
    | {Op.SIGN, Op.TANH, Op.SIGMOID, Op.ERF, Op.SILU, Op.ROUND_STOCHASTIC}
)
# counter-based randomness (operands: x, seed, step): its value depends on the element's place
# in the whole tensor, so every slice, chunk and rank draws the same bits
RANDOM = frozenset({Op.DROPOUT, Op.ROUND_STOCHASTIC})
COMPARISONS = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MAXIMUM, Op.MINIMUM}) | COMPARISONS
POINTWISE = UNARY | BINARY | {Op.WHERE, Op.EXPAND_AS}
SHAPES = frozenset({Op.UNSQUEEZE, Op.TRANSPOSE})
REDUCTIONS = frozenset({Op.SUM, Op.MAX, Op.NORM})
COMPUTATION = POINTWISE | SHAPES | REDUCTIONS | {Op.MATMUL, Op.MATMUL_TN}
COLLECTIVES = frozenset({Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER, Op.BROADCAST, Op.REDUCE})
COMMUNICATION = COLLECTIVES | {Op.SEND}
