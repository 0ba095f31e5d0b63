"""``coconet.pipeline``: pipeline schedules as per-rank action lists, proven before they run.

``gpipe`` and ``one_f_one_b`` build the schedules; ``check`` proves that their sends and
receives match in order, kind, micro-batch, shape and dtype over untagged FIFO channels and
cannot deadlock (see ``coconet.pipeline.schedules``). The stages that run them are the
pipeline issue's next step.
"""

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
    "check",
    "format_table",
    "gpipe",
    "one_f_one_b",
    "peak_activations",
]
