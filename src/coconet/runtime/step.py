"""``CompiledStep``: one compiled program, called once per step on every rank.

A call, on every rank:

1. checks this rank's inputs locally (names, types, dtypes, devices, ranks of shapes) without
   communicating;
2. runs the handshake (``handshake.settle``): program identity and input shapes are compared across
   ranks and a bad input anywhere fails every rank with the same message, before any data moves;
3. runs the generated ``step`` into fresh tensors (nothing the caller owns is written);
4. with ``commit_vote``, confirms that every rank got through (one tiny all_reduce);
5. commits: copies each update into the caller's tensor, and returns the outputs.

A failure at 2 leaves everything usable. A failure at 3 or 4 raises (a ``RuntimeFault`` for
communication problems) and leaves the caller's tensors as they were; the communicator is then
marked broken, because its collectives may no longer line up across ranks.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

from coconet.cache import use_inductor_cache
from coconet.codegen.geometry import Geometry, geometry
from coconet.codegen.kernels import KernelSet
from coconet.errors import ConfigError, RuntimeFault
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.opspec import Prop, spec
from coconet.ir.program import Program
from coconet.ir.types import format_shape
from coconet.options import CommitMode, CompileOptions
from coconet.runtime import handshake
from coconet.runtime.comm import Communicator
from coconet.runtime.transport import Published
from coconet.version import __version__

__all__ = ["CompiledStep"]


class CompiledStep:
    """The result of ``coconet.compile``: call it with the program's inputs, by name."""

    def __init__(
        self,
        *,
        program: Program,
        schedule: str,
        schedule_digest: str,
        mesh: Mesh,
        options: CompileOptions,
        module: types.ModuleType,
        source: str,
        key: str,
        comm: Communicator | None,
        device: str,
    ) -> None:
        self.program = program
        self.schedule = schedule  # the schedule's text, for people
        self.schedule_digest = schedule_digest  # its identity ("" for a bare program)
        self.mesh = mesh
        self.options = options
        self.module = module
        self.source = source
        self.key = key
        self.device = device
        self._comm = comm
        self._kernels: KernelSet | None = None
        self._exchanged: dict[str, tuple[int, ...]] | None = None  # shapes at the last exchange
        self._geometry: Geometry | None = None
        self._updated = {u.inputs[0].name for u in program.updates}

    # -- what it is -----------------------------------------------------------------------------

    @property
    def kernels(self) -> KernelSet:
        """The fused kernels (compiled on their first call unless fused_kernels=False)."""
        if self._kernels is None:
            if self.options.fused_kernels:
                use_inductor_cache(self.options.cache_dir)  # keyed by torch and CPU
            self._kernels = KernelSet(self.module.KERNELS, fused=self.options.fused_kernels)
        return self._kernels

    def identity(self, comm: Communicator) -> tuple[tuple[str, str], ...]:
        """The fields every rank must agree on (compared at the handshake)."""
        return (
            ("program", self.program.name),
            ("program digest", self.program.digest()),
            # The digest tells schedules apart; the text (which elides long lists of names)
            # is there so that a mismatch reads as the schedules' lines.
            ("schedule", " ".join(self.schedule.split()) or "(none)"),
            ("schedule digest", self.schedule_digest or "(none)"),
            ("mesh", str(self.mesh)),
            ("device", self.device),
            ("coconet", __version__),
            ("collective algorithms", repr(comm.options.algorithms)),
        )

    def input_buffer(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """A tensor to pass as input ``name`` that lives where the step's collective reads it
        (symmetric memory over shared memory), so that nothing is copied in: write the gradient
        into it (``param.grad`` as a view of it) and pass it at every step. Collective: every
        rank calls it at the same point with its own ``shape``. An ordinary tensor passed
        instead is copied in; where the transport has no shared memory this is an ordinary
        tensor too."""
        comm = self._communicator()
        node = self.program.input(name)
        readers = [u for u in self.program.users()[node.name] if spec(u.op).has(Prop.COMMUNICATES)]
        if not readers:
            raise ConfigError(
                f"input {name!r} of {self.program.name} is not read by a collective: it has "
                "nothing to gain from symmetric memory",
                op=f"{self.program.name} input_buffer",
                hint="ask for the buffer of an input that a reduce_scatter or all_reduce reads "
                "(the gradient)",
            )
        if len(shape) != node.type.rank:
            raise ConfigError(
                f"input {name!r} has rank {node.type.rank}, shape {tuple(shape)} has "
                f"{len(shape)} dims",
                op=f"{self.program.name} input_buffer",
                hint=f"pass this rank's shape of {name!r}, e.g. tuple(grad.shape)",
            )
        return comm.symmetric_tensor(
            tuple(int(s) for s in shape), node.type.dtype.torch, axis=readers[0].attr("axis")
        )

    def show(self) -> str:
        """The generated module's source (what ``coconet show`` prints)."""
        return self.source

    def __repr__(self) -> str:
        return f"CompiledStep({self.program.name}, {self.mesh}, key={self.key})"

    # -- one step -------------------------------------------------------------------------------

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        """Run one step on this rank. Returns the outputs by name; applies the updates in place
        to the caller's tensors once the step succeeded on every rank."""
        comm = self._communicator()
        args, shapes, dtypes, error = self._bind(inputs, comm)
        report = handshake.RankReport(comm.rank, self.identity(comm), shapes, dtypes, error)
        need = self._exchanged != shapes
        if self.options.check_every_step or self._exchanged is None:
            reports = handshake.settle(comm, report, need)
            if reports is not None:
                sizes = handshake.verdict(reports, self.program, self.mesh)
                self._geometry = geometry(self.program, self.mesh, comm.rank, sizes)
                self._exchanged = shapes
        elif need or error is not None:
            raise RuntimeFault(
                error or "input shapes changed since the first step",
                op=f"{self.program.name} step",
                hint="with check_every_step=False, inputs must keep their shapes (and the other "
                "ranks are not told: they will time out); compile with the default to allow it",
            )
        try:
            outputs, updates = self.module.step(comm, self._geometry, self.kernels, *args)
            if self.options.commit_vote:
                comm.agree_max([0], "every rank finished the step", op="commit vote")
        except Exception as exc:
            # Collectives of this step may be half done on other ranks: this communicator
            # can no longer line up with them.
            if comm.broken is None:
                comm.broken = f"rank {comm.rank} failed in a step: {type(exc).__name__}"
            raise
        return self._commit(inputs, outputs, updates)

    def _communicator(self):
        comm = self._comm
        if comm is None:
            raise ConfigError(
                f"{self.program.name}: no communicator: it was compiled without one (world= "
                "only generates code), so it cannot run a step",
                op=f"{self.program.name} step",
                hint="compile with comm=coconet.runtime.init() (the communicator init returns)",
            )
        if comm.mesh != self.mesh:
            raise ConfigError(
                f"{self.program.name} was compiled for {self.mesh}, the communicator has "
                f"{comm.mesh}",
                op=f"{self.program.name} step",
                hint="compile with the communicator's mesh",
            )
        return comm

    # -- inputs ---------------------------------------------------------------------------------

    def _bind(self, given: dict[str, Any], comm) -> tuple[list, dict, dict, str | None]:
        """Positional args for the generated step, local shapes and dtypes, and the first problem
        found with this rank's inputs (None when they look right locally)."""
        names = [n.name for n in self.program.inputs]
        problems = []
        unknown = sorted(set(given) - set(names))
        if unknown:
            problems.append(
                f"{self.program.name} has no inputs named {unknown}; its inputs are {names}"
            )
        args, shapes, dtypes = [], {}, {}
        for node in self.program.inputs:
            if node.name not in given:
                problems.append(f"input {node.name!r} ({node.type}) is missing")
                args.append(None)
                continue
            value, problem = self._tensor(node, given[node.name], comm)
            if problem:
                problems.append(problem)
            args.append(value)
            if value is not None:
                shapes[node.name] = tuple(value.shape)
                dtypes[node.name] = str(value.dtype).replace("torch.", "")
        return args, shapes, dtypes, ("; ".join(problems) or None)

    def _tensor(self, node: Node, value: Any, comm) -> tuple[torch.Tensor | None, str | None]:
        ty = node.type
        dtype = ty.dtype.torch
        device = comm.device
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if ty.rank != 0:
                return None, f"input {node.name!r} ({ty}) needs a tensor, got the number {value!r}"
            if node.name in self._updated:
                return None, (
                    f"input {node.name!r} is updated by the program: pass a tensor "
                    "that can be written, not a number"
                )
            return torch.tensor(value, dtype=dtype, device=device), None
        if not isinstance(value, torch.Tensor):
            # a scalar input also takes a Python number (the learning rate as a float)
            wanted = "a torch.Tensor or a Python number" if ty.rank == 0 else "a torch.Tensor"
            return None, f"input {node.name!r}: expected {wanted}, got {type(value).__name__}"
        if value.dtype != dtype:
            return None, (
                f"input {node.name!r} is {value.dtype}, the program declares "
                f"{ty.dtype.value} (pass {node.name}.to({dtype}))"
            )
        if value.device.type != device.type:
            return None, (
                f"input {node.name!r} is on {value.device}, this rank computes on {device}"
            )
        if value.dim() != ty.rank:
            return None, (
                f"input {node.name!r} has shape {list(value.shape)}, the program "
                f"declares {format_shape(ty.shape)} ({ty.layout})"
            )
        return value.detach(), None

    # -- commit ---------------------------------------------------------------------------------

    def _commit(
        self,
        given: dict[str, Any],
        outputs: dict[str, torch.Tensor],
        updates: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        # A result may share memory with an input (a broadcast root's own tensor, a scatter's
        # view): copy it before any input is overwritten, so outputs keep the step's values and
        # updates do not read half-committed inputs.
        held = {
            v.untyped_storage().data_ptr()
            for v in given.values()
            if isinstance(v, torch.Tensor) and v.numel()
        }

        def own(t: torch.Tensor | Published) -> torch.Tensor | Published:
            if isinstance(t, Published):  # in the peers' memory, never in an input
                return t
            return t.clone() if t.numel() and t.untyped_storage().data_ptr() in held else t

        outputs = {k: own(v) for k, v in outputs.items()}
        updates = {k: own(v) for k, v in updates.items()}
        swap = self.options.commit is CommitMode.SWAP
        with torch.no_grad():
            for name, value in updates.items():
                target = given[name]
                if isinstance(value, Published):
                    value.copy_into(target)  # the gather lands in the caller's tensor once
                elif swap and _swappable(target, value):
                    target.set_(value)  # the new values' storage: no copy
                else:
                    target.copy_(value)
        return outputs


def _swappable(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``target`` can take ``value``'s storage (``CommitMode.SWAP``) instead of a copy:
    a whole tensor of its own (not a view, no autograd) and a fresh value of the same kind."""
    return (
        target._base is None
        and not target.requires_grad
        and target.is_contiguous()
        and value.is_contiguous()
        and value._base is None
        and value.shape == target.shape
        and value.dtype == target.dtype
        and value.device == target.device
        and target.storage_offset() == 0
        and value.storage_offset() == 0
        and target.untyped_storage().nbytes() == target.numel() * target.element_size()
    )
