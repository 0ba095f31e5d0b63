"""coconet: computation and communication as first-class operations of one program.

The public API: the DSL (tensors, layouts, computation and communication ops), ``Program``,
``Mesh``, the simulator, ``Schedule`` (the paper's named schedules are in ``coconet.schedule``),
``compile`` (the distributed runtime is ``coconet.runtime``), and the errors.
"""

from coconet.compiler import CompileOptions, compile
from coconet.dsl import (
    Scalar,
    Tensor,
    abs,
    all_gather,
    all_reduce,
    broadcast,
    cast,
    dropout,
    eq,
    exp,
    ge,
    gelu,
    gt,
    le,
    log,
    lt,
    matmul,
    max,
    maximum,
    minimum,
    ne,
    neg,
    norm,
    pow,
    reduce,
    reduce_scatter,
    relu,
    rsqrt,
    scatter,
    send,
    sqrt,
    sum,
    update,
    where,
)
from coconet.errors import (
    CoconetError,
    CodegenError,
    DSLError,
    DTypeError,
    LayoutError,
    RuntimeFault,
    ScheduleError,
    ShapeError,
    SimulationError,
)
from coconet.ir.mesh import Mesh
from coconet.ir.ops import ReduceOp
from coconet.ir.program import Program
from coconet.ir.types import Dim, DType, Layout, Local, Replicated, Sliced
from coconet.schedule import Schedule
from coconet.sim import SimResult, simulate
from coconet.version import __version__  # noqa: E402

float32 = DType.float32
float16 = DType.float16
bfloat16 = DType.bfloat16
int32 = DType.int32
int64 = DType.int64

__all__ = [
    "CodegenError",
    "CoconetError",
    "CompileOptions",
    "DSLError",
    "DType",
    "DTypeError",
    "Dim",
    "Layout",
    "LayoutError",
    "Local",
    "Mesh",
    "Program",
    "ReduceOp",
    "Replicated",
    "RuntimeFault",
    "Scalar",
    "Schedule",
    "ScheduleError",
    "ShapeError",
    "SimResult",
    "SimulationError",
    "Sliced",
    "Tensor",
    "__version__",
    "abs",
    "all_gather",
    "all_reduce",
    "bfloat16",
    "broadcast",
    "cast",
    "compile",
    "dropout",
    "eq",
    "exp",
    "float16",
    "float32",
    "ge",
    "gelu",
    "gt",
    "int32",
    "int64",
    "le",
    "log",
    "lt",
    "matmul",
    "max",
    "maximum",
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
    "simulate",
    "sqrt",
    "sum",
    "update",
    "where",
]
