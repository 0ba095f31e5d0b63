"""Table-driven typing rules: dtype, global shape and layout of every op's result.

One table of legal programs (op builder -> expected result type) and one of illegal ones
(op builder -> expected error class and a fragment of its message).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import coconet as cc
from coconet import (
    Dim,
    Local,
    ReduceOp,
    Replicated,
    Scalar,
    Sliced,
    Tensor,
    bfloat16,
    float16,
    float32,
    int32,
    int64,
)
from coconet.ir.types import DType, Layout, TensorType

N, M, B, H, K = Dim("N"), Dim("M"), Dim("B"), Dim("H"), Dim("K")
BOOL = DType.bool


def T(name: str, shape, layout: Layout = Replicated, dtype: DType = float32) -> Tensor:  # noqa: N802
    return Tensor(name, dtype, shape, layout)


def ty(dtype: DType, shape, layout: Layout) -> TensorType:
    return TensorType(dtype, tuple(shape), layout)


def _cond(layout: Layout = Replicated) -> Tensor:
    return cc.gt(T("c", [N], layout), 0.0)


# (id, builder, expected type)
LEGAL: list[tuple[str, Callable[[], Tensor], TensorType]] = [
    # -- pointwise: layouts ---------------------------------------------------------------------
    ("local+local", lambda: T("a", [N], Local) + T("b", [N], Local), ty(float32, [N], Local)),
    (
        "local+replicated",
        lambda: T("a", [N], Local) * T("b", [N], Replicated),
        ty(float32, [N], Local),
    ),
    (
        "replicated+replicated",
        lambda: T("a", [N]) - T("b", [N]),
        ty(float32, [N], Replicated),
    ),
    (
        "replicated(tp)+replicated",
        lambda: T("a", [N], Replicated("tp")) + T("b", [N]),
        ty(float32, [N], Replicated("tp")),
    ),
    (
        "replicated(tp)+replicated(pp) differs between ranks",
        lambda: T("a", [N], Replicated("tp")) + T("b", [N], Replicated("pp")),
        ty(float32, [N], Local),
    ),
    (
        "sliced+sliced",
        lambda: T("a", [N, M], Sliced(1)) / T("b", [N, M], Sliced(1)),
        ty(float32, [N, M], Sliced(1)),
    ),
    (
        "sliced(tp)+sliced(tp)",
        lambda: T("a", [N], Sliced(0, "tp")) + T("b", [N], Sliced(0, "tp")),
        ty(float32, [N], Sliced(0, "tp")),
    ),
    ("sliced+python scalar", lambda: T("a", [N], Sliced(0)) * 2.0, ty(float32, [N], Sliced(0))),
    ("python scalar-sliced", lambda: 1 - T("a", [N], Sliced(0)), ty(float32, [N], Sliced(0))),
    (
        "sliced+Scalar input",
        lambda: T("a", [N], Sliced(0)) * Scalar("lr"),
        ty(float32, [N], Sliced(0)),
    ),
    (
        "sliced(0)[B,H]+replicated bias[H]",
        lambda: T("x", [B, H], Sliced(0)) + T("bias", [H]),
        ty(float32, [B, H], Sliced(0)),
    ),
    (
        "sliced(1)[B,H]+replicated column[B,1]",
        lambda: T("x", [B, H], Sliced(1)) + T("col", [B, 1]),
        ty(float32, [B, H], Sliced(1)),
    ),
    (
        "sliced rank-1 operand broadcast to rank 2 keeps its dim",
        lambda: T("v", [H], Sliced(0)) * T("col", [B, 1]),
        ty(float32, [B, H], Sliced(1)),
    ),
    # -- the ops of issue 12: keep the layout; sign also takes ints; sizes are Replicated --------
    ("sign of int64", lambda: cc.sign(T("i", [N], Local, cc.int64)), ty(cc.int64, [N], Local)),
    ("tanh of sliced", lambda: cc.tanh(T("a", [N], Sliced(0))), ty(float32, [N], Sliced(0))),
    ("sigmoid of local", lambda: cc.sigmoid(T("a", [N], Local)), ty(float32, [N], Local)),
    ("erf", lambda: cc.erf(T("a", [N, M])), ty(float32, [N, M], Replicated)),
    ("silu of bf16", lambda: cc.silu(T("a", [N], dtype=cc.bfloat16)),
     ty(cc.bfloat16, [N], Replicated)),
    ("sliced / its Dim", lambda: T("a", [N], Sliced(0)) / N, ty(float32, [N], Sliced(0))),
    ("mean over the sliced dim: a partial", lambda: cc.mean(T("a", [N, M], Sliced(0)), 0),
     ty(float32, [M], Local)),
    ("mean over another dim stays sliced", lambda: cc.mean(T("a", [N, M], Sliced(0)), 1, True),
     ty(float32, [N, 1], Sliced(0))),
    ("world_size", lambda: cc.world_size("tp"), ty(float32, [], Replicated)),
    ("all_reduce MEAN", lambda: cc.all_reduce(T("g", [N], Local), cc.ReduceOp.MEAN),
     ty(float32, [N], Replicated)),
    ("reduce_scatter MEAN over tp",
     lambda: cc.reduce_scatter(T("g", [N], Local), cc.ReduceOp.MEAN, axis="tp"),
     ty(float32, [N], Sliced(0, "tp"))),
    ("clamp both", lambda: cc.clamp(T("a", [N], Local), -1.0, 1.0), ty(float32, [N], Local)),
    # -- pointwise: broadcasting with Dims ------------------------------------------------------
    (
        "broadcast [N,1]+[1,M]",
        lambda: T("a", [N, 1]) + T("b", [1, M]),
        ty(float32, [N, M], Replicated),
    ),
    (
        "broadcast [N,M]+[M]",
        lambda: T("a", [N, M], Local) + T("b", [M]),
        ty(float32, [N, M], Local),
    ),
    (
        "broadcast ints [4,1]*[3]",
        lambda: T("a", [4, 1]) * T("b", [3]),
        ty(float32, [4, 3], Replicated),
    ),
    # -- pointwise: dtypes ----------------------------------------------------------------------
    (
        "float16 tensor * float32 Scalar keeps float16",
        lambda: T("h", [N], dtype=float16) * Scalar("lr"),
        ty(float16, [N], Replicated),
    ),
    (
        "bfloat16 + python float",
        lambda: T("h", [N], Local, bfloat16) + 0.5,
        ty(bfloat16, [N], Local),
    ),
    ("int32 + python int", lambda: T("i", [N], dtype=int32) + 1, ty(int32, [N], Replicated)),
    ("int64 maximum", lambda: cc.maximum(T("i", [N], dtype=int64), 0), ty(int64, [N], Replicated)),
    ("unary neg", lambda: -T("a", [N], Sliced(0)), ty(float32, [N], Sliced(0))),
    ("unary sqrt", lambda: cc.sqrt(T("a", [N], Local)), ty(float32, [N], Local)),
    ("unary rsqrt", lambda: cc.rsqrt(T("a", [N])), ty(float32, [N], Replicated)),
    ("unary exp f16", lambda: cc.exp(T("a", [N], dtype=float16)), ty(float16, [N], Replicated)),
    ("unary log", lambda: cc.log(T("a", [N])), ty(float32, [N], Replicated)),
    ("unary abs int", lambda: cc.abs(T("a", [N], dtype=int32)), ty(int32, [N], Replicated)),
    ("unary relu", lambda: cc.relu(T("a", [B, H], Sliced(1))), ty(float32, [B, H], Sliced(1))),
    ("unary gelu", lambda: cc.gelu(T("a", [B, H], Local)), ty(float32, [B, H], Local)),
    ("pow", lambda: cc.pow(T("a", [N], Local), 2.0), ty(float32, [N], Local)),
    ("minimum", lambda: cc.minimum(T("a", [N]), T("b", [N])), ty(float32, [N], Replicated)),
    # -- cast -----------------------------------------------------------------------------------
    (
        "cast f32 -> bf16 keeps layout",
        lambda: cc.cast(T("a", [N, M], Sliced(1)), bfloat16),
        ty(bfloat16, [N, M], Sliced(1)),
    ),
    (
        "cast bool -> int32",
        lambda: cc.cast(_cond(), int32),
        ty(int32, [N], Replicated),
    ),
    # -- comparisons -> bool --------------------------------------------------------------------
    ("lt", lambda: cc.lt(T("a", [N], Local), 0.0), ty(BOOL, [N], Local)),
    ("le", lambda: cc.le(T("a", [N]), T("b", [N])), ty(BOOL, [N], Replicated)),
    ("gt operator", lambda: T("a", [N], Sliced(0)) > 1.0, ty(BOOL, [N], Sliced(0))),
    ("ge operator", lambda: T("a", [N], dtype=int32) >= 3, ty(BOOL, [N], Replicated)),
    ("eq", lambda: cc.eq(T("a", [N, 1]), T("b", [M])), ty(BOOL, [N, M], Replicated)),
    ("ne", lambda: cc.ne(T("a", [N], Local), T("b", [N])), ty(BOOL, [N], Local)),
    # -- where ----------------------------------------------------------------------------------
    (
        "where(cond, tensor, scalar)",
        lambda: cc.where(_cond(), T("a", [N]), 0.0),
        ty(float32, [N], Replicated),
    ),
    (
        "where with a Local branch is Local",
        lambda: cc.where(_cond(), T("a", [N], Local), T("b", [N])),
        ty(float32, [N], Local),
    ),
    (
        "where on slices",
        lambda: cc.where(_cond(Sliced(0)), T("a", [N], Sliced(0)), 1.0),
        ty(float32, [N], Sliced(0)),
    ),
    (
        "where of two python numbers takes the condition's shape",
        lambda: cc.where(_cond(Local), 1.0, 0.0),
        ty(float32, [N], Local),
    ),
    # -- dropout --------------------------------------------------------------------------------
    (
        "dropout keeps the type",
        lambda: cc.dropout(T("a", [B, H], Sliced(0)), 0.1, seed=3, step=Scalar("step", int64)),
        ty(float32, [B, H], Sliced(0)),
    ),
    (
        "dropout f16 with int32 seed",
        lambda: cc.dropout(T("a", [N], Local, float16), 0.5, seed=Scalar("seed", int32)),
        ty(float16, [N], Local),
    ),
    # -- stochastic rounding ---------------------------------------------------------------------
    (
        "round_stochastic to bfloat16 keeps the layout",
        lambda: cc.round_stochastic(T("a", [B, H], Sliced(0)), cc.bfloat16, seed=3,
                                    step=Scalar("step", int64)),
        ty(cc.bfloat16, [B, H], Sliced(0)),
    ),
    # -- reductions -----------------------------------------------------------------------------
    ("sum all of Replicated", lambda: cc.sum(T("a", [N, M])), ty(float32, [], Replicated)),
    ("sum all of Local", lambda: T("a", [N, M], Local).sum(), ty(float32, [], Local)),
    ("sum dim 1", lambda: cc.sum(T("a", [N, M]), 1), ty(float32, [N], Replicated)),
    (
        "sum dim -1 keepdim",
        lambda: cc.sum(T("a", [N, M]), -1, True),
        ty(float32, [N, 1], Replicated),
    ),
    (
        "sum all keepdim",
        lambda: cc.sum(T("a", [N, M]), keepdim=True),
        ty(float32, [1, 1], Replicated),
    ),
    (
        "sum all of Sliced -> Local partial",
        lambda: cc.sum(T("a", [N], Sliced(0))),
        ty(float32, [], Local),
    ),
    (
        "sum over the sliced dim -> Local partials",
        lambda: cc.sum(T("a", [N, M], Sliced(0)), 0),
        ty(float32, [M], Local),
    ),
    (
        "sum over the sliced dim keepdim -> Local partials",
        lambda: cc.sum(T("a", [N, M], Sliced(1)), 1, keepdim=True),
        ty(float32, [N, 1], Local),
    ),
    (
        "sum over a dim before the sliced one shifts it",
        lambda: cc.sum(T("a", [B, N, M], Sliced(1)), 0),
        ty(float32, [N, M], Sliced(0)),
    ),
    (
        "sum over a dim before the sliced one, keepdim",
        lambda: cc.sum(T("a", [B, N, M], Sliced(1)), 0, keepdim=True),
        ty(float32, [1, N, M], Sliced(1)),
    ),
    (
        "sum over a dim after the sliced one",
        lambda: cc.sum(T("a", [B, N, M], Sliced(1, "tp")), 2),
        ty(float32, [B, N], Sliced(1, "tp")),
    ),
    ("max over the sliced dim", lambda: cc.max(T("a", [N], Sliced(0)), 0), ty(float32, [], Local)),
    ("max int", lambda: T("a", [N, M], dtype=int64).max(1), ty(int64, [N], Replicated)),
    ("norm all", lambda: cc.norm(T("a", [N, M], Local)), ty(float32, [], Local)),
    (
        "norm over a non-sliced dim",
        lambda: cc.norm(T("a", [N, M], Sliced(0)), 1),
        ty(float32, [N], Sliced(0)),
    ),
    # -- matmul ---------------------------------------------------------------------------------
    (
        "row-parallel: Sliced(last) @ Sliced(0) -> Local partial sums",
        lambda: T("x", [B, K], Sliced(1)) @ T("w", [K, N], Sliced(0)),
        ty(float32, [B, N], Local),
    ),
    (
        "row-parallel 3-d x",
        lambda: T("x", [B, M, K], Sliced(2, "tp")) @ T("w", [K, N], Sliced(0, "tp")),
        ty(float32, [B, M, N], Local),
    ),
    (
        "Sliced(0) @ Replicated -> Sliced(0)",
        lambda: T("x", [B, K], Sliced(0)) @ T("w", [K, N]),
        ty(float32, [B, N], Sliced(0)),
    ),
    (
        "column-parallel: Replicated @ Sliced(1) -> Sliced(last)",
        lambda: cc.matmul(T("x", [B, M, K]), T("w", [K, N], Sliced(1))),
        ty(float32, [B, M, N], Sliced(2)),
    ),
    (
        "Replicated @ Replicated",
        lambda: T("x", [B, K]) @ T("w", [K, N]),
        ty(float32, [B, N], Replicated),
    ),
    (
        "Local @ Replicated",
        lambda: T("x", [B, K], Local) @ T("w", [K, N]),
        ty(float32, [B, N], Local),
    ),
    ("vector @ matrix", lambda: T("x", [K]) @ T("w", [K, N]), ty(float32, [N], Replicated)),
    (
        "bf16 matmul",
        lambda: T("x", [B, K], dtype=bfloat16) @ T("w", [K, N], dtype=bfloat16),
        ty(bfloat16, [B, N], Replicated),
    ),
    # -- collectives ----------------------------------------------------------------------------
    ("all_reduce", lambda: cc.all_reduce(T("g", [N], Local)), ty(float32, [N], Replicated)),
    (
        "all_reduce max over tp",
        lambda: cc.all_reduce(T("g", [N], Local), ReduceOp.MAX, axis="tp"),
        ty(float32, [N], Replicated("tp")),
    ),
    (
        "all_reduce of an int scalar",
        lambda: cc.all_reduce(T("g", [], Local, int64), ReduceOp.MIN),
        ty(int64, [], Replicated),
    ),
    (
        "reduce_scatter",
        lambda: cc.reduce_scatter(T("g", [N, M], Local)),
        ty(float32, [N, M], Sliced(0)),
    ),
    (
        "reduce_scatter dim=1",
        lambda: cc.reduce_scatter(T("g", [N, M], Local), dim=1),
        ty(float32, [N, M], Sliced(1)),
    ),
    (
        "reduce_scatter dim=-1 over dp",
        lambda: cc.reduce_scatter(T("g", [N, M], Local), ReduceOp.PROD, axis="dp", dim=-1),
        ty(float32, [N, M], Sliced(1, "dp")),
    ),
    (
        "all_gather",
        lambda: cc.all_gather(T("s", [N, M], Sliced(1))),
        ty(float32, [N, M], Replicated),
    ),
    (
        "all_gather takes the tensor's axis",
        lambda: cc.all_gather(T("s", [N], Sliced(0, "tp"))),
        ty(float32, [N], Replicated("tp")),
    ),
    ("broadcast", lambda: cc.broadcast(T("x", [N], Local), root=1), ty(float32, [N], Replicated)),
    (
        "broadcast over pp",
        lambda: cc.broadcast(T("x", [N], Local, float16), axis="pp"),
        ty(float16, [N], Replicated("pp")),
    ),
    ("reduce keeps Local", lambda: cc.reduce(T("x", [N], Local), root=1), ty(float32, [N], Local)),
    (
        "send Local along pp on a pp x tp mesh",
        lambda: cc.send(T("x", [B, H], Local), axis="pp"),
        ty(float32, [B, H], Local),
    ),
    (
        "send Replicated(tp) along pp",
        lambda: cc.send(T("x", [B, H], Replicated("tp")), axis="pp"),
        ty(float32, [B, H], Replicated("tp")),
    ),
    (
        "send Sliced(tp) along pp",
        lambda: cc.send(T("x", [B, H], Sliced(1, "tp")), axis="pp"),
        ty(float32, [B, H], Sliced(1, "tp")),
    ),
    ("scatter", lambda: cc.scatter(T("x", [N, M])), ty(float32, [N, M], Sliced(0))),
    ("scatter dim=-1", lambda: cc.scatter(T("x", [N, M]), dim=-1), ty(float32, [N, M], Sliced(1))),
    (
        "scatter over tp of a tp-replicated value",
        lambda: cc.scatter(T("x", [N], Replicated("tp")), axis="tp"),
        ty(float32, [N], Sliced(0, "tp")),
    ),
    (
        "scatter over tp of a world-replicated value",
        lambda: cc.scatter(T("x", [N]), axis="tp"),
        ty(float32, [N], Sliced(0, "tp")),
    ),
    # -- the ops gradients are made of ----------------------------------------------------------
    (
        "matmul_tn of row-sliced operands: partial sums",
        lambda: cc.matmul_tn(T("x", [B, K], Sliced(0)), T("y", [B, N], Sliced(0))),
        ty(float32, [K, N], Local),
    ),
    (
        "matmul_tn column-parallel",
        lambda: cc.matmul_tn(T("x", [B, M, K]), T("y", [B, M, N], Sliced(2))),
        ty(float32, [K, N], Sliced(1)),
    ),
    (
        "matmul_tn row-parallel",
        lambda: cc.matmul_tn(T("x", [B, K], Sliced(1, "tp")), T("y", [B, N], Replicated("tp"))),
        ty(float32, [K, N], Sliced(0, "tp")),
    ),
    (
        "matmul_tn Local",
        lambda: cc.matmul_tn(T("x", [B, K], Local), T("y", [B, N])),
        ty(float32, [K, N], Local),
    ),
    ("transpose", lambda: cc.transpose(T("w", [K, N], Sliced(1))), ty(float32, [N, K], Sliced(0))),
    (
        "unsqueeze moves the sliced dim",
        lambda: cc.unsqueeze(T("x", [B, N], Sliced(1)), 0),
        ty(float32, [1, B, N], Sliced(2)),
    ),
    (
        "unsqueeze after the sliced dim",
        lambda: cc.unsqueeze(T("x", [B, N], Sliced(0)), -1),
        ty(float32, [B, N, 1], Sliced(0)),
    ),
    (
        "expand_as a Local partial over a Sliced part",
        lambda: cc.expand_as(T("c", [B, 1], Local), T("x", [B, N], Sliced(1))),
        ty(float32, [B, N], Sliced(1)),
    ),
    (
        "expand_as a constant",
        lambda: cc.expand_as(0.0, T("x", [B, N], Local)),
        ty(float32, [B, N], Local),
    ),
    ("axis_index", lambda: cc.axis_index("tp") + 1, ty(int64, [], Local)),
    # -- update ---------------------------------------------------------------------------------
    (
        "update Replicated",
        lambda: cc.update(T("p", [N]), T("q", [N]) * 2.0),
        ty(float32, [N], Replicated),
    ),
    (
        "update Sliced",
        lambda: cc.update(T("p", [N], Sliced(0)), T("q", [N], Sliced(0))),
        ty(float32, [N], Sliced(0)),
    ),
    (
        "update Local with Replicated",
        lambda: cc.update(T("p", [N], Local), T("q", [N])),
        ty(float32, [N], Local),
    ),
    (
        "update with a constant",
        lambda: cc.update(T("p", [N, M]), 0.0),
        ty(float32, [N, M], Replicated),
    ),
    (
        "update a Sliced tensor with a constant",
        lambda: cc.update(T("p", [N], Sliced(0)), 0.0),
        ty(float32, [N], Sliced(0)),
    ),
    (
        "update a Sliced tensor with a bias along another dim",
        lambda: cc.update(T("p", [B, H], Sliced(0)), T("bias", [H])),
        ty(float32, [B, H], Sliced(0)),
    ),
    (
        "update a tp-Replicated tensor with a world-Replicated value",
        lambda: cc.update(T("p", [N], Replicated("tp")), T("q", [N])),
        ty(float32, [N], Replicated("tp")),
    ),
    (
        "update broadcasts the value",
        lambda: cc.update(T("p", [N, M], Local), T("q", [M], Local)),
        ty(float32, [N, M], Local),
    ),
    ("update int", lambda: cc.update(T("p", [N], dtype=int64), 0), ty(int64, [N], Replicated)),
]


@pytest.mark.parametrize(("build", "expected"), [c[1:] for c in LEGAL], ids=[c[0] for c in LEGAL])
def test_legal(build, expected):
    result = build()
    assert result.type == expected
    assert str(result.type) == str(expected)


def test_legal_table_covers_every_op():
    from coconet.ir.ops import LEAVES, Op

    seen = set()
    for _, build, _ in LEGAL:
        stack = [build().node]
        while stack:
            n = stack.pop()
            seen.add(n.op)
            stack.extend(n.inputs)
    assert set(Op) - LEAVES - seen == set()


# (id, builder, error class, a fragment of the message)
ILLEGAL: list[tuple[str, Callable[[], object], type, str]] = [
    ("tanh of an int", lambda: cc.tanh(T("i", [N], dtype=cc.int32)), cc.DTypeError,
     "tanh needs a floating-point operand, got int32"),
    ("sign of a bool", lambda: cc.sign(T("a", [N]) > 0.0), cc.DTypeError,
     "sign does not take bool operands"),
    ("mean of an int", lambda: cc.mean(T("i", [N], dtype=cc.int64)), cc.DTypeError,
     "mean needs a floating-point tensor, got int64"),
    ("mean over a dim out of range", lambda: cc.mean(T("a", [N]), 2), cc.ShapeError,
     "reduction dim 2 is out of range"),
    ("all_reduce MEAN of ints", lambda: cc.all_reduce(T("i", [N], Local, cc.int64),
     cc.ReduceOp.MEAN), cc.DTypeError, "ReduceOp.MEAN needs a floating-point tensor"),
    ("clamp without bounds", lambda: cc.clamp(T("a", [N])), cc.DSLError,
     "clamp needs a min, a max or both"),
    ("world_size of a bad axis", lambda: cc.world_size(3), cc.DSLError,
     "axis must be a mesh axis name or None, got 3"),
    (
        "local+sliced",
        lambda: T("a", [N], Local) + T("b", [N], Sliced(0)),
        cc.LayoutError,
        "cannot combine a Local operand",
    ),
    (
        "replicated spanning the sliced dim + sliced",
        lambda: T("a", [N]) * T("b", [N], Sliced(0)),
        cc.LayoutError,
        "scatter(...)",
    ),
    (
        "replicated column [B,1] + sliced(0) [B,H]",
        lambda: T("x", [B, H], Sliced(0)) + T("col", [B, 1]),
        cc.LayoutError,
        "cannot combine a Replicated operand",
    ),
    (
        "replicated(pp) + sliced(tp)",
        lambda: T("a", [], Replicated("pp")) + T("b", [N], Sliced(0, "tp")),
        cc.LayoutError,
        "cannot combine a Replicated operand",
    ),
    (
        "sliced on different dims",
        lambda: T("a", [N, M], Sliced(0)) + T("b", [N, M], Sliced(1)),
        cc.LayoutError,
        "sliced differently: Sliced(dim=0) vs Sliced(dim=1)",
    ),
    (
        "sliced on different axes",
        lambda: T("a", [N], Sliced(0, "tp")) + T("b", [N], Sliced(0, "dp")),
        cc.LayoutError,
        "sliced differently",
    ),
    (
        "sliced operand broadcast along its sliced dim",
        lambda: T("a", [1, H], Sliced(0)) + T("b", [B, H]),
        cc.ShapeError,
        "broadcast along its sliced dim 0",
    ),
    ("different Dims", lambda: T("a", [N]) + T("b", [M]), cc.ShapeError, "[N] vs [M]"),
    ("different ints", lambda: T("a", [3]) + T("b", [4]), cc.ShapeError, "[3] vs [4]"),
    (
        "f16 + f32",
        lambda: T("a", [N], dtype=float16) + T("b", [N]),
        cc.DTypeError,
        "float16, float32",
    ),
    ("int + float constant", lambda: T("a", [N], dtype=int32) + 0.5, cc.DTypeError, "is a float"),
    ("int + float Scalar", lambda: T("a", [N], dtype=int32) * Scalar("lr"), cc.DTypeError, "mix"),
    ("sqrt of int", lambda: cc.sqrt(T("a", [N], dtype=int64)), cc.DTypeError, "floating-point"),
    (
        "div of ints",
        lambda: T("a", [N], dtype=int32) / T("b", [N], dtype=int32),
        cc.DTypeError,
        "div",
    ),
    ("neg of bool", lambda: -_cond(), cc.DTypeError, "bool"),
    ("sum of bool", lambda: cc.sum(_cond()), cc.DTypeError, "cannot sum bool"),
    ("where on a float condition", lambda: cc.where(T("c", [N]), 1.0, 0.0), cc.DTypeError, "bool"),
    (
        "where with Local cond and Sliced branch",
        lambda: cc.where(_cond(Local), T("a", [N], Sliced(0)), 0.0),
        cc.LayoutError,
        "Local",
    ),
    ("dropout p=1", lambda: cc.dropout(T("a", [N]), 1.0), cc.DSLError, "p=1.0"),
    ("dropout p<0", lambda: cc.dropout(T("a", [N]), -0.1), cc.DSLError, "not in [0, 1)"),
    (
        "dropout of ints",
        lambda: cc.dropout(T("a", [N], dtype=int32), 0.1),
        cc.DTypeError,
        "floating",
    ),
    (
        "dropout float seed",
        lambda: cc.dropout(T("a", [N]), 0.1, seed=Scalar("seed")),
        cc.DTypeError,
        "integer scalar",
    ),
    (
        "dropout Local step",
        lambda: cc.dropout(T("a", [N]), 0.1, step=T("step", [], Local, int64)),
        cc.LayoutError,
        "must be Replicated",
    ),
    (
        "round_stochastic to float16",
        lambda: cc.round_stochastic(T("a", [N]), cc.float16),
        cc.DTypeError,
        "rounds float32 to bfloat16, got float32 to float16",
    ),
    (
        "round_stochastic of bfloat16",
        lambda: cc.round_stochastic(T("a", [N], dtype=cc.bfloat16), cc.bfloat16),
        cc.DTypeError,
        "got bfloat16 to bfloat16",
    ),
    (
        "round_stochastic Local seed",
        lambda: cc.round_stochastic(T("a", [N]), cc.bfloat16, seed=T("s", [], Local, int64)),
        cc.LayoutError,
        "round_stochastic's seed must be Replicated so every rank rounds alike",
    ),
    (
        "round_stochastic float step",
        lambda: cc.round_stochastic(T("a", [N]), cc.bfloat16, step=0.5),
        cc.DTypeError,
        "must be an integer scalar",
    ),
    (
        "reduction dim out of range",
        lambda: cc.sum(T("a", [N, M]), 2),
        cc.ShapeError,
        "out of range",
    ),
    ("norm of ints", lambda: cc.norm(T("a", [N], dtype=int32)), cc.DTypeError, "floating-point"),
    (
        "norm over the sliced dim",
        lambda: cc.norm(T("a", [N], Sliced(0))),
        cc.LayoutError,
        "sqrt(all_reduce(sum(x * x)))",
    ),
    ("matmul inner sizes", lambda: T("x", [B, K]) @ T("w", [N, M]), cc.ShapeError, "K vs N"),
    ("matmul 3-d weight", lambda: T("x", [B, K]) @ T("w", [K, N, M]), cc.ShapeError, "@"),
    ("matmul bool", lambda: _cond() @ cc.gt(T("w", [N, M]), 0.0), cc.DTypeError, "bool"),
    (
        "matmul Sliced(0) @ Sliced(0)",
        lambda: T("x", [B, K], Sliced(0)) @ T("w", [K, N], Sliced(0)),
        cc.LayoutError,
        "partial sums",
    ),
    (
        "matmul Sliced(last) @ Sliced(0) over different axes",
        lambda: T("x", [B, K], Sliced(1, "tp")) @ T("w", [K, N], Sliced(0, "dp")),
        cc.LayoutError,
        "matmul of",
    ),
    (
        "matmul contraction-sliced x by Replicated w",
        lambda: T("x", [B, K], Sliced(1)) @ T("w", [K, N]),
        cc.LayoutError,
        "contraction dim but w is not",
    ),
    (
        "matmul Replicated x by contraction-sliced w",
        lambda: T("x", [B, K]) @ T("w", [K, N], Sliced(0)),
        cc.LayoutError,
        "contraction dim but x is not",
    ),
    (
        "matmul Sliced(0) x by Local w",
        lambda: T("x", [B, K], Sliced(0)) @ T("w", [K, N], Local),
        cc.LayoutError,
        "must be Replicated",
    ),
    (
        "matmul Local x by column-sliced w",
        lambda: T("x", [B, K], Local) @ T("w", [K, N], Sliced(1)),
        cc.LayoutError,
        "must be Replicated",
    ),
    ("all_reduce Replicated", lambda: cc.all_reduce(T("x", [N])), cc.LayoutError, "already"),
    ("all_reduce Sliced", lambda: cc.all_reduce(T("x", [N], Sliced(0))), cc.LayoutError, "Local"),
    ("all_reduce of bool", lambda: cc.all_reduce(_cond(Local)), cc.DTypeError, "bool"),
    (
        "all_reduce op is a string",
        lambda: cc.all_reduce(T("x", [N], Local), op="sum"),
        cc.DSLError,
        "ReduceOp",
    ),
    (
        "all_reduce axis is an int",
        lambda: cc.all_reduce(T("x", [N], Local), axis=0),
        cc.DSLError,
        "axis",
    ),
    (
        "reduce_scatter of a scalar",
        lambda: cc.reduce_scatter(T("x", [], Local)),
        cc.ShapeError,
        "scalar",
    ),
    (
        "reduce_scatter dim",
        lambda: cc.reduce_scatter(T("x", [N], Local), dim=1),
        cc.ShapeError,
        "range",
    ),
    ("reduce_scatter Replicated", lambda: cc.reduce_scatter(T("x", [N])), cc.LayoutError, "Local"),
    ("all_gather Local", lambda: cc.all_gather(T("x", [N], Local)), cc.LayoutError, "all_reduce"),
    ("all_gather Replicated", lambda: cc.all_gather(T("x", [N])), cc.LayoutError, "already whole"),
    (
        "all_gather over another axis",
        lambda: cc.all_gather(T("x", [N], Sliced(0, "tp")), axis="dp"),
        cc.LayoutError,
        "sliced over 'tp'",
    ),
    ("broadcast Replicated", lambda: cc.broadcast(T("x", [N])), cc.LayoutError, "already"),
    ("broadcast negative root", lambda: cc.broadcast(T("x", [N], Local), -1), cc.DSLError, "root"),
    ("reduce Sliced", lambda: cc.reduce(T("x", [N], Sliced(0))), cc.LayoutError, "Local"),
    ("send Replicated over the world", lambda: cc.send(T("x", [N]), "pp"), cc.LayoutError, "send"),
    (
        "send Sliced along its own axis",
        lambda: cc.send(T("x", [N], Sliced(0, "pp")), "pp"),
        cc.LayoutError,
        "another mesh axis",
    ),
    ("send without an axis", lambda: cc.send(T("x", [N], Local), None), cc.DSLError, "axis"),
    ("scatter Local", lambda: cc.scatter(T("x", [N], Local)), cc.LayoutError, "reduce_scatter"),
    (
        "scatter Sliced",
        lambda: cc.scatter(T("x", [N], Sliced(0))),
        cc.LayoutError,
        "already sliced",
    ),
    ("scatter a scalar", lambda: cc.scatter(T("x", [])), cc.ShapeError, "scalar"),
    (
        "scatter over the world of a tp-replicated value",
        lambda: cc.scatter(T("x", [N], Replicated("tp"))),
        cc.LayoutError,
        "axis='tp'",
    ),
    (
        "update of a computed value",
        lambda: cc.update(T("p", [N]) + 1, T("q", [N])),
        cc.DSLError,
        "input",
    ),
    (
        "update dtype",
        lambda: cc.update(T("p", [N]), T("q", [N], dtype=float16)),
        cc.DTypeError,
        "float16",
    ),
    ("update shape", lambda: cc.update(T("p", [N]), T("q", [N, N])), cc.ShapeError, "[N, N]"),
    (
        "update Replicated with Local",
        lambda: cc.update(T("p", [N]), T("g", [N], Local)),
        cc.LayoutError,
        "all_reduce",
    ),
    (
        "update Sliced with a Replicated value spanning the slice",
        lambda: cc.update(T("p", [N], Sliced(0)), T("q", [N])),
        cc.LayoutError,
        "scatter(...) the new value",
    ),
    (
        "update Replicated with Sliced",
        lambda: cc.update(T("p", [N]), T("q", [N], Sliced(0))),
        cc.LayoutError,
        "all_gather",
    ),
    (
        "update world-Replicated with tp-Replicated",
        lambda: cc.update(T("p", [N]), T("q", [N], Replicated("tp"))),
        cc.LayoutError,
        "Replicated(axis=tp)",
    ),
    ("matmul_tn different rows", lambda: cc.matmul_tn(T("x", [B, K]), T("y", [N, M])),
     cc.ShapeError, "leading dims differ"),
    ("matmul_tn rows sliced on one side", lambda: cc.matmul_tn(
        T("x", [B, K], Sliced(0)), T("y", [B, N])), cc.LayoutError, "rows are sliced"),
    ("matmul_tn both sliced on the last dim", lambda: cc.matmul_tn(
        T("x", [B, K], Sliced(1)), T("y", [B, N], Sliced(1))), cc.LayoutError, "rows sliced alike"),
    ("transpose a vector", lambda: cc.transpose(T("x", [N])), cc.ShapeError, "a matrix"),
    ("unsqueeze out of range", lambda: cc.unsqueeze(T("x", [N]), 3), cc.ShapeError, "out of range"),
    ("expand_as to a smaller shape", lambda: cc.expand_as(T("x", [B, N]), T("y", [N])),
     cc.ShapeError, "does not broadcast"),
    ("expand_as spanning a sliced dim", lambda: cc.expand_as(T("x", [B, N], Local),
     T("y", [B, N], Sliced(1))), cc.LayoutError, "spans the sliced dim"),
    ("cast to a torch dtype", lambda: cc.cast(T("a", [N]), "float16"), cc.DSLError, "DType"),
    ("Sliced dim out of range", lambda: T("a", [N], Sliced(1)), cc.DSLError, "rank 1"),
    ("negative size", lambda: T("a", [-1]), cc.DSLError, "sizes are ints >= 0"),
    ("truth value", lambda: bool(T("a", [N]) > 0), cc.DSLError, "truth value"),
]


@pytest.mark.parametrize(
    ("build", "error", "fragment"), [c[1:] for c in ILLEGAL], ids=[c[0] for c in ILLEGAL]
)
def test_illegal(build, error, fragment):
    with pytest.raises(error) as info:
        build()
    assert isinstance(info.value, cc.CoconetError)
    assert fragment in str(info.value)
    # the message points at the line that wrote the op: a line of this file
    assert info.value.loc is not None
    assert info.value.loc.filename == __file__


def test_negative_sliced_dim_is_normalised():
    assert T("a", [N, M], Sliced(-1)).layout == Sliced(1)
    assert cc.reduce_scatter(T("g", [N, M, K], Local), dim=-2).layout == Sliced(1)
