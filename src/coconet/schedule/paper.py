"""The CoCoNet paper's schedules, each a few lines of primitives.

Data-parallel optimizers (SGD, Adam, AdamW, LAMB):
  ``AR_C``          all_reduce the gradients, then one fused kernel for the update;
  ``RS_C_AG``       reduce_scatter, update each rank's slice (state kept sliced), all_gather;
  ``fuse_RS_C_AG``  the same as one fused collective (the update runs inside the collective).
Tensor-parallel layer (matmul, all_reduce, + bias, dropout, + residual):
  ``MM_AR_C``, ``MM_RS_C_AG``, ``ol_MM_fuse_RS_C_AG`` (the matmul overlapped with the rest).
Pipeline-parallel boundary (all_reduce in a stage, send to the next, + residual there):
  ``AR_P2P_C``, ``RS_P2P_C_AG`` (each stage sends 1/T of the data), ``ol_RS_fuse_P2P_C_AG``.
"""

from __future__ import annotations

from collections.abc import Iterable

from coconet.ir.ops import COMMUNICATION, Op
from coconet.ir.program import Program
from coconet.schedule.graph import downstream
from coconet.schedule.schedule import Schedule

__all__ = [
    "AR_C",
    "AR_P2P_C",
    "MM_AR_C",
    "MM_RS_C_AG",
    "RS_C_AG",
    "RS_P2P_C_AG",
    "fuse_RS_C_AG",
    "fuse_after",
    "ol_MM_fuse_RS_C_AG",
    "ol_RS_fuse_P2P_C_AG",
]


def fuse_after(s: Schedule, collective: str, *, include: bool = True) -> None:
    """Fuse ``collective`` (if ``include``) with the computation around it and its all_gathers.

    Collectives that a rewrite put inside the chain (the all_reduce of partial norms in LAMB)
    cannot join a fused collective: the chain is fused up to them, and what depends on them
    becomes a second group, closed by the all_gathers.
    """
    program = s.program
    start = program.node(collective)
    after = [n for n in downstream(program, start) if n.op is not Op.UPDATE]
    # A send can lead the group when the collective before it stays outside (the pipeline).
    leaders_ok = {Op.ALL_GATHER} if include else {Op.ALL_GATHER, Op.SEND}
    inner = {n.name for n in after if n.op in COMMUNICATION and n.op not in leaders_ok}
    behind = set(inner)
    for n in program.nodes:
        if any(i.name in behind for i in n.inputs):
            behind.add(n.name)
    first = [start.name] if include else []
    first += [c for c in s.computations(start.name) if c not in behind]
    second = [n.name for n in after if n.name in behind and n.name not in inner]
    first += [n.name for n in after if n.op is Op.ALL_GATHER and n.name not in behind]
    for group in (first, second):
        if any(program.node(n).op is not Op.ALL_GATHER for n in group):
            s.fuse(group)


# -- data-parallel optimizers -------------------------------------------------------------------


def AR_C(program: Program, all_reduce: str = "g_sum") -> Schedule:  # noqa: N802 - paper's names
    """all_reduce, then the whole update as one fused kernel."""
    s = Schedule(program, "AR_C")
    s.fuse(s.computations(all_reduce))
    return s


def RS_C_AG(  # noqa: N802
    program: Program, state: Iterable[str] = (), all_reduce: str = "g_sum"
) -> Schedule:
    """reduce_scatter, the update on each rank's slice with ``state`` stored sliced, all_gather."""
    s = Schedule(program, "RS_C_AG")
    _rs, ag = s.split(all_reduce)
    s.reorder(s.computations(ag), ag)
    if tuple(state):
        s.as_slice(tuple(state))
    return s


def fuse_RS_C_AG(  # noqa: N802
    program: Program, state: Iterable[str] = (), all_reduce: str = "g_sum"
) -> Schedule:
    """RS_C_AG as one fused collective: the update runs inside the reduce_scatter/all_gather."""
    s = RS_C_AG(program, state, all_reduce)
    s.name = "fuse_RS_C_AG"
    fuse_after(s, f"{all_reduce}_rs")
    return s


# -- tensor-parallel layer ----------------------------------------------------------------------


def MM_AR_C(program: Program, all_reduce: str = "out_sum") -> Schedule:  # noqa: N802
    """matmul, all_reduce of the partial sums, then bias/dropout/residual as one kernel."""
    s = Schedule(program, "MM_AR_C")
    s.fuse(s.computations(all_reduce))
    return s


def MM_RS_C_AG(program: Program, all_reduce: str = "out_sum") -> Schedule:  # noqa: N802
    """matmul, reduce_scatter, bias/dropout/residual on row slices (one kernel), all_gather."""
    s = Schedule(program, "MM_RS_C_AG")
    rs, ag = s.split(all_reduce)
    s.reorder(s.computations(ag), ag)
    s.fuse(s.computations(rs))
    return s


def ol_MM_fuse_RS_C_AG(  # noqa: N802
    program: Program, chunks: int = 4, all_reduce: str = "out_sum"
) -> Schedule:
    """The matmul overlapped, chunk by chunk, with the fused reduce_scatter/compute/all_gather."""
    s = Schedule(program, "ol_MM_fuse_RS_C_AG")
    matmul = program.node(all_reduce).inputs[0].name
    rs, ag = s.split(all_reduce)
    s.reorder(s.computations(ag), ag)
    fuse_after(s, rs)
    s.overlap([matmul, rs, *s.downstream(rs)], chunks)
    return s


# -- pipeline-parallel boundary -----------------------------------------------------------------


def AR_P2P_C(program: Program, all_reduce: str = "out_sum") -> Schedule:  # noqa: N802
    """all_reduce in the stage, send the whole result, then one kernel on the next stage."""
    s = Schedule(program, "AR_P2P_C")
    s.fuse([n for n in s.computations(all_reduce) if s.program.node(n).op is not Op.SEND])
    return s


def RS_P2P_C_AG(program: Program, all_reduce: str = "out_sum") -> Schedule:  # noqa: N802
    """reduce_scatter in the stage, send 1/T of the data, compute on slices, all_gather there."""
    s = Schedule(program, "RS_P2P_C_AG")
    rs, ag = s.split(all_reduce)
    s.reorder(s.computations(ag), ag)
    s.fuse([n for n in s.computations(rs) if s.program.node(n).op is not Op.SEND])
    return s


def ol_RS_fuse_P2P_C_AG(  # noqa: N802
    program: Program, chunks: int = 4, all_reduce: str = "out_sum"
) -> Schedule:
    """The reduce_scatter overlapped with the fused send/compute/all_gather, chunk by chunk."""
    s = Schedule(program, "ol_RS_fuse_P2P_C_AG")
    rs, ag = s.split(all_reduce)
    s.reorder(s.computations(ag), ag)
    fuse_after(s, rs, include=False)
    s.overlap([rs, *s.downstream(rs)], chunks)
    return s
