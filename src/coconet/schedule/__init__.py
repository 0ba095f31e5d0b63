"""Schedules: semantics-preserving rewrites of a program, recorded and replayable."""

from coconet.schedule.as_slice import apply_as_slice, check_as_slice
from coconet.schedule.defer import apply_defer, check_defer
from coconet.schedule.fuse import apply_fuse, check_fuse
from coconet.schedule.overlap import apply_overlap, check_overlap
from coconet.schedule.paper import (
    AR_C,
    AR_P2P_C,
    MM_AR_C,
    MM_RS_C_AG,
    RS_C_AG,
    RS_P2P_C_AG,
    fuse_RS_C,
    fuse_RS_C_AG,
    ol_MM_fuse_RS_C_AG,
    ol_RS_fuse_P2P_C_AG,
)
from coconet.schedule.reorder import apply_reorder, check_reorder
from coconet.schedule.schedule import Handle, Primitive, Schedule, Step
from coconet.schedule.split import apply_split, check_split

__all__ = [
    "AR_C",
    "AR_P2P_C",
    "MM_AR_C",
    "MM_RS_C_AG",
    "RS_C_AG",
    "RS_P2P_C_AG",
    "Handle",
    "Primitive",
    "Schedule",
    "Step",
    "apply_as_slice",
    "apply_defer",
    "apply_fuse",
    "apply_overlap",
    "apply_reorder",
    "apply_split",
    "check_as_slice",
    "check_defer",
    "check_fuse",
    "check_overlap",
    "check_reorder",
    "check_split",
    "fuse_RS_C",
    "fuse_RS_C_AG",
    "ol_MM_fuse_RS_C_AG",
    "ol_RS_fuse_P2P_C_AG",
]
