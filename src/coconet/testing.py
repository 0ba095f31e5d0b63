"""``coconet.testing``: checking a distributed run against the simulator, from inside the ranks.

The harness of the examples' ``--distributed`` mode and of the tests (not the runtime: it sits
above the compiler and the runtime and uses both).

``check_distributed`` is what an example's ``--distributed`` mode calls on every rank: the same
global inputs the simulator takes go in, every rank simulates the reference program (the
unscheduled one, by default the same program), runs one compiled step on its own part of the
inputs and compares its outputs and updated inputs with its rank's simulated values. The errors
are reduced over the ranks so every rank returns the same report; rank 0 prints it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coconet.compiler import compile, resolve_target
from coconet.errors import CodegenError, ConfigError, SimulationError
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.program import Program
from coconet.ir.types import Layout, slice_bounds
from coconet.progress import phase
from coconet.runtime.comm import Communicator
from coconet.runtime.launch import init, shutdown
from coconet.sim import simulate

# What check_schedules and run_distributed accept by default, relative to the largest expected
# value: fused kernels (torch.compile) may contract ``a * b + c`` into one FMA, a 1-ulp
# difference from the simulator's separate roundings, and schedules that re-associate sums
# (LAMB's norms as partial sums) move float32 results by a few ulp. Pass rtol=0.0 to demand
# bitwise equality (what the tests do with fused_kernels=False where nothing re-associates).
DEFAULT_RTOL = 1e-5

__all__ = ["CheckReport", "check_distributed", "check_schedules", "rank_inputs", "run_distributed"]


def rank_inputs(
    program: Program, inputs: Mapping[str, Any], mesh: Mesh, rank: int
) -> dict[str, Any]:
    """This rank's inputs for ``program`` from simulator-style ``inputs``.

    As for ``coconet.simulate``: a list holds one value per rank (taken as is); a tensor or number
    is the global value (Sliced inputs are cut to this rank's ``tensor_split`` part). Tensors are
    copied, so the step's in-place updates never reach the caller's ``inputs``.
    """
    if not isinstance(mesh, Mesh):
        raise ConfigError(
            f"rank_inputs takes a coconet.Mesh, got {mesh!r}",
            op="rank_inputs",
            hint="rank_inputs(program, inputs, comm.mesh, comm.rank)",
        )
    mesh.coords(rank)  # refuses a rank outside the mesh
    out: dict[str, Any] = {}
    for node in program.inputs:
        if node.name not in inputs:
            continue
        value = inputs[node.name]
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if len(value) != mesh.size:
                raise SimulationError(
                    f"input {node.name!r}: got {len(value)} per-rank values for {mesh.size} ranks",
                    op="rank_inputs",
                    hint=f"pass a list of {mesh.size} values (one per rank), or one value",
                )
            value = value[rank]
        elif isinstance(value, torch.Tensor) and node.type.layout.is_sliced:
            lay = node.type.layout
            lo, hi = slice_bounds(
                value.shape[lay.dim], mesh.axis_size(lay.axis), mesh.index_in(rank, lay.axis)
            )
            value = value.narrow(lay.dim, lo, hi - lo)
        out[node.name] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


@dataclass
class CheckReport:
    """Max errors of one distributed step against the simulator, over every rank."""

    program: str
    mesh: str
    errors: dict[str, float] = field(default_factory=dict)  # value -> max abs error
    relative: dict[str, float] = field(default_factory=dict)  # value -> max abs / max |expected|

    @property
    def max_abs_error(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max(self.relative.values(), default=0.0)

    @property
    def exact(self) -> bool:
        return self.max_abs_error == 0.0

    def ok(self, rtol: float = 0.0, atol: float = 0.0) -> bool:
        return all(self.errors[k] <= atol or self.relative[k] <= rtol for k in self.errors)

    def __str__(self) -> str:
        exact = " (exact)" if self.exact else ""
        return (
            f"{self.program} on {self.mesh}: max abs error {self.max_abs_error:.3e}, "
            f"max rel error {self.max_rel_error:.3e} vs the simulator{exact}"
        )


def check_distributed(
    target: Any,
    inputs: Mapping[str, Any],
    *,
    comm: Communicator | None = None,
    reference: Any = None,
    options: Any = None,
    verbose: bool = True,
    **overrides: Any,
) -> CheckReport:
    """Run one step of ``target`` (Program or Schedule) on every rank and compare with
    ``coconet.simulate(reference or target's program, inputs, mesh)``. Call it on every rank with
    the same ``inputs`` and the communicator ``coconet.runtime.init()`` returned."""
    _require(comm, "check_distributed")
    program = resolve_target(target)[0]
    ref_program = resolve_target(reference)[0] if reference is not None else program
    step = compile(target, comm=comm, options=options, **overrides)
    mesh, rank = comm.mesh, comm.rank
    sim = simulate(ref_program, inputs, mesh)
    mine = rank_inputs(program, inputs, mesh, rank)
    outputs = step(**mine)

    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for node in program.outputs:
        if node.name in sim.outputs:
            want = _expected(sim.outputs[node.name], ref_program.node(node.name), node, mesh, rank)
            pairs.append((node.name, outputs[node.name], want))
    for u in program.updates:
        name = u.inputs[0].name
        if name in sim.updates:
            want = _expected(sim.updates[name], ref_program.input(name), u.inputs[0], mesh, rank)
            pairs.append((name, mine[name], want))
    local = [_errors(got, want) for _, got, want in pairs]
    worst = comm.max_over_world([x for pair in local for x in pair], "check errors")
    report = CheckReport(program.name, str(mesh))
    for k, (name, _, _) in enumerate(pairs):
        report.errors[name] = worst[2 * k]
        report.relative[name] = worst[2 * k + 1]
    if verbose and rank == 0:
        print(f"check_distributed: {report}", flush=True)
    return report


def _expected(values: list[torch.Tensor], ref: Node, mine: Node, mesh: Mesh, rank: int):
    """The simulator's value on ``rank`` (laid out as ``ref``), in this program's layout."""
    full = _whole(values, ref.type.layout, mesh, rank)
    lay: Layout = mine.type.layout
    if lay.is_sliced:
        lo, hi = slice_bounds(
            full.shape[lay.dim], mesh.axis_size(lay.axis), mesh.index_in(rank, lay.axis)
        )
        return full.narrow(lay.dim, lo, hi - lo)
    return full


def _whole(values: list[torch.Tensor], lay: Layout, mesh: Mesh, rank: int) -> torch.Tensor:
    if not lay.is_sliced:
        return values[rank]
    return torch.cat([values[r] for r in mesh.group_of(rank, lay.axis)], dim=lay.dim)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    if got.shape != want.shape:
        return float("inf"), float("inf")
    if want.numel() == 0 or torch.equal(got, want):
        return 0.0, 0.0
    g, w = got.double(), want.double()
    diff = (g - w).abs()
    both_nan = torch.isnan(g) & torch.isnan(w)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"))
    err = diff.max().item()
    scale = torch.nan_to_num(w.abs(), nan=0.0, posinf=0.0).max().item()
    return err, (err / scale if scale > 0 else err)


def check_schedules(
    program: Program,
    schedules: Mapping[str, Any],
    inputs: Mapping[str, Any],
    *,
    comm: Communicator | None = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = 0.0,
    label: str | None = None,
    **compile_options: Any,
) -> bool:
    """``check_distributed`` for ``program`` and each of its ``schedules`` (name -> Schedule, or
    a function of the program returning one), against the unscheduled program. Rank 0 prints one
    line per schedule; returns whether all are within ``rtol``/``atol`` (the same on every rank;
    ``DEFAULT_RTOL``, as ``run_distributed``: fused kernels and re-associated sums differ from the
    simulator in the last bits).

    What an example's ``--distributed`` mode calls::

        comm = coconet.runtime.init()
        ok = coconet.testing.check_schedules(
            program(), SCHEDULES, make_inputs(comm.world), comm=comm
        )
        coconet.runtime.shutdown(exit_code=0 if ok else 1)
    """
    _require(comm, "check_schedules")
    label = label or program.name
    targets = {"(unscheduled)": program}
    for name, make in schedules.items():
        targets[name] = make(program) if callable(make) else make
    ok = True
    if comm.rank == 0:
        print(
            f"{label}: {len(targets)} programs on {comm.world} rank(s) over "
            f"{comm.transport_of(None).value}; each compiles first (a fused kernel's first "
            "torch.compile takes 10-30 s; later runs read Inductor's cache)",
            flush=True,
        )
    for i, (name, target) in enumerate(targets.items(), 1):
        try:
            # rank 0 says what runs, and keeps saying so while it compiles (no silent wait)
            with phase(f"  [{i}/{len(targets)}] {name}: compiling and running",
                       enabled=comm.rank == 0):  # fmt: skip
                report = check_distributed(
                    target, inputs, comm=comm, reference=program, verbose=False,
                    **compile_options,
                )  # fmt: skip
        except CodegenError as e:
            ok = False
            if comm.rank == 0:
                print(f"{label} {name:<22} {comm.mesh}: not compiled: {e.message}", flush=True)
            continue
        good = report.ok(rtol=rtol, atol=atol)
        ok &= good
        if comm.rank == 0:
            print(
                f"{label} {name:<22} {comm.mesh}: max abs err {report.max_abs_error:.3e}  "
                f"max rel err {report.max_rel_error:.3e} vs the simulator  "
                f"{'ok' if good else 'MISMATCH'}",
                flush=True,
            )
    return ok


def _require(comm: Any, op: str) -> None:
    if not isinstance(comm, Communicator):
        raise ConfigError(
            f"{op} needs the communicator, got {comm!r}",
            op=op,
            hint="comm = coconet.runtime.init(); pass comm=comm",
        )


def run_distributed(
    program: Program,
    schedules: Mapping[str, Any],
    make_inputs: Any,
    *,
    mesh: Any = None,
    rtol: float = DEFAULT_RTOL,
) -> int:
    """An example's ``--distributed`` mode, under ``coconet run --nproc N`` or torchrun.

    Joins the job (``mesh``: a Mesh, or a function of the world size returning one), runs the
    program and each schedule on the real ranks with ``make_inputs(world or mesh)``, prints one
    line per schedule on rank 0 (error against the simulator), and ends the process with 0 when
    every one is within ``rtol`` (``DEFAULT_RTOL``: fused kernels' FMAs, LAMB's re-associated
    norms), else 1.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if callable(mesh):
        mesh = mesh(world)
    comm = init(mesh)
    try:
        ok = check_schedules(
            program, schedules, make_inputs(mesh or comm.world), comm=comm, rtol=rtol
        )
    except Exception:
        shutdown(comm)
        raise
    shutdown(comm, exit_code=0 if ok else 1)
    return 0 if ok else 1  # pragma: no cover - shutdown ends the process
