"""The reference interpreter: any Program on N virtual ranks, in one process.

Each value is a list of per-rank torch tensors. Computation runs per rank with the local meaning
of each op (``coconet.ir.semantics``, reached through its ``coconet.ir.opspec``); communication
moves and reduces those tensors between the virtual ranks of each mesh group, in rank order
(``semantics.COLLECTIVES``). This interpreter defines what a coconet program means; schedules,
generated code and the distributed runtime are all checked against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coconet.errors import SimulationError, UnknownNameError
from coconet.ir import semantics
from coconet.ir.chunks import ChunkPlan
from coconet.ir.group import Group, GroupKind
from coconet.ir.mesh import Mesh
from coconet.ir.node import Node
from coconet.ir.ops import Op
from coconet.ir.opspec import Lowering, spec
from coconet.ir.program import Program
from coconet.ir.types import Dim, Layout, Shape, format_shape, slice_bounds

__all__ = ["SimResult", "simulate"]

PerRank = list[torch.Tensor]


@dataclass
class SimResult:
    """What a simulated step produced: per-rank outputs and the new values of updated inputs."""

    program: Program
    mesh: Mesh
    sizes: dict[str, int]
    outputs: dict[str, PerRank] = field(default_factory=dict)
    updates: dict[str, PerRank] = field(default_factory=dict)

    def output(self, name: str) -> torch.Tensor | PerRank:
        """An output as one tensor when its layout allows (whole-world Replicated or Sliced),
        else the per-rank list."""
        self._check_name(name, self.outputs, "output")
        return self._assemble(self.program.node(name), self.outputs[name])

    def updated(self, name: str) -> torch.Tensor | PerRank:
        """The new value of input ``name``, assembled like ``output``."""
        self._check_name(name, self.updates, "updated")
        return self._assemble(self.program.input(name), self.updates[name])

    def _check_name(self, name: Any, values: dict[str, PerRank], what: str) -> None:
        if name not in values:
            kind = "outputs" if what == "output" else "updated inputs"
            raise UnknownNameError(
                f"program {self.program.name} has no {kind[:-1]} named {name!r}",
                op=f"SimResult.{what}",
                hint=f"its {kind} are {sorted(values)}",
            )

    def _assemble(self, node: Node, values: PerRank) -> torch.Tensor | PerRank:
        lay = node.type.layout
        if lay.axis is not None or lay.is_local:
            return values
        if lay.is_replicated:
            return values[0]
        return torch.cat(values, dim=lay.dim)


def simulate(
    program: Program,
    inputs: Mapping[str, Any],
    world: int | Mesh,
    *,
    differentiable: bool = False,
) -> SimResult:
    """Run ``program`` on ``world`` virtual ranks (an int, or a Mesh with named axes).

    ``inputs`` maps each input's name to a value:

    - a tensor or Python number: the logical (global) value. Replicated inputs go to every rank,
      Sliced inputs are cut into per-rank slices, Local inputs are copied to every rank;
    - a list with one tensor per rank: exactly what each rank holds (for Sliced inputs, the
      rank's slice).

    The caller's tensors are never modified; updates come back in ``SimResult.updates``.

    ``differentiable=True`` keeps torch's autograd graph from the inputs that require grad (they
    are not detached), so ``torch.autograd`` can differentiate the simulated step: this is how
    ``coconet.grad``'s programs are checked.
    """
    if not isinstance(program, Program):
        raise SimulationError(
            f"simulate takes a Program, got {type(program).__name__} {program!r}",
            hint="simulate(program, inputs, world); for a schedule: simulate(s.program, ...)",
        )
    if not isinstance(inputs, Mapping):
        raise SimulationError(
            f"simulate's inputs map input names to values, got {type(inputs).__name__}",
            hint="simulate(program, {'g': torch.ones(8), ...}, world)",
        )
    mesh = _as_mesh(program, world)
    sim = _Simulator(program, mesh, differentiable=bool(differentiable))
    sim.bind_inputs(inputs)
    return sim.run()


def _as_mesh(program: Program, world: int | Mesh) -> Mesh:
    if isinstance(world, Mesh):
        mesh = world
    elif isinstance(world, int) and not isinstance(world, bool) and world >= 1:
        mesh = Mesh.world(world)
    else:
        raise SimulationError(f"world must be a positive int or a Mesh, got {world!r}")
    missing = program.mesh_axes - set(mesh.names)
    if missing:
        raise SimulationError(
            f"program {program.name} uses mesh axes {sorted(missing)} that {mesh} does not have",
            hint="pass world=Mesh("
            + ", ".join(f"{a}=..." for a in sorted(program.mesh_axes))
            + ")",
        )
    return mesh


class _Simulator:
    def __init__(self, program: Program, mesh: Mesh, *, differentiable: bool = False) -> None:
        self.differentiable = differentiable
        self.program = program
        self.mesh = mesh
        self.world = mesh.size
        self.sizes: dict[str, int] = {}
        self.bound_by: dict[str, str] = {}  # Dim name -> the input (and rank) that fixed its size
        self.values: dict[str, PerRank] = {}

    # -- sizes ----------------------------------------------------------------------------------

    def shape(self, shape: Shape) -> tuple[int, ...]:
        return tuple(self.sizes[s.name] if isinstance(s, Dim) else s for s in shape)

    def slice_range(self, layout: Layout, global_size: int, rank: int) -> tuple[int, int]:
        parts = self.mesh.axis_size(layout.axis)
        return slice_bounds(global_size, parts, self.mesh.index_in(rank, layout.axis))

    def offsets(self, node: Node, rank: int) -> tuple[int, ...]:
        """Where rank's block of ``node`` starts in the global tensor."""
        gshape = self.shape(node.type.shape)
        offs = [0] * len(gshape)
        lay = node.type.layout
        if lay.is_sliced:
            offs[lay.dim] = self.slice_range(lay, gshape[lay.dim], rank)[0]
        return tuple(offs)

    # -- inputs ---------------------------------------------------------------------------------

    def bind_inputs(self, given: Mapping[str, Any]) -> None:
        names = {n.name for n in self.program.inputs}
        unknown = sorted(set(given) - names)
        if unknown:
            raise SimulationError(
                f"program {self.program.name} has no inputs named {unknown}",
                hint=f"its inputs are {sorted(names)}",
            )
        for node in self.program.inputs:
            if node.name not in given:
                raise SimulationError(
                    f"input {node.name!r} ({node.type}) is missing",
                    hint=f"pass {node.name}=... to simulate()",
                )
            self.values[node.name] = self._bind(node, given[node.name])

    def _bind(self, node: Node, value: Any) -> PerRank:
        ty = node.type
        per_rank = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
        if per_rank:
            if len(value) != self.world:
                raise SimulationError(
                    f"input {node.name!r}: got {len(value)} per-rank values for {self.world} ranks",
                    hint=f"pass a list of {self.world} tensors (one per rank), or one tensor",
                )
            tensors = [self._tensor(node, v) for v in value]
        else:
            tensors = [self._tensor(node, value)]
        lay = ty.layout
        if lay.is_sliced and per_rank:
            # The global size along the sliced dim is the sum of the parts of a group.
            group = self.mesh.group_of(0, lay.axis)
            full = list(tensors[0].shape)
            full[lay.dim] = sum(tensors[r].shape[lay.dim] for r in group)
            self._bind_shape(node, tuple(full))
            gsize = full[lay.dim]
            for r, t in enumerate(tensors):
                lo, hi = self.slice_range(lay, gsize, r)
                expect = list(full)
                expect[lay.dim] = hi - lo
                if list(t.shape) != expect:
                    raise SimulationError(
                        f"input {node.name!r} ({ty}): rank {r} holds shape {list(t.shape)}, its "
                        f"slice of the global shape {full} is {expect}",
                        hint="pass the global tensor instead and let the simulator slice it",
                    )
            return [t.clone() for t in tensors]
        for r, t in enumerate(tensors):
            self._bind_shape(node, tuple(t.shape), r if per_rank else None)
        if not per_rank:
            tensors = tensors * self.world
        if lay.is_sliced:
            gsize = tensors[0].shape[lay.dim]
            out = []
            for r, t in enumerate(tensors):
                lo, hi = self.slice_range(lay, gsize, r)
                out.append(t.narrow(lay.dim, lo, hi - lo).clone())
            return out
        if lay.is_replicated and per_rank:
            for group in self.mesh.groups(lay.axis):
                for r in group[1:]:
                    if not torch.equal(tensors[r], tensors[group[0]]):
                        raise SimulationError(
                            f"input {node.name!r} is {lay} but ranks {group[0]} and {r} hold "
                            "different values",
                            hint="declare it Local, or pass one tensor for every rank",
                        )
        return [t.clone() for t in tensors]

    def _tensor(self, node: Node, value: Any) -> torch.Tensor:
        dtype = node.type.dtype.torch
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if node.type.rank != 0:
                raise SimulationError(
                    f"input {node.name!r} ({node.type}) needs a tensor, got the number {value!r}"
                )
            return torch.tensor(value, dtype=dtype)
        if not isinstance(value, torch.Tensor):
            scalar = node.type.rank == 0  # a scalar also takes a Python number
            wanted = "a torch.Tensor or a Python number" if scalar else "a torch.Tensor"
            raise SimulationError(
                f"input {node.name!r}: expected {wanted}, got {type(value).__name__}"
            )
        if value.dtype != dtype:
            raise SimulationError(
                f"input {node.name!r} is {value.dtype}, the program declares "
                f"{node.type.dtype.value}",
                hint=f"pass {node.name}.to({dtype})",
            )
        return value if self.differentiable else value.detach()

    def _bind_shape(self, node: Node, actual: tuple[int, ...], rank: int | None = None) -> None:
        declared = node.type.shape
        who = f"input {node.name!r}" + (f" (rank {rank})" if rank is not None else "")
        if len(actual) != len(declared) or any(
            not isinstance(d, Dim) and d != a for d, a in zip(declared, actual, strict=False)
        ):
            raise SimulationError(
                f"{who} is declared with shape {format_shape(declared)}, got {list(actual)}"
            )
        for d, a in zip(declared, actual, strict=True):
            if isinstance(d, Dim):
                bound = self.sizes.setdefault(d.name, a)
                first = self.bound_by.setdefault(d.name, who)
                if bound != a:
                    raise SimulationError(
                        f"{who}: size {d.name} is {a} here but {bound} in {first}",
                        hint=f"every tensor sized with Dim({d.name!r}) must have the same size",
                    )

    # -- execution ------------------------------------------------------------------------------

    def run(self) -> SimResult:
        overlapped = {
            m: g for g in self.program.groups if g.kind is GroupKind.OVERLAP for m in g.members
        }
        by_name = {n.name: n for n in self.program.nodes}
        pending = [n for n in self.program.nodes if n.op is not Op.INPUT]
        # Program order, except that an overlapped chain runs as one unit once every value it
        # reads from outside is ready (a scatter listed between its members, for instance).
        while pending:
            for node in pending:
                group = overlapped.get(node.name)
                needs = _outside_inputs(group, by_name) if group else node.inputs
                if all(i.name in self.values for i in needs):
                    break
            else:  # pragma: no cover - the program verifier rules out cycles
                raise SimulationError(f"cannot order {[n.name for n in pending]}")
            if group is None:
                self.store(node, self.eval(node))
                pending.remove(node)
                continue
            plan = ChunkPlan(group, by_name, self.mesh)
            results = plan.run(self.values, self.world, self.global_rows, self.eval_chunk)
            for name, out in results.items():
                self.store(by_name[name], out)
            pending = [n for n in pending if n.name not in results]
        result = SimResult(self.program, self.mesh, dict(self.sizes))
        for n in self.program.outputs:
            result.outputs[n.name] = self.values[n.name]
        for u in self.program.updates:
            result.updates[u.inputs[0].name] = self.values[u.name]
        return result

    def store(self, node: Node, out: PerRank) -> None:
        dtype = node.type.dtype.torch
        self.values[node.name] = [v if v.dtype == dtype else v.to(dtype) for v in out]

    def global_rows(self, node: Node) -> int:
        return self.shape(node.type.shape)[0]

    def eval_chunk(self, node: Node, scope: dict[str, PerRank], rows: dict[int, torch.Tensor]):
        return self.eval(node, scope, rows)

    def eval(
        self,
        node: Node,
        values: dict[str, PerRank] | None = None,
        rows: dict[int, torch.Tensor] | None = None,
    ) -> PerRank:
        """``node`` on every rank; ``values`` and ``rows`` (global row indices per rank) are given
        when a chunk of an overlapped chain is evaluated."""
        values = self.values if values is None else values
        args = [values[i.name] for i in node.inputs]
        return self._BY_LOWERING[spec(node.op).lowering](self, node, args, rows)

    # -- one method per lowering form (coconet.ir.opspec.Lowering) ------------------------------

    def _leaf(self, node: Node, args: list[PerRank], rows) -> PerRank:
        if node.op is Op.INPUT:  # pragma: no cover - inputs are bound before evaluation
            raise SimulationError(f"input {node.name} was evaluated, not bound", op="input")
        t = torch.tensor(node.attr("value"), dtype=node.type.dtype.torch)
        return [t] * self.world

    def _size(self, node: Node, args: list[PerRank], rows) -> PerRank:
        dtype = node.type.dtype.torch
        return [
            torch.tensor(semantics.size_value(node, self.sizes, self.mesh, r), dtype=dtype)
            for r in range(self.world)
        ]

    def _cast(self, node: Node, args: list[PerRank], rows) -> PerRank:
        return [a.to(node.type.dtype.torch) for a in args[0]]

    def _random(self, node: Node, args: list[PerRank], rows) -> PerRank:
        """dropout and stochastic rounding: keyed by each element's place in the whole."""
        gshape = self.shape(node.type.shape)

        def one(r: int) -> torch.Tensor:
            where = (int(args[1][r]), int(args[2][r]), gshape, self.offsets(node, r),
                     rows[r] if rows else None)  # fmt: skip
            if node.op is Op.ROUND_STOCHASTIC:
                return semantics.apply_round_stochastic(args[0][r], node.type.dtype.torch,
                                                        *where)  # fmt: skip
            return semantics.apply_dropout(args[0][r], node.attr("p"), *where)

        return [one(r) for r in range(self.world)]

    def _pointwise(self, node: Node, args: list[PerRank], rows) -> PerRank:
        fn = spec(node.op).local
        return [fn(*(a[r] for a in args)) for r in range(self.world)]

    def _reduction(self, node: Node, args: list[PerRank], rows) -> PerRank:
        dim, keepdim = node.attr("dim"), node.attr("keepdim")
        return [semantics.reduction(node.op, x, dim, keepdim) for x in args[0]]

    def _matmul(self, node: Node, args: list[PerRank], rows) -> PerRank:
        return [torch.matmul(a, b) for a, b in zip(args[0], args[1], strict=True)]

    def _function(self, node: Node, args: list[PerRank], rows) -> PerRank:
        fn, attrs = semantics.FUNCTIONS[node.op], dict(node.attrs)
        return [fn(*(a[r] for a in args), **attrs) for r in range(self.world)]

    def _scatter(self, node: Node, args: list[PerRank], rows) -> PerRank:
        dim = node.type.layout.dim
        out = []
        for r in range(self.world):
            lo, hi = self.slice_range(node.type.layout, args[0][r].shape[dim], r)
            out.append(args[0][r].narrow(dim, lo, hi - lo).clone())
        return out

    def _update(self, node: Node, args: list[PerRank], rows) -> PerRank:
        target, value = args
        return [value[r].expand_as(target[r]).clone() for r in range(self.world)]

    def _collective(self, node: Node, args: list[PerRank], rows) -> PerRank:
        """The op's group meaning (``semantics.COLLECTIVES``) on each group of its axis."""
        x = args[0]
        meaning = semantics.COLLECTIVES[node.op]
        out: PerRank = [torch.empty(0)] * self.world
        for group in self.mesh.groups(node.attr("axis")):
            if node.op in (Op.BROADCAST, Op.REDUCE):
                self._root(node, group)
            for r, value in zip(group, meaning(node, [x[r] for r in group]), strict=True):
                out[r] = value
        return out

    def _point_to_point(self, node: Node, args: list[PerRank], rows) -> PerRank:
        return self.send(node, args[0])

    _BY_LOWERING = {
        Lowering.LEAF: _leaf,
        Lowering.SIZE: _size,
        Lowering.CAST: _cast,
        Lowering.RANDOM: _random,
        Lowering.POINTWISE: _pointwise,
        Lowering.REDUCTION: _reduction,
        Lowering.MATMUL: _matmul,
        Lowering.FUNCTION: _function,
        Lowering.SCATTER: _scatter,
        Lowering.UPDATE: _update,
        Lowering.COLLECTIVE: _collective,
        Lowering.POINT_TO_POINT: _point_to_point,
    }

    def _root(self, node: Node, group: list[int]) -> int:
        root = node.attr("root")
        if root >= len(group):
            raise SimulationError(
                f"root={root} but the group along axis {node.attr('axis')!r} has {len(group)} "
                "ranks",
                op=str(node.op),
                loc=node.loc,
            )
        return root

    def send(self, node: Node, x: PerRank) -> PerRank:
        out: PerRank = [torch.empty(0)] * self.world
        step = -1 if node.attr("reverse") else 1  # reverse: from the next rank of the axis
        for group in self.mesh.groups(node.attr("axis")):
            for i, r in enumerate(group):
                j = i - step
                out[r] = x[group[j]].clone() if 0 <= j < len(group) else torch.zeros_like(x[r])
        return out


def _outside_inputs(group: Group, by_name: dict[str, Node]) -> list[Node]:
    members = set(group.members)
    return [i for m in group.members for i in by_name[m].inputs if i.name not in members]
