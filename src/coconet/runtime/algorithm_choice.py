"""Measuring every tuned collective at every size class up front (``coconet calibrate``).

Steps measure what they need on first use anyway; calibrating ahead moves that cost out of the
first step and shows the choices (and the times behind them) in one table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from coconet.ir.ops import Op
from coconet.ir.opspec import Prop, spec
from coconet.options import CommOptions
from coconet.runtime.comm import Communicator
from coconet.runtime.launch import spawn
from coconet.runtime.transport import TunableTransport
from coconet.runtime.tuning import SIZE_CLASSES, AlgorithmTable

__all__ = ["choose_all", "choose_all_locally"]


def tuned_ops(transport: TunableTransport) -> tuple[Op, ...]:
    """The communication ops for which ``transport`` has algorithms to choose between."""
    return tuple(
        op for op in Op if spec(op).has(Prop.COMMUNICATES) and len(transport.algorithms(op)) > 1
    )


def choose_all(
    comm: Communicator,
    classes: Sequence[str] | None = None,
    axis: str | None = None,
    force: bool = False,
) -> AlgorithmTable:
    """Measure the tuned collectives at each size class on ``axis``'s groups.

    Collective: every rank calls it. Classes already in the table are skipped unless ``force``.
    """
    labels = list(classes) if classes else [label for _, label, _ in SIZE_CLASSES]
    for op in tuned_ops(comm.torch):
        for cls in labels:
            if force or comm.table.get(comm.tuning_key(op, cls, axis)) is None:
                comm.measure(op, cls, axis)
    return comm.table


def _worker(comm: Communicator, classes, force) -> str:
    return choose_all(comm, classes, force=force).format(comm.backend, comm.world)


def choose_all_locally(
    nproc: int,
    classes: Sequence[str] | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    timeout: float = 600.0,
) -> str:
    """Spawn ``nproc`` local ranks, calibrate, and return the table as text."""
    options = CommOptions(algorithms="auto", cache_dir=cache_dir)
    return spawn(_worker, nproc, classes, force, options=options, timeout=timeout)[0]
