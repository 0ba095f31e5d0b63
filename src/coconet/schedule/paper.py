"""The CoCoNet paper's schedules, each a few lines of primitives.

Data-parallel optimizers (SGD, Adam, AdamW, LAMB):
  ``AR_C``          all_reduce the gradients, then one fused kernel for the update;
  ``RS_C_AG``       reduce_scatter, update each rank's slice (state kept sliced), all_gather;
  ``fuse_RS_C_AG``  the same as one fused collective (the update runs inside the collective);
  ``fuse_RS_C``     the same with the parameters sliced too (fully sharded: no all_gather).
Tensor-parallel layer (matmul, all_reduce, + bias, dropout, + residual):
  ``MM_AR_C``, ``MM_RS_C_AG``, ``ol_MM_fuse_RS_C_AG`` (the matmul overlapped with the rest).
Its sequence-parallel form (the all_reduce already split: all_gather in, reduce_scatter out):
  ``ol_AG_MM``  the all_gather of the sequence overlapped, chunk by chunk, with the matmul it
                feeds (a column-parallel forward; a row-parallel backward's input gradient);
  ``ol_MM_RS_C`` the matmul overlapped with its reduce_scatter along the sequence, then
                bias/dropout/residual on each chunk (a row-parallel forward; a column-parallel
                backward's input gradient);
  ``ol_sequence_parallel`` both, wherever they apply (a layer's forward and backward).
Pipeline-parallel boundary (all_reduce in a stage, send to the next, + residual there):
  ``AR_P2P_C``, ``RS_P2P_C_AG`` (each stage sends 1/T of the data), ``ol_RS_fuse_P2P_C_AG``.

Each works on one all_reduce of the program: ``all_reduce=None`` (the default) takes the
program's only all_reduce of a tensor, whatever its name; with several, name the one to schedule
(``RS_C_AG(program, all_reduce="g_sum")``). The schedules refer to the values the primitives
return (``rs, ag = s.split(...)``), never to names rebuilt by convention, so they work whatever
the program's values are called.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from coconet.errors import ScheduleError, UnknownNameError
from coconet.ir.ops import COMMUNICATION, Op
from coconet.ir.program import Program
from coconet.schedule.graph import a_or_an
from coconet.schedule.schedule import Handle, Schedule

__all__ = [
    "AR_C",
    "AR_P2P_C",
    "MM_AR_C",
    "MM_RS_C_AG",
    "RS_C_AG",
    "RS_P2P_C_AG",
    "fuse_RS_C",
    "fuse_RS_C_AG",
    "fuse_after",
    "ol_AG_MM",
    "ol_MM_RS_C",
    "ol_MM_fuse_RS_C_AG",
    "ol_RS_fuse_P2P_C_AG",
    "ol_sequence_parallel",
    "overlap_every_chain",
    "sequence_parallel_chains",
]


def _the_all_reduce(program: Program, all_reduce: Any, schedule: str) -> str:
    """The name of the all_reduce that ``schedule`` works on.

    ``all_reduce`` names it (or is the DSL Tensor that built it); None takes the program's only
    all_reduce of a tensor (scalar all_reduces, a loss or a norm, cannot be split and are not
    what these schedules are about). Otherwise a ScheduleError lists the candidates and names
    the ``all_reduce=`` parameter.
    """
    candidates = [n.name for n in program.nodes if n.op is Op.ALL_REDUCE and n.type.rank > 0]
    listed = ", ".join(candidates)
    example = f"{schedule}(program, all_reduce={(candidates or ['g_sum'])[0]!r})"
    if all_reduce is None:
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            raise ScheduleError(
                f"program {program.name} has no all_reduce of a tensor to schedule",
                op=schedule,
                hint=f"{schedule} starts from an all_reduce (of the gradients, or of a "
                "tensor-parallel layer's partial sums)",
            )
        raise ScheduleError(
            f"program {program.name} has {len(candidates)} all_reduces ({listed}): which one "
            f"should {schedule} schedule?",
            op=schedule,
            hint=f"name it with the all_reduce= parameter, e.g. {example}",
        )
    try:
        node = program.node(all_reduce)
    except UnknownNameError as e:
        node, why = None, e.message
    else:
        why = f"{node.name} is {a_or_an(node.op)}, not an all_reduce"
    if node is None or node.op is not Op.ALL_REDUCE:
        raise ScheduleError(
            f"all_reduce={all_reduce!r}: {why}",
            op=schedule,
            hint=f"the all_reduces of {program.name}: {listed or 'none'}; pass one as "
            f"all_reduce= (e.g. {example}), or all_reduce=None when there is only one",
        )
    return node.name


def fuse_after(s: Schedule, collective: str, *, include: bool = True) -> None:
    """Fuse ``collective`` (if ``include``) with the computation around it and its all_gathers.

    Collectives that a rewrite put inside the chain (the all_reduce of partial norms in LAMB,
    of a clipped update's sum of squares) cannot join a fused collective: the chain is fused up
    to them, and what depends on them becomes a second group, closed by the all_gathers. A
    computation that the inner collectives do not need and the second group reads waits for
    the second group, fused with its consumers, rather than being written out by the first and
    read back (Adam's ``beta1 * m`` in a clipped update: a pass over the state slices saved).
    """
    program = s.program
    after = [program.node(n) for n in s.downstream(collective)]
    # A send can lead the group when the collective before it stays outside (the pipeline).
    leaders_ok = {Op.ALL_GATHER} if include else {Op.ALL_GATHER, Op.SEND}
    inner = {n.name for n in after if n.op in COMMUNICATION and n.op not in leaders_ok}
    behind = set(inner)
    for n in program.nodes:
        if any(i.name in behind for i in n.inputs):
            behind.add(n.name)
    computations = s.computations(collective)
    # what can wait for the second group: read by what depends on the inner collectives, not by
    # the inner collectives themselves (what nothing behind them reads stays in the first: it
    # would otherwise read the first group's values back from memory)
    waits = _read_by(program, behind - inner) - _read_by(program, inner) if inner else set()
    while True:
        early = [c for c in computations if c not in behind and c not in waits]
        back = _read_by(program, set(early)) & waits  # read by the first group: stays there
        if not back:
            break
        waits -= back
    late = set(computations) - set(early)
    after_names = {n.name for n in after}
    first = ([collective] if include else []) + early
    second = [n.name for n in program.nodes if n.name not in inner and n.name != collective
              and ((n.name in after_names and n.name in behind) or n.name in late)]
    gathers = {n.name for n in after if n.op is Op.ALL_GATHER}
    # an all_gather closes the group that computes what it gathers
    for n in after:
        if n.op is Op.ALL_GATHER and n.name not in behind:
            (first if n.inputs[0].name in first else second).append(n.name)
    second = [n for n in second if n not in first]
    for group in (first, second):
        if any(n not in gathers for n in group):  # all_gathers alone are no kernel
            s.fuse(group)


def _read_by(program: Program, names: set[str]) -> set[str]:
    """Every value the nodes ``names`` read, directly or through others."""
    seen: set[str] = set()
    stack = [i for n in names for i in program.node(n).inputs]
    while stack:
        x = stack.pop()
        if x.name not in seen:
            seen.add(x.name)
            stack.extend(x.inputs)
    return seen


# -- data-parallel optimizers -------------------------------------------------------------------


def AR_C(program: Program, all_reduce: Any = None) -> Schedule:  # noqa: N802 - paper's names
    """all_reduce, then the whole update as one fused kernel."""
    s = Schedule(program, "AR_C")
    s.fuse(s.computations(_the_all_reduce(program, all_reduce, "AR_C")))
    return s


def _rs_c_ag(
    name: str, program: Program, state: Iterable[str], all_reduce: Any
) -> tuple[Schedule, Handle]:
    """(RS_C_AG's schedule under ``name``, the handle of its reduce_scatter)."""
    s = Schedule(program, name)
    rs, ag = s.split(_the_all_reduce(program, all_reduce, name))
    s.reorder(s.computations(ag), ag)
    if tuple(state):
        s.as_slice(tuple(state))
    return s, rs


def RS_C_AG(  # noqa: N802
    program: Program, state: Iterable[str] = (), all_reduce: Any = None
) -> Schedule:
    """reduce_scatter, the update on each rank's slice with ``state`` stored sliced, all_gather.

    ``state`` names the Replicated inputs to store sliced, 1/world of each per rank
    (``as_slice``): the optimizer's state, such as SGD's momentum ``("buf",)`` or Adam's
    ``("m", "v")``. Each must be read only by the update's computations (which run on slices)
    and written back with ``update``; the parameters stay whole (every rank needs them). The
    default ``()`` slices nothing: the state is then updated on slices and gathered back whole.
    """
    return _rs_c_ag("RS_C_AG", program, state, all_reduce)[0]


def fuse_RS_C_AG(  # noqa: N802
    program: Program, state: Iterable[str] = (), all_reduce: Any = None
) -> Schedule:
    """RS_C_AG as one fused collective: the update runs inside the reduce_scatter/all_gather.

    ``state``: the inputs to store sliced, as in ``RS_C_AG``.
    """
    s, rs = _rs_c_ag("fuse_RS_C_AG", program, state, all_reduce)
    fuse_after(s, rs)
    return s


def fuse_RS_C(  # noqa: N802
    program: Program, state: Iterable[str] = ("p",), all_reduce: Any = None
) -> Schedule:
    """fuse_RS_C_AG with the parameters stored sliced too: the all_gather leaves the step.

    ``state`` must name the parameters (``p``) with the optimizer's state: each rank then
    stores its slice of them and the step ends with the update of that slice, inside the
    reduce_scatter; fully sharded parameters (``coconet.fsdp``) gather at their next use
    instead, the paper's ``fuse(RS, C, AG)`` with the all_gather moved across the step
    boundary.
    """
    if "p" not in tuple(state):
        raise ScheduleError(
            f"fuse_RS_C stores the parameters sliced: state= must name them, got {tuple(state)}",
            op="fuse_RS_C",
            hint="fuse_RS_C(program, state=('p', 'm', 'v')); with the parameters whole, use "
            "fuse_RS_C_AG",
        )
    s, rs = _rs_c_ag("fuse_RS_C", program, state, all_reduce)
    fuse_after(s, rs)
    return s


# -- tensor-parallel layer ----------------------------------------------------------------------


def MM_AR_C(program: Program, all_reduce: Any = None) -> Schedule:  # noqa: N802
    """matmul, all_reduce of the partial sums, then bias/dropout/residual as one kernel."""
    s = Schedule(program, "MM_AR_C")
    s.fuse(s.computations(_the_all_reduce(program, all_reduce, "MM_AR_C")))
    return s


def MM_RS_C_AG(program: Program, all_reduce: Any = None) -> Schedule:  # noqa: N802
    """matmul, reduce_scatter, bias/dropout/residual on row slices (one kernel), all_gather."""
    s = Schedule(program, "MM_RS_C_AG")
    rs, ag = s.split(_the_all_reduce(program, all_reduce, "MM_RS_C_AG"))
    s.reorder(s.computations(ag), ag)
    s.fuse(s.computations(rs))
    return s


def ol_MM_fuse_RS_C_AG(  # noqa: N802
    program: Program, chunks: int = 4, all_reduce: Any = None
) -> Schedule:
    """The matmul overlapped, chunk by chunk, with the fused reduce_scatter/compute/all_gather."""
    s = Schedule(program, "ol_MM_fuse_RS_C_AG")
    ar = _the_all_reduce(program, all_reduce, "ol_MM_fuse_RS_C_AG")
    matmul = program.node(ar).inputs[0].name  # what the all_reduce sums: the partial products
    rs, ag = s.split(ar)
    s.reorder(s.computations(ag), ag)
    fuse_after(s, rs)
    s.overlap([matmul, rs, *s.downstream(rs)], chunks)
    return s


# -- sequence-parallel layer ---------------------------------------------------------------------


def sequence_parallel_chains(program: Program) -> dict[str, list[tuple[str, str]]]:
    """The chains the sequence-parallel schedules overlap, by schedule name.

    ``ol_AG_MM``: (all_gather, matmul) pairs where the matmul takes the gathered value as its
    left operand, so its rows are the gathered rows (a ``matmul_tn``, which contracts over the
    rows, is not one). ``ol_MM_RS_C``: (matmul, reduce_scatter) pairs where the reduce_scatter
    sums that matmul's partial products. Only collectives over dim 0 (the rows: Megatron's
    ``[sequence, batch, hidden]`` layout) qualify: chunks are cut along the rows.
    """
    gathers: list[tuple[str, str]] = []
    scatters: list[tuple[str, str]] = []
    for n in program.nodes:
        if n.op is Op.MATMUL and n.inputs[0].op is Op.ALL_GATHER:
            ag = n.inputs[0]
            if ag.inputs[0].type.layout.is_sliced and ag.inputs[0].type.layout.dim == 0:
                gathers.append((ag.name, n.name))
        if n.op is Op.REDUCE_SCATTER and n.inputs[0].op is Op.MATMUL and n.type.layout.dim == 0:
            scatters.append((n.inputs[0].name, n.name))
    return {"ol_AG_MM": gathers, "ol_MM_RS_C": scatters}


# what each sequence-parallel schedule's chain is, for its errors
_WHAT = {"ol_AG_MM": "all_gather feeding a matmul",
         "ol_MM_RS_C": "matmul feeding a reduce_scatter"}


def _the_chain(program: Program, schedule: str, value: Any) -> tuple[str, str]:
    """The (producer, consumer) pair of ``schedule``'s chain: the program's only one, or the one
    whose collective is ``value`` (a name, or the DSL Tensor that built it)."""
    chains = sequence_parallel_chains(program)[schedule]
    what = _WHAT[schedule]
    listed = ", ".join(f"{a} -> {b}" for a, b in chains) or "none"
    if value is None:
        if len(chains) == 1:
            return chains[0]
        if not chains:
            raise ScheduleError(
                f"program {program.name} has no {what} to overlap (along dim 0)",
                op=schedule,
                hint=f"{schedule} works on a sequence-parallel layer's program (sequence "
                "dim 0); a layer without sequence parallelism has an all_reduce: "
                "ol_MM_fuse_RS_C_AG",
            )
        raise ScheduleError(
            f"program {program.name} has {len(chains)} chains of an {what} ({listed}): which one "
            f"should {schedule} overlap?",
            op=schedule,
            hint=f"name its collective, e.g. {schedule}(program, collective="
            f"{(chains[0][0] if schedule == 'ol_AG_MM' else chains[0][1])!r})",
        )
    name = getattr(value, "name", value)
    for pair in chains:
        if name in pair:
            return pair
    raise ScheduleError(
        f"collective={value!r} is not in a chain of an {what} of program {program.name}",
        op=schedule,
        hint=f"its chains: {listed}",
    )


def ol_AG_MM(  # noqa: N802
    program: Program, chunks: int = 4, collective: Any = None
) -> Schedule:
    """The all_gather of the sequence overlapped, chunk by chunk, with the matmul it feeds.

    Before (a sequence-parallel column-parallel layer)::

        x_full = all_gather(x)          # f32[T, D] Replicated, from Sliced(dim=0)
        y = matmul(x_full, w_t)         # f32[T, H] Sliced(dim=1)

    After: ``overlap([x_full, y], chunks)``: chunk c's all_gather is in flight while chunk c - 1's
    rows are multiplied (the all_gather-then-GEMM overlap of Megatron's and torch's asynchronous
    tensor parallelism). Values are those of the program; a chunked matmul may round its last
    bit differently (its blocking follows its shape).
    """
    chain = _the_chain(program, "ol_AG_MM", collective)
    s = Schedule(program, "ol_AG_MM")
    _OVERLAP_CHAIN["ol_AG_MM"](s, chain, chunks)
    return s


def ol_MM_RS_C(  # noqa: N802
    program: Program, chunks: int = 4, collective: Any = None
) -> Schedule:
    """The matmul overlapped with its reduce_scatter along the sequence, then the computations
    on the slices (bias, dropout, residual) as one kernel per chunk.

    Before (a sequence-parallel row-parallel layer)::

        partial = matmul(x, w_t)        # f32[T, H] Local (partial sums)
        y_rs = reduce_scatter(partial)  # f32[T, H] Sliced(dim=0)
        out = y_rs + b ...              # bias, dropout, residual

    After: ``fuse(computations(y_rs))``, ``overlap([partial, y_rs, ...], chunks)``: chunk c's
    reduce_scatter is in flight while chunk c + 1's rows are multiplied.
    """
    chain = _the_chain(program, "ol_MM_RS_C", collective)
    s = Schedule(program, "ol_MM_RS_C")
    _OVERLAP_CHAIN["ol_MM_RS_C"](s, chain, chunks)
    return s


def _overlap_ag_mm(s: Schedule, chain: tuple[str, str], chunks: int) -> None:
    s.overlap(list(chain), chunks)


def _overlap_mm_rs_c(s: Schedule, chain: tuple[str, str], chunks: int) -> None:
    mm, rs = chain
    after = s.computations(rs)
    if after:
        s.fuse(after)
    s.overlap([mm, rs, *s.downstream(rs)], chunks)


_OVERLAP_CHAIN = {"ol_AG_MM": _overlap_ag_mm, "ol_MM_RS_C": _overlap_mm_rs_c}


def overlap_every_chain(program: Program, schedule: str, chunks: int) -> Schedule:
    """``schedule`` (``"ol_AG_MM"`` or ``"ol_MM_RS_C"``) applied to every chain of its kind in
    ``program`` (what the tuner uses: a program with two sequence-parallel layers overlaps
    both). A ScheduleError when there is none."""
    chains = sequence_parallel_chains(program)[schedule]
    if not chains:
        _the_chain(program, schedule, None)  # raises: there is none
    s = Schedule(program, schedule)
    for chain in chains:
        _OVERLAP_CHAIN[schedule](s, chain, chunks)
    return s


def ol_sequence_parallel(program: Program, chunks: int = 4) -> Schedule:
    """Every sequence-parallel chain of ``program`` overlapped: each all_gather with the matmul
    it feeds (``ol_AG_MM``), each matmul with its reduce_scatter and the computations after it
    (``ol_MM_RS_C``). What a sequence-parallel layer's ``schedule="ol_sequence_parallel"``
    applies to its forward and its backward (a column-parallel layer gathers in forward and
    reduce-scatters its input gradient in backward; a row-parallel layer the other way round).
    A ScheduleError when the program has no chain."""
    s = Schedule(program, "ol_sequence_parallel")
    found = sequence_parallel_chains(program)
    if not any(found.values()):
        raise ScheduleError(
            f"program {program.name} has no sequence-parallel chain to overlap (an "
            f"{' or a '.join(_WHAT.values())}, along dim 0)",
            op="ol_sequence_parallel",
            hint="a layer without sequence parallelism has an all_reduce: ol_MM_fuse_RS_C_AG",
        )
    for schedule, chains in found.items():
        for chain in chains:
            _OVERLAP_CHAIN[schedule](s, chain, chunks)
    return s



# -- pipeline-parallel boundary -----------------------------------------------------------------


def AR_P2P_C(program: Program, all_reduce: Any = None) -> Schedule:  # noqa: N802
    """all_reduce in the stage, send the whole result, then one kernel on the next stage."""
    s = Schedule(program, "AR_P2P_C")
    ar = _the_all_reduce(program, all_reduce, "AR_P2P_C")
    s.fuse([n for n in s.computations(ar) if s.program.node(n).op is not Op.SEND])
    return s


def RS_P2P_C_AG(program: Program, all_reduce: Any = None) -> Schedule:  # noqa: N802
    """reduce_scatter in the stage, send 1/T of the data, compute on slices, all_gather there."""
    s = Schedule(program, "RS_P2P_C_AG")
    rs, ag = s.split(_the_all_reduce(program, all_reduce, "RS_P2P_C_AG"))
    s.reorder(s.computations(ag), ag)
    s.fuse([n for n in s.computations(rs) if s.program.node(n).op is not Op.SEND])
    return s


def ol_RS_fuse_P2P_C_AG(  # noqa: N802
    program: Program, chunks: int = 4, all_reduce: Any = None
) -> Schedule:
    """The reduce_scatter overlapped with the fused send/compute/all_gather, chunk by chunk."""
    s = Schedule(program, "ol_RS_fuse_P2P_C_AG")
    rs, ag = s.split(_the_all_reduce(program, all_reduce, "ol_RS_fuse_P2P_C_AG"))
    s.reorder(s.computations(ag), ag)
    fuse_after(s, rs, include=False)
    s.overlap([rs, *s.downstream(rs)], chunks)
    return s
