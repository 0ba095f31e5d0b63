"""coconet: computation and communication as first-class operations of one program.

The public API: the DSL (tensors, layouts, computation and communication ops), ``Program``,
``Mesh``, the simulator, ``Schedule`` (the paper's named schedules are in ``coconet.schedule``),
``compile`` (the distributed runtime is ``coconet.runtime``), and the errors (``coconet.errors``).

The namespace. ``import coconet as cc`` reaches everything above as ``cc.<name>``. ``__all__``
(what ``from coconet import *`` brings in) is only the words a program is written in: ``Tensor``,
``Scalar``, ``Dim``, the dtypes, ``Local``/``Replicated``/``Sliced``, ``Mesh``, ``ReduceOp``, the
ops, ``Program``, ``Schedule`` and ``simulate``. Left out of it, though still ``cc.<name>``:

- ``sum``, ``max``, ``abs``, ``pow`` and ``compile``, whose names are Python builtins: a star
  import must not change what ``sum(...)`` means in the importing module. Write ``cc.sum``, or
  import them explicitly from ``coconet.ops``, the module of every DSL op;
- ``CompileOptions`` (it goes with ``cc.compile``), the types ``DType``, ``Layout`` and
  ``SimResult`` (for annotations: programs use ``cc.float32``, ``Local``, ``simulate(...)``),
  the error classes (``except cc.DSLError``; all of them are in ``coconet.errors``) and
  ``__version__`` (a star import would overwrite the importer's own);
- ``optim``: drop-in data-parallel optimizers (``cc.optim.AdamW(model.parameters(), comm=comm)``),
  not words of the DSL but a package built on it.

Every error coconet raises on purpose is a ``CoconetError`` carrying the op, the values involved,
the user's file and line and a hint; see ``coconet.errors``.
"""

# ``from x import y as y``: an attribute of coconet that ``__all__`` leaves out on purpose (see the
# module docstring); the others are in ``__all__``.
from coconet import ops as ops  # every DSL op, sum/max/abs/pow included: cc.ops.sum
from coconet import optim as optim  # drop-in data-parallel optimizers: cc.optim.Adam, ...
from coconet.autodiff import grad
from coconet.compiler import CompileOptions as CompileOptions
from coconet.compiler import compile as compile
from coconet.dsl import (
    Scalar,
    Tensor,
    all_gather,
    all_reduce,
    axis_index,
    broadcast,
    cast,
    clamp,
    clip,
    dropout,
    eq,
    erf,
    exp,
    expand_as,
    ge,
    gelu,
    gt,
    le,
    log,
    lt,
    matmul,
    matmul_tn,
    maximum,
    mean,
    minimum,
    ne,
    neg,
    norm,
    reduce,
    reduce_scatter,
    relu,
    round_stochastic,
    rsqrt,
    scatter,
    send,
    sigmoid,
    sign,
    silu,
    sqrt,
    tanh,
    transpose,
    unsqueeze,
    update,
    where,
    world_size,
)
from coconet.dsl import abs as abs
from coconet.dsl import max as max
from coconet.dsl import pow as pow
from coconet.dsl import sum as sum
from coconet.errors import CoconetError as CoconetError
from coconet.errors import CodegenError as CodegenError
from coconet.errors import CompileOptionError as CompileOptionError
from coconet.errors import ConfigError as ConfigError
from coconet.errors import DSLError as DSLError
from coconet.errors import DSLTypeError as DSLTypeError
from coconet.errors import DSLValueError as DSLValueError
from coconet.errors import DTypeError as DTypeError
from coconet.errors import LayoutError as LayoutError
from coconet.errors import RuntimeFault as RuntimeFault
from coconet.errors import ScheduleError as ScheduleError
from coconet.errors import ShapeError as ShapeError
from coconet.errors import SimulationError as SimulationError
from coconet.errors import UnknownNameError as UnknownNameError
from coconet.ir.mesh import Mesh
from coconet.ir.ops import ReduceOp
from coconet.ir.program import Program
from coconet.ir.types import Dim, Local, Replicated, Sliced
from coconet.ir.types import DType as DType
from coconet.ir.types import Layout as Layout
from coconet.schedule import Schedule
from coconet.sim import SimResult as SimResult
from coconet.sim import simulate
from coconet.version import __version__ as __version__

float32 = DType.float32
float16 = DType.float16
bfloat16 = DType.bfloat16
int32 = DType.int32
int64 = DType.int64

# What a program is written in (see the module docstring for what is left out, and why).
__all__ = [
    # declarations and layouts
    "Dim",
    "Local",
    "Mesh",
    "ReduceOp",
    "Replicated",
    "Scalar",
    "Sliced",
    "Tensor",
    "bfloat16",
    "float16",
    "float32",
    "int32",
    "int64",
    # computation (sum, max, abs, pow: cc.sum or coconet.ops)
    "cast",
    "clamp",
    "clip",
    "dropout",
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
    "maximum",
    "mean",
    "minimum",
    "ne",
    "neg",
    "norm",
    "relu",
    "round_stochastic",
    "rsqrt",
    "sigmoid",
    "sign",
    "silu",
    "sqrt",
    "tanh",
    "transpose",
    "unsqueeze",
    "where",
    "world_size",
    # communication
    "all_gather",
    "all_reduce",
    "axis_index",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "update",
    # programs, their schedules, gradients and meaning (compile: cc.compile)
    "Program",
    "grad",
    "Schedule",
    "simulate",
]
