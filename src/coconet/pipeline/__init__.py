"""``coconet.pipeline``: pipeline schedules as per-rank action lists, proven before they run.

``gpipe`` and ``one_f_one_b`` build the schedules; ``check`` proves that their sends and
receives match in order, kind, micro-batch, shape and dtype over untagged FIFO channels and
cannot deadlock (see ``coconet.pipeline.schedules``). ``Pipeline`` runs this rank's stage of
a model with one of them (``coconet.pipeline.runtime``).
"""

from coconet.pipeline.runtime import Pipeline
from coconet.pipeline.schedules import (
    Action,
    Kind,
    check,
    format_table,
    gpipe,
    one_f_one_b,
    peak_activations,
)

__all__ = [
    "Action",
    "Kind",
    "Pipeline",
    "check",
    "format_table",
    "gpipe",
    "one_f_one_b",
    "peak_activations",
]
