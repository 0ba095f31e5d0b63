"""The seam between the generic emitter and a transport's own forms: a default lowering with
per-transport overrides (JAX's habit: a primitive's lowering registered per platform).

The generic emitter (``coconet.codegen.emit``) writes every unit of a plan in its default
lowering: each step one after the other, a chunk loop as a software pipeline. It knows no
transport. A transport whose forms (``coconet.codegen.forms``) run some units otherwise
subclasses ``Emission`` and overrides the hooks of those units; each hook returns the unit's
lines in the transport's form, or None where the unit is not one of its forms (the default
then writes it). ``coconet.codegen.emissions.EMISSIONS`` registers each transport's subclass;
shared memory's is ``coconet.codegen.emit_shm.SharedMemoryEmission``.

Each hook answers only for the units that ``forms()`` gave a form of its transport (by the
axis that runs them), so two transports' overrides never claim the same unit. The emitter asks
every registered emission, in registry order, and takes the first answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from coconet.codegen.forms import Forms
from coconet.codegen.names import Namer
from coconet.codegen.plan import ChunkLoop, Compute, FusedCollective, Kernel, Start, Wait
from coconet.codegen.source import GeoRef
from coconet.ir.node import Node
from coconet.ir.program import Program
from coconet.options import TransportKind

__all__ = ["ChunkLoopLowering", "Emission", "Emitter"]


class Emitter(Protocol):
    """What an emission uses of the generic emitter that asks it."""

    forms: Forms
    namer: Namer
    program: Program
    var: dict[str, str]  # value name -> its variable in the code being written

    def comment(self, n: Node) -> str: ...

    def node_lines(self, n: Node, geo: Callable[[Node, str], str | None]) -> list[str]: ...

    def step_lines(self, s: Compute | Kernel | Start | Wait, geo: GeoRef) -> list[str]: ...

    def geo_params(self, k: Kernel) -> list[tuple[Node, str, str]]: ...


class ChunkLoopLowering(Protocol):
    """How one chunk loop is written (``Emission.chunk_loop``; the generic emitter's default:
    a software pipeline over the chunks). The emitter writes the stage functions and the
    assembly of the outputs; this says the rest."""

    how: str  # how the chunks run, for the loop's header comment

    def prologue(self) -> list[str]:
        """Lines before the stage functions (after their names are claimed)."""
        ...

    def step_lines(self, s: Compute | Kernel | Start | Wait, geo: GeoRef) -> list[str]:
        """One step of a stage function (chunk ``c``, its values in ``v``)."""
        ...

    def schedule(self, stage_names: list[str]) -> list[str]:
        """The lines that run the stage functions over the chunks."""
        ...


class Emission:
    """A transport's overrides of the default lowering (see the module docstring). Every hook
    here returns None (or nothing): the default writes the unit. A subclass sets ``kind``."""

    kind: TransportKind

    def __init__(self, e: Emitter) -> None:
        self.e = e

    def mine(self, axis: str | None) -> bool:
        """Whether ``axis``'s collectives run on this emission's transport."""
        return self.e.forms.transport(axis) is self.kind

    def declarations(self) -> list[str]:
        """Module-level lines after ``INPUTS`` that the transport's forms need."""
        return []

    def kernel_def(self, k: Kernel) -> tuple[str, list[str]] | None:
        """``k`` defined in the transport's form: (the function's name after ``_kernel_``, its
        lines)."""
        return None

    def step_lines(self, s: Kernel | Start | Wait, geo: GeoRef) -> list[str] | None:
        """A step of the step function (or of a plain unit) in the transport's form."""
        return None

    def fused_collective_lines(self, unit: FusedCollective, parts: list[str]) -> list[str] | None:
        """A fused collective in the transport's form (``parts``: its collectives and kernels,
        as the header comment names them)."""
        return None

    def chunk_loop(self, loop: ChunkLoop) -> ChunkLoopLowering | None:
        """How ``loop`` is written in the transport's form."""
        return None
