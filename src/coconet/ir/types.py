"""Element types, symbolic sizes, layouts and tensor types of the IR.

All of these are small immutable values that compare and hash structurally, so two programs built
the same way (or a schedule replayed from JSON) compare equal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from coconet.errors import DSLTypeError, DSLValueError

__all__ = [
    "DType",
    "Dim",
    "Layout",
    "LayoutKind",
    "Local",
    "Replicated",
    "Shape",
    "Size",
    "Sliced",
    "TensorType",
    "format_shape",
    "slice_bounds",
]


class DType(enum.Enum):
    """Element types. ``bool`` only comes out of comparisons and feeds ``where``."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    int32 = "int32"
    int64 = "int64"
    bool = "bool"

    @property
    def torch(self) -> torch.dtype:
        return _TORCH[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.float32, DType.float16, DType.bfloat16)

    @property
    def itemsize(self) -> int:
        return _TORCH[self].itemsize

    @property
    def short(self) -> str:
        return _SHORT[self]

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        for k, v in _TORCH.items():
            if v == dtype:
                return k
        raise DSLValueError(
            f"coconet has no element type for torch dtype {dtype}",
            op="DType.from_torch",
            hint="coconet has " + ", ".join(d.value for d in cls) + "; convert with .to(...)",
        )


_TORCH = {
    DType.float32: torch.float32,
    DType.float16: torch.float16,
    DType.bfloat16: torch.bfloat16,
    DType.int32: torch.int32,
    DType.int64: torch.int64,
    DType.bool: torch.bool,
}
_SHORT = {
    DType.float32: "f32",
    DType.float16: "f16",
    DType.bfloat16: "bf16",
    DType.int32: "i32",
    DType.int64: "i64",
    DType.bool: "bool",
}


@dataclass(frozen=True)
class Dim:
    """A symbolic size, bound to an integer when the program runs.

    Two Dims are the same size when they have the same name: ``Dim("N")`` written twice is one size.
    """

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise DSLTypeError(
                f"a Dim is named by a string, got {type(self.name).__name__} {self.name!r}",
                op="Dim",
                hint='Dim("N") is a size bound when the program runs; a fixed size is a plain int',
            )
        if not self.name.isidentifier():
            raise DSLValueError(
                f"Dim name must be an identifier, got {self.name!r}",
                op="Dim",
                hint='use a Python name such as Dim("N") or Dim("hidden")',
            )

    def __str__(self) -> str:
        return self.name


Size = int | Dim
Shape = tuple[Size, ...]


def format_shape(shape: Shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


class LayoutKind(enum.Enum):
    LOCAL = "Local"
    REPLICATED = "Replicated"
    SLICED = "Sliced"


@dataclass(frozen=True)
class Layout:
    """How a logical tensor is spread over the ranks of a mesh axis.

    - ``Local``: every rank holds its own, different, full-size value (gradients, partial sums).
    - ``Replicated``: every rank of ``axis`` holds the same value.
    - ``Sliced(dim)``: rank i of ``axis`` holds the i-th contiguous part along ``dim``. Parts differ
      by at most one element when the size is not divisible (``torch.tensor_split`` rule).

    ``axis=None`` means the whole world. Ranks in different groups of ``axis`` (other mesh
    coordinates) may hold different values: ``Replicated(axis="tp")`` is the same within each
    tensor-parallel group, not across pipeline stages.
    """

    kind: LayoutKind
    dim: int | None = None
    axis: str | None = None

    @property
    def is_local(self) -> bool:
        return self.kind is LayoutKind.LOCAL

    @property
    def is_replicated(self) -> bool:
        return self.kind is LayoutKind.REPLICATED

    @property
    def is_sliced(self) -> bool:
        return self.kind is LayoutKind.SLICED

    def __call__(self, axis: str | None = None) -> Layout:
        """``Replicated("tp")``: the same layout over one mesh axis."""
        if self.is_sliced:
            raise DSLTypeError(
                f"{self} takes no further arguments, got {axis!r}",
                op="Sliced",
                hint=f"use Sliced({self.dim}, axis=...) for a sliced layout along one mesh axis",
            )
        if self.is_local:
            raise DSLTypeError(
                f"Local takes no axis, got {axis!r}: every rank holds its own value",
                op="Local",
                hint="write Local; an axis only applies to Replicated(axis) and Sliced(dim, axis)",
            )
        _check_axis(self.kind.value, axis)
        return Layout(self.kind, None, axis)

    def __str__(self) -> str:
        ax = f", axis={self.axis}" if self.axis is not None else ""
        if self.is_sliced:
            return f"Sliced(dim={self.dim}{ax})"
        if self.axis is not None:
            return f"{self.kind.value}(axis={self.axis})"
        return self.kind.value

    __repr__ = __str__


Local = Layout(LayoutKind.LOCAL)
Replicated = Layout(LayoutKind.REPLICATED)


def Sliced(dim: int = 0, axis: str | None = None) -> Layout:  # noqa: N802 - reads like a layout name
    """Rank i of ``axis`` holds the i-th part of the tensor along ``dim``."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise DSLTypeError(
            f"Sliced(dim=...) takes an int, got {dim!r}",
            op="Sliced",
            hint="Sliced(0) slices the first dim; Sliced(-1) the last",
        )
    _check_axis("Sliced", axis)
    return Layout(LayoutKind.SLICED, dim, axis)


def _check_axis(layout: str, axis: object) -> None:
    if axis is not None and not isinstance(axis, str):
        raise DSLTypeError(
            f"{layout}(axis=...) takes a mesh axis name or None, got {axis!r}",
            op=layout,
            hint="name an axis of the Mesh, e.g. Mesh(dp=2, tp=2) has axes 'dp' and 'tp'",
        )


def slice_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` of ``size`` elements split into ``parts``.

    The first ``size % parts`` parts hold one element more, exactly as ``torch.tensor_split``.
    """
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TensorType:
    """dtype, global (logical) shape and layout of a value in a program."""

    dtype: DType
    shape: Shape
    layout: Layout

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.short}{format_shape(self.shape)} {self.layout}"
