"""When a schedule is bitwise equal to its program, and when it only agrees within a tolerance.

A schedule keeps a program's meaning, but floating-point results can still differ in the last
bits. Which results are exact is decided per op, by construction, on every x86-64 (and other) CPU
torch supports:

**Exact everywhere** (a schedule that only changes these is bit-identical to its program):

- pure data movement: slicing, ``scatter``, ``all_gather``, ``broadcast``, ``send``, ``cast``,
  chunking a pointwise chain;
- correctly rounded pointwise ops (``+ - * /``, ``sqrt``, ``rsqrt`` as ``1/sqrt``, ``neg``,
  ``abs``, ``relu``, ``maximum``/``minimum``, comparisons, ``where``, ``dropout``'s mask,
  ``round_stochastic``, integer arithmetic on the float32 pattern): each
  element's result depends only on that element, whichever kernel (vectorized or scalar tail)
  computes it, and whatever the slice or chunk size (eager ``sqrt`` is MKL's, not correctly
  rounded on every CPU, but a function of the element alone all the same: checked at every
  position and slice on a CPU where it is not);
- ``max`` reductions (order-independent);
- reductions across ranks in a fixed order: the simulator adds ranks ``0, 1, ..., n-1``, and so do
  the runtime's "exact" collective algorithms; with 2 ranks any order is exact (``a + b == b + a``).

**Re-associating** (equal only within a tolerance once a schedule changes their operands' shape,
layout or chunking):

- ``sum``, ``norm`` and ``matmul``: the order of their additions depends on the operand's shape
  and on the kernel BLAS/oneDNN/ATen pick for it, which differs by CPU (AVX2 vs AVX-512) and by
  shape. A sum over slices (partial sums + all_reduce, LAMB's norms under ``reorder``) or a matmul
  run chunk by chunk (``overlap``) is not bitwise equal to the whole one on every CPU (seen: 7.5e-8
  relative on an AMD EPYC, 0 on an Intel Xeon);
- ``exp``, ``log``, ``gelu``, ``pow``, ``silu``, ``tanh``, ``sigmoid``, ``erf``: torch's
  vectorized kernels and its scalar tail loop differ (in the last bits for most; gelu by up to
  ~1e-6 absolute in its negative tail, 4e-4 to 4e-3 relative near x = -3.8), and slicing or
  chunking moves elements between the two (the ops with ``Prop.ROUNDS_PER_KERNEL``);
- gloo's own ("native") reductions on 3+ ranks add in gloo's order;
- the hierarchical transport's (a group over hosts, in two levels or through one leader per
  host): the sum over hosts, in host order, of each host's sum in rank order
  (``coconet.runtime.hierarchy.reduce_order``), the same bits on every rank; rank order only
  where each host's ranks follow the previous host's (in 32-bit types); never used under
  ``algorithms="exact"``.

Two further sources of rounding differences lie outside a schedule: fused kernels
(``torch.compile`` contracts ``a * b + c`` into FMAs, uses its own ``exp``, and takes ``sqrt``
from the CPU's instruction, correctly rounded, where torch's eager ``sqrt`` is MKL's, which on
some CPUs is not: 15% of float32 results 1 ulp off on an AMD EPYC, the same bits at every position
and slice, so eager code still matches eager code), and a reference computed by another library
(``torch.optim``). Tests state their tolerances for those separately.

``reassociations(original, scheduled)`` applies these rules to a program and a scheduled form of
it, and says which values of the scheduled program may differ and why; an empty answer means the
two are bitwise equal by construction (with rank-ordered reductions).
"""

from __future__ import annotations

from coconet.errors import SimulationError
from coconet.ir.group import GroupKind
from coconet.ir.node import Node
from coconet.ir.opspec import Prop, ops_with
from coconet.ir.program import Program

__all__ = ["REASSOCIATING", "SHAPE_DEPENDENT_ROUNDING", "SHAPE_SENSITIVE", "reassociations"]

# Ops whose additions run in an order that depends on the operand's shape and the kernel chosen.
REASSOCIATING = ops_with(Prop.REASSOCIATES)
# Pointwise ops that are not correctly rounded: vectorized and scalar kernels differ in last bits.
SHAPE_DEPENDENT_ROUNDING = ops_with(Prop.ROUNDS_PER_KERNEL)
SHAPE_SENSITIVE = REASSOCIATING | SHAPE_DEPENDENT_ROUNDING


def _signature(n: Node) -> tuple[str, ...]:
    return (str(n.op), *(str(i.type) for i in n.inputs))


def reassociations(original: Program, scheduled: Program) -> tuple[str, ...]:
    """Why values of ``scheduled`` may differ in the last bits from ``original``'s (empty: they
    are bitwise equal by construction).

    A shape-sensitive op (``SHAPE_SENSITIVE``) of the scheduled program is unchanged when the
    original has a node of the same name and op whose operands have the same types (dtype, shape,
    layout), and no overlap group runs it chunk by chunk. Every other one is reported.
    """
    for role, p in (("original", original), ("scheduled", scheduled)):
        if not isinstance(p, Program):
            raise SimulationError(
                f"reassociations compares two Programs; the {role} is {type(p).__name__} {p!r}",
                op="reassociations",
                hint="reassociations(program, schedule.program)",
            )
    before = {n.name: _signature(n) for n in original.nodes if n.op in SHAPE_SENSITIVE}
    chunked = {
        m: g.chunks for g in scheduled.groups if g.kind is GroupKind.OVERLAP for m in g.members
    }
    reasons = []
    for n in scheduled.nodes:
        if n.op not in SHAPE_SENSITIVE:
            continue
        kind = "re-associates its sums" if n.op in REASSOCIATING else "rounds per kernel"
        if n.name in chunked:
            reasons.append(f"{n.op} {n.name} runs in {chunked[n.name]} chunks and {kind}")
        elif before.get(n.name) != _signature(n):
            operands = ", ".join(str(i.type) for i in n.inputs)
            what = "runs on other operands" if n.name in before else "is new, on operands"
            reasons.append(f"{n.op} {n.name} {what} ({operands}) and {kind}")
    return tuple(reasons)
