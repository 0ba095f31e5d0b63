"""The device mesh: named axes over the ranks of a world, like PyTorch's DeviceMesh."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Mesh"]


@dataclass(frozen=True)
class Mesh:
    """Ranks arranged on named axes, row-major: ``Mesh(pp=2, tp=2)`` puts ranks 0,1 in stage 0.

    A collective over ``axis`` runs within each group of ranks that share every other coordinate;
    ``axis=None`` is the whole world.
    """

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: dict[str, int] | None = None, /, **sizes: int) -> None:
        merged = dict(axes or {})
        merged.update(sizes)
        if not merged:
            raise ValueError("a Mesh needs at least one axis, e.g. Mesh(world=4)")
        for name, size in merged.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"mesh axis {name!r} needs a positive int size, got {size!r}")
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
        raise KeyError(f"{self} has no axis {axis!r}")

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on every axis: ``Mesh(pp=2, tp=2).coords(3) == {pp: 1, tp: 1}``."""
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"rank {rank!r} is not in {self} (ranks 0..{self.size - 1})")
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return dict(reversed(list(out.items())))

    def rank_of(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (one coordinate per axis), the inverse of ``coords``."""
        if set(coords) != set(self.names):
            raise ValueError(f"{self} needs one coordinate per axis {list(self.names)}: {coords}")
        rank = 0
        for name, size in self.axes:
            if not 0 <= coords[name] < size:
                raise ValueError(f"coordinate {name}={coords[name]} is outside {self}")
            rank = rank * size + coords[name]
        return rank

    def index_in(self, rank: int, axis: str | None) -> int:
        """This rank's position within its group along ``axis``."""
        return rank if axis is None else self.coords(rank)[axis]

    def group_of(self, rank: int, axis: str | None) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``, ordered by their index on that axis."""
        if axis is None:
            return list(range(self.size))
        c = self.coords(rank)
        return [self.rank_of({**c, axis: i}) for i in range(self.axis_size(axis))]

    def groups(self, axis: str | None) -> list[list[int]]:
        """Every group along ``axis``, each once."""
        seen: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.size):
            g = self.group_of(r, axis)
            seen.setdefault(tuple(g), g)
        return list(seen.values())

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"
