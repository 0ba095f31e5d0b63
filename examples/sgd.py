"""Data-parallel SGD with momentum and weight decay, written in the coconet DSL.

Each rank holds its own gradient ``g`` (Local); the data-parallel gradient is the sum over ranks
(``all_reduce`` with SUM), and the plain-PyTorch reference gets exactly that sum as ``.grad``.
The update is ``torch.optim.SGD``'s (``nesterov=False``, ``maximize=False``)::

    d_p = g_sum + weight_decay * p
    buf = d_p                                             on the first step (torch's clone)
    buf = momentum * buf + (1 - dampening) * d_p          on every later step
    p   = p - lr * buf

The first step is handled with the runtime scalar ``step``: ``where(step == 1, d_p, ...)`` starts
the momentum buffer as a copy of the gradient, as torch does, whatever ``dampening`` is and
whatever the ``buf`` input holds on that step (``make_inputs`` passes zeros).

Inputs: ``g`` (Local), ``p`` and ``buf`` (Replicated), the float32 runtime scalars ``lr``,
``momentum``, ``dampening``, ``weight_decay`` and ``step`` (1 on the first step).
Named nodes: ``g_sum`` (the gradient all_reduce), ``d_p`` (gradient plus weight decay),
``buf_new`` and ``p_new`` (the updated momentum buffer and parameters). Updates: ``p``, ``buf``.

Run ``python examples/sgd.py`` to simulate it on 2 and 4 virtual ranks against torch.optim.SGD.
"""

from __future__ import annotations

import pathlib
import sys

import torch

import coconet as cc
from coconet.schedule import AR_C, RS_C_AG, fuse_RS_C_AG
from coconet.testing import run_distributed

# Import the examples' shared checking code (examples/_harness.py) however this file is loaded.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import f32, max_errors, report, simulate_steps, sum_over_ranks  # noqa: E402

TOLERANCE = 1e-6  # max relative error vs torch.optim.SGD in float32

# The optimizer state that the sliced schedules keep sliced (1/world of it per rank).
STATE = ("buf",)
# The paper's schedules of this program (see coconet.schedule), by name.
SCHEDULES = {
    "AR_C": AR_C,
    "RS_C_AG": lambda prog: RS_C_AG(prog, STATE),
    "fuse_RS_C_AG": lambda prog: fuse_RS_C_AG(prog, STATE),
}

# Hyper-parameters are runtime scalars, stored as float32 by the program. make_inputs rounds them
# to float32 up front so that the torch reference runs with exactly the same values.
LR = 0.05
MOMENTUM = 0.9
DAMPENING = 0.0
WEIGHT_DECAY = 1e-4


def program(dtype: cc.DType = cc.float32) -> cc.Program:
    """One SGD step over a flat parameter tensor ``p[N]``."""
    N = cc.Dim("N")
    g = cc.Tensor("g", dtype, [N], cc.Local)
    p = cc.Tensor("p", dtype, [N], cc.Replicated)
    buf = cc.Tensor("buf", dtype, [N], cc.Replicated)
    lr, momentum, dampening, weight_decay, step = (
        cc.Scalar(name) for name in ("lr", "momentum", "dampening", "weight_decay", "step")
    )

    g_sum = cc.all_reduce(g, name="g_sum")
    d_p = (g_sum + weight_decay * p).named("d_p")
    # torch starts the buffer as a copy of the first gradient, without dampening
    first_step = cc.eq(step, 1)
    buf_new = cc.where(first_step, d_p, momentum * buf + (1 - dampening) * d_p).named("buf_new")
    p_new = (p - lr * buf_new).named("p_new")
    return cc.Program(
        "sgd",
        [g, p, buf, lr, momentum, dampening, weight_decay, step],
        [cc.update(p, p_new), cc.update(buf, buf_new)],
    )


def make_inputs(
    world: int, size: int = 4096, seed: int = 0, step: int = 1, dtype: torch.dtype = torch.float32
) -> dict:
    """Random simulator inputs: one gradient per rank, parameters, and the buffer of ``step``.

    On step 1 the buffer is zeros (its value is not read); later steps get a random buffer.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn() -> torch.Tensor:
        return torch.randn(size, generator=gen, dtype=torch.float32).to(dtype)

    return {
        "g": [randn() for _ in range(world)],
        "p": randn(),
        "buf": torch.zeros(size, dtype=dtype) if step == 1 else 0.1 * randn(),
        "lr": f32(LR),
        "momentum": f32(MOMENTUM),
        "dampening": f32(DAMPENING),
        "weight_decay": f32(WEIGHT_DECAY),
        "step": step,
    }


def reference(inputs: dict, steps: int = 1) -> dict[str, torch.Tensor]:
    """``steps`` steps of torch.optim.SGD from ``inputs``, each with the summed gradient.

    Returns the new ``p`` and, when torch keeps one (momentum != 0), ``buf``.
    """
    param = torch.nn.Parameter(inputs["p"].clone())
    opt = torch.optim.SGD(
        [param],
        lr=inputs["lr"],
        momentum=inputs["momentum"],
        dampening=inputs["dampening"],
        weight_decay=inputs["weight_decay"],
        foreach=False,
    )
    if inputs["step"] > 1 and inputs["momentum"] != 0:
        opt.state[param]["momentum_buffer"] = inputs["buf"].clone()
    grad = sum_over_ranks(inputs["g"])
    for _ in range(steps):
        param.grad = grad.clone()
        opt.step()
    out = {"p": param.detach()}
    if "momentum_buffer" in opt.state[param]:
        out["buf"] = opt.state[param]["momentum_buffer"]
    return out


def errors(world: int, size: int, steps: int = 3) -> tuple[float, float]:
    """Simulate ``steps`` steps (state fed back) and compare with the torch reference."""
    inputs = make_inputs(world, size)
    return max_errors(simulate_steps(program(), inputs, world, steps), reference(inputs, steps))


def check(world: int, size: int, steps: int = 3) -> float:
    """The max relative error of ``steps`` simulated steps vs torch.optim.SGD."""
    return errors(world, size, steps)[1]


def main() -> int:
    """Print the check on 2 and 4 virtual ranks; exit status 0 if within TOLERANCE."""
    return report("sgd", errors, TOLERANCE, size=4096)


if __name__ == "__main__":
    if "--distributed" in sys.argv:  # under `coconet run --nproc N` or torchrun
        sys.exit(run_distributed(program(), SCHEDULES, lambda world: make_inputs(world, 4099)))
    sys.exit(main())
