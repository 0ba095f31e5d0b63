"""SGD with momentum written in the coconet DSL, and scheduled by hand: the tutorial's program.

The program is one data-parallel step: every rank holds its own gradient ``g`` (Local), the
weights ``p`` and the momentum ``m`` are the same on every rank (Replicated)::

    g_sum = all_reduce(g)              Local -> Replicated: the sum over the ranks
    m_new = beta * m + g_sum
    p_new = p - lr * m_new

which is ``torch.optim.SGD(momentum=beta)`` given the summed gradient (its first step starts
the buffer from the gradient, as ``m = 0`` does here). ``by_hand`` is the paper's schedule
written with the primitives: split the all_reduce, move the update onto the slices before the
all_gather, keep the momentum sliced, fuse the collective with the update::

    python examples/momentum.py                                 # simulate, vs torch.optim.SGD
    coconet print examples/momentum.py:program
    coconet show examples/momentum.py:program --schedule by_hand --world 2
    coconet run --nproc 2 examples/momentum.py --distributed    # on 2 real ranks

Without ``--distributed`` it prints the program and the schedule, simulates three steps on 2
and 3 virtual ranks (an uneven split) with and without the schedule, and compares them with
``torch.optim.SGD``; the exit status is non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch

import coconet as cc
from coconet.schedule import Schedule, fuse_RS_C_AG
from coconet.testing import run_distributed

STATE = ("m",)  # the state a schedule may keep sliced (coconet tune and show read this)


# --8<-- [start:program]
def program() -> cc.Program:
    """One momentum-SGD step over a flat parameter tensor ``p[N]``."""
    N = cc.Dim("N")  # a symbolic size, bound when the step runs
    g = cc.Tensor("g", cc.float32, [N], cc.Local)  # this rank's gradient
    p = cc.Tensor("p", cc.float32, [N], cc.Replicated)  # the weights
    m = cc.Tensor("m", cc.float32, [N], cc.Replicated)  # the momentum
    lr, beta = cc.Scalar("lr"), cc.Scalar("beta")  # runtime scalars: inputs, not constants
    g_sum = cc.all_reduce(g, name="g_sum")
    m_new = (beta * m + g_sum).named("m_new")
    p_new = (p - lr * m_new).named("p_new")
    return cc.Program("momentum", [g, p, m, lr, beta], [cc.update(p, p_new), cc.update(m, m_new)])
# --8<-- [end:program]


# --8<-- [start:by_hand]
def by_hand(prog: cc.Program) -> Schedule:
    """The paper's fuse(RS_C_AG), one primitive per line."""
    s = Schedule(prog)
    rs, ag = s.split("g_sum")  # all_reduce -> reduce_scatter + all_gather
    s.reorder(s.computations(ag), ag)  # the update runs on slices, before the all_gather
    s.as_slice(["m"])  # the momentum is stored sliced: 1/world per rank
    s.fuse([rs, *s.computations(rs), ag])  # one fused collective
    return s
# --8<-- [end:by_hand]


SCHEDULES = {"by_hand": by_hand, "fuse_RS_C_AG": lambda prog: fuse_RS_C_AG(prog, STATE)}


def make_inputs(world: int, size: int = 1001, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "g": [torch.randn(size, generator=gen) for _ in range(world)],
        "p": torch.randn(size, generator=gen),
        "m": torch.zeros(size),
        "lr": 0.125,  # exact in float32, as the program's scalars are
        "beta": 0.875,
    }


def reference(inputs: dict, steps: int) -> torch.Tensor:
    """``steps`` steps of torch.optim.SGD(momentum=beta), each given the summed gradient."""
    param = torch.nn.Parameter(inputs["p"].clone())
    opt = torch.optim.SGD([param], lr=inputs["lr"], momentum=inputs["beta"])
    for _ in range(steps):
        param.grad = torch.stack(inputs["g"]).sum(0)
        opt.step()
    return param.detach()


def simulated(target, inputs: dict, world: int, steps: int) -> torch.Tensor:
    state = dict(inputs)
    for _ in range(steps):
        result = cc.simulate(target, state, world=world)
        state.update({name: result.updated(name) for name in result.updates})
    return state["p"]


def main() -> int:
    prog = program()
    print(prog)
    schedule = by_hand(prog)
    print(f"\n{schedule}\n")
    ok = True
    for world in (2, 3):
        inputs = make_inputs(world)
        want = reference(inputs, steps=3)
        for name, target in (("unscheduled", prog), ("by_hand", schedule.program)):
            got = simulated(target, inputs, world, steps=3)
            err = ((got - want).abs().max() / want.abs().max()).item()
            good = err <= 1e-6
            ok &= good
            print(f"momentum {name:<11} world={world}: max relative error vs torch.optim.SGD "
                  f"{err:.1e}  {'ok' if good else 'MISMATCH'}")  # fmt: skip
    print("ok: every program and schedule matches torch.optim.SGD" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--distributed" in sys.argv:  # under `coconet run --nproc N` or torchrun
        sys.exit(run_distributed(program(), SCHEDULES, lambda world: make_inputs(world, 4099)))
    sys.exit(main())
