"""The coconet IR: types, ops, typing rules, nodes and programs."""

from coconet.ir.group import Group, GroupKind
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node, make_node
from coconet.ir.ops import Op, ReduceOp
from coconet.ir.program import Program
from coconet.ir.types import (
    Dim,
    DType,
    Layout,
    LayoutKind,
    Local,
    Replicated,
    Sliced,
    TensorType,
    slice_bounds,
)

__all__ = [
    "DType",
    "Group",
    "GroupKind",
    "Dim",
    "Layout",
    "LayoutKind",
    "Local",
    "Mesh",
    "Node",
    "Op",
    "Program",
    "ReduceOp",
    "Replicated",
    "Sliced",
    "TensorType",
    "make_node",
    "slice_bounds",
]
