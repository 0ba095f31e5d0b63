"""The reference gradients of a program: ``torch.autograd`` through the simulator.

``reference_grad(program, wrt, inputs, cotangents, world)`` is what ``coconet.grad``'s programs
are checked against. It gives every variable of an input in ``wrt`` one leaf tensor (a Local
input one per rank, a Replicated one one per group of its axis, a Sliced one one per rank's
part), runs ``simulate(..., differentiable=True)``, and differentiates the loss that counts
each variable of each float output once: ``sum over ranks <d_y_r, y_r>`` for a Local or Sliced
output, ``<d_y, y>`` once per group for a Replicated one. None of ``coconet.grad``'s rules is
used here: the two meet only in the test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from coconet.errors import SimulationError
from coconet.ir.mesh import Mesh
from coconet.ir.program import Program
from coconet.sim.simulator import _as_mesh, _Simulator, simulate

__all__ = ["reference_grad"]


def reference_grad(
    program: Program,
    wrt: Iterable[str],
    inputs: Mapping[str, Any],
    cotangents: Mapping[str, Sequence[torch.Tensor]],
    world: int | Mesh,
) -> dict[str, list[torch.Tensor]]:
    """Per-rank gradients ``d_<name>`` of the inputs ``wrt`` (names), as ``simulate`` would
    hold them on each rank. ``inputs`` as for ``simulate``; ``cotangents`` maps each float
    output's name to one tensor per rank (equal within a group for a Replicated output)."""
    mesh = _as_mesh(program, world)
    binding = _Simulator(program, mesh)  # what each rank holds of each input
    binding.bind_inputs(inputs)
    wrt = list(wrt)
    bound = dict(inputs)
    leaves: dict[str, list[torch.Tensor]] = {}
    for name in wrt:
        node = program.input(name)
        held = binding.values[name]
        lay = node.type.layout
        per_rank: list[torch.Tensor] = [torch.empty(0)] * mesh.size
        if lay.is_replicated:
            for group in mesh.groups(lay.axis):
                leaf = held[group[0]].detach().clone().requires_grad_(True)
                for r in group:
                    per_rank[r] = leaf
        else:
            per_rank = [t.detach().clone().requires_grad_(True) for t in held]
        leaves[name] = per_rank
        bound[name] = per_rank
    result = simulate(program, bound, mesh, differentiable=True)
    loss = torch.zeros((), dtype=torch.float64)
    for out in program.outputs:
        if not out.type.dtype.is_float:
            continue
        if out.name not in cotangents:
            raise SimulationError(
                f"reference_grad: no cotangent for output {out.name!r}",
                hint="pass one tensor per rank for every float output",
            )
        ys, cts = result.outputs[out.name], cotangents[out.name]
        lay = out.type.layout
        ranks = (
            [g[0] for g in mesh.groups(lay.axis)] if lay.is_replicated else range(mesh.size)
        )
        for r in ranks:
            loss = loss + (ys[r].double() * cts[r].double()).sum()
    distinct: list[torch.Tensor] = []
    for per_rank in leaves.values():
        for t in per_rank:
            if not any(t is d for d in distinct):
                distinct.append(t)
    if not loss.requires_grad:  # no output depends on wrt
        grads = [torch.zeros_like(t) for t in distinct]
    else:
        grads = torch.autograd.grad(loss, distinct, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(distinct, grads,
                                                                        strict=True)]
    by_leaf = {id(t): g for t, g in zip(distinct, grads, strict=True)}
    return {
        f"d_{name}": [by_leaf[id(t)].to(t.dtype) for t in leaves[name]] for name in wrt
    }

