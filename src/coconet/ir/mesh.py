"""The device mesh: named axes over the ranks of a world, like PyTorch's DeviceMesh."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from coconet.errors import DSLTypeError, DSLValueError, UnknownNameError

__all__ = ["Mesh"]


@dataclass(frozen=True)
class Mesh:
    """Ranks arranged on named axes, row-major: ``Mesh(pp=2, tp=2)`` puts ranks 0,1 in stage 0.

    A collective over ``axis`` runs within each group of ranks that share every other coordinate;
    ``axis=None`` is the whole world.
    """

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: dict[str, int] | None = None, /, **sizes: int) -> None:
        if axes is not None and not isinstance(axes, Mapping):
            raise DSLTypeError(
                f"Mesh takes its axes by name, got {axes!r}",
                op="Mesh",
                hint="Mesh(world=4), Mesh(pp=2, tp=2) or Mesh({'pp': 2, 'tp': 2})",
            )
        merged = dict(axes or {})
        merged.update(sizes)
        if not merged:
            raise DSLValueError(
                "a Mesh needs at least one axis",
                op="Mesh",
                hint="Mesh(world=4), or Mesh.world(4)",
            )
        for name, size in merged.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise DSLValueError(
                    f"mesh axis names are identifiers, got {name!r}",
                    op="Mesh",
                    hint="name axes like Python variables: Mesh(dp=2, tp=2)",
                )
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise DSLValueError(
                    f"mesh axis {name!r} needs a positive int size, got {size!r}",
                    op="Mesh",
                    hint=f"Mesh({name}=2): the number of ranks along {name}",
                )
        object.__setattr__(self, "axes", tuple(merged.items()))

    @classmethod
    def world(cls, size: int) -> Mesh:
        """A one-axis mesh of ``size`` ranks; its axis is called ``world``."""
        return cls(world=size)

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def axis_size(self, axis: str | None) -> int:
        if axis is None:
            return self.size
        for name, size in self.axes:
            if name == axis:
                return size
        raise self._no_axis(axis)

    def _no_axis(self, axis: object) -> UnknownNameError:
        return UnknownNameError(
            f"{self} has no axis {axis!r}",
            op="Mesh",
            hint=f"its axes are {list(self.names)}; None is the whole world",
        )

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on every axis: ``Mesh(pp=2, tp=2).coords(3) == {pp: 1, tp: 1}``."""
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.size:
            raise DSLValueError(
                f"rank {rank!r} is not in {self} (ranks 0..{self.size - 1})",
                op="Mesh",
                hint=f"a rank is an int from 0 to {self.size - 1}",
            )
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return dict(reversed(list(out.items())))

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (one coordinate per axis), the inverse of ``coords``."""
        if not isinstance(coords, Mapping) or set(coords) != set(self.names):
            raise DSLValueError(
                f"{self} needs one coordinate per axis {list(self.names)}: {coords}",
                op="Mesh",
                hint="rank_of({" + ", ".join(f"{n!r}: 0" for n in self.names) + "})",
            )
        rank = 0
        for name, size in self.axes:
            c = coords[name]
            if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < size:
                raise DSLValueError(
                    f"coordinate {name}={c!r} is outside {self}",
                    op="Mesh",
                    hint=f"a coordinate along {name} is an int from 0 to {size - 1}",
                )
            rank = rank * size + c
        return rank

    def index_in(self, rank: int, axis: str | None) -> int:
        """This rank's position within its group along ``axis``."""
        if axis is None:
            return rank
        coords = self.coords(rank)
        if axis not in coords:
            raise self._no_axis(axis)
        return coords[axis]

    def group_of(self, rank: int, axis: str | None) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``, ordered by their index on that axis."""
        if axis is None:
            return list(range(self.size))
        size = self.axis_size(axis)  # refuses an axis the mesh does not have
        c = self.coords(rank)
        return [self.rank_of({**c, axis: i}) for i in range(size)]

    def groups(self, axis: str | None) -> list[list[int]]:
        """Every group along ``axis``, each once."""
        seen: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            g = self.group_of(r, axis)
            seen.setdefault(tuple(g), g)
        return list(seen.values())

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"
