"""Running a compiled schedule's generated ``step()`` in this process, on a world of one, and the
random inputs of ``test_schedule_property``'s programs (shared with ``test_generated_order`` and
``test_user_programs``)."""

from __future__ import annotations

import torch

import coconet as cc
from coconet.codegen import KernelSet, bind_sizes, geometry
from coconet.ir.ops import Op

N = cc.Dim("N")  # the random programs' main size (equal to test_schedule_property's N)


def make_inputs(program: cc.Program, world: int, n: int, k: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out: dict = {}
    for node in program.inputs:
        if node.name in ("g", "h"):
            out[node.name] = [torch.randn(n, generator=gen) for _ in range(world)]
        elif node.type.rank == 0:
            out[node.name] = float(torch.randn((), generator=gen))
        else:
            shape = [n if s == N else k for s in node.type.shape]
            out[node.name] = torch.randn(shape, generator=gen)
    return out


class OneRank:
    """The communicator of a world of one, in this process: each collective's group meaning on
    a group of one (a copy; a send's first stage receives zeros), started and waited for as the
    generated code does on real ranks. A wait for a collective that was never started, or a
    collective left unwaited, fails the test."""

    def __init__(self) -> None:
        self.pending: dict[int, torch.Tensor] = {}

    def __getattr__(self, name: str):
        if not name.endswith("_start"):
            raise AttributeError(name)
        op = Op(name.removesuffix("_start"))

        def start(x, *args, label, **kwargs):
            result = torch.zeros_like(x) if op is Op.SEND else x.clone()
            self.pending[id(result)] = result
            return result

        return start

    def wait(self, work):
        assert self.pending.pop(id(work), None) is work, "a wait for a collective not started"
        return work


def run_generated(compiled, inputs: dict) -> tuple[dict, dict]:
    """The compiled module's step() on a world of one, eager kernels: what real ranks run.
    A deferred collective (``coconet.schedule.defer``) is started from the operand the step
    hands on and landed at once, as the next call would: its updates join the step's."""
    program = compiled.program
    args = []
    for node in program.inputs:
        v = inputs[node.name]
        v = v[0] if isinstance(v, list) else v
        args.append(torch.tensor(v, dtype=node.type.dtype.torch) if isinstance(v, float) else v)
    mesh = cc.Mesh.world(1)
    shapes = {n.name: tuple(a.shape) for n, a in zip(program.inputs, args, strict=True)}
    sizes, problems = bind_sizes(program, mesh, [shapes])
    assert not problems, problems
    env = geometry(program, mesh, 0, sizes)
    comm = OneRank()
    kernels = KernelSet(compiled.module.KERNELS, fused=False)
    outputs, updates = compiled.module.step(comm, env, kernels, *args)
    assert not comm.pending, "collectives started and never waited for"
    deferred = getattr(compiled.module, "DEFERRED", {})
    if deferred:
        operands = {name: outputs.pop(name) for name in deferred}
        works = compiled.module.start_deferred(comm, env, kernels, operands)
        landed = compiled.module.land(comm, env, kernels, works)
        assert not comm.pending, "deferred collectives started and never waited for"
        assert set(landed) == {i for names in deferred.values() for i in names}
        assert not set(landed) & set(updates), "an input updated by the step and a landing"
        updates = {**updates, **landed}
    return outputs, updates
