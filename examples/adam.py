"""Data-parallel Adam (L2-style weight decay), written in the coconet DSL.

Each rank holds its own gradient ``g`` (Local); the data-parallel gradient is the sum over ranks
(``all_reduce`` with SUM), and the plain-PyTorch reference gets exactly that sum as ``.grad``.
The update is ``torch.optim.Adam``'s (``amsgrad=False``, ``maximize=False``)::

    d_p = g_sum + weight_decay * p                        the L2 penalty joins the gradient
    m   = beta1 * m + (1 - beta1) * d_p
    v   = beta2 * v + (1 - beta2) * d_p * d_p
    p   = p - lr / (1 - beta1 ** step) * m / (sqrt(v) / sqrt(1 - beta2 ** step) + eps)

Every hyper-parameter and the step count (1 on the first step) is a runtime float32 ``Scalar``,
so one program serves every step; the bias corrections are computed in the program from
``step``. Because the program holds scalars in float32, ``make_inputs`` rounds the
hyper-parameters to float32 and the torch reference runs with those same values (torch would
otherwise compute ``1 - beta2`` from the double 0.999, which float32 cannot hold).

Inputs: ``g`` (Local); ``p``, ``m``, ``v`` (Replicated); scalars ``lr``, ``beta1``, ``beta2``,
``eps``, ``weight_decay``, ``step``.
Named nodes: ``g_sum`` (the gradient all_reduce), ``d_p``, ``m_new``, ``v_new``, ``denom``,
``p_new``. Updates: ``p``, ``m``, ``v``.

Run ``python examples/adam.py`` to simulate it on 2 and 4 virtual ranks against torch.optim.Adam.
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
from _harness import (  # noqa: E402
    adam_family_inputs,
    max_errors,
    report,
    simulate_steps,
    torch_adam_reference,
)

TOLERANCE = 1e-6  # max relative error vs torch.optim.Adam in float32

# The optimizer state that the sliced schedules keep sliced (1/world of it per rank).
STATE = ("m", "v")
# The paper's schedules of this program (see coconet.schedule), by name.
SCHEDULES = {
    "AR_C": AR_C,
    "RS_C_AG": lambda prog: RS_C_AG(prog, STATE),
    "fuse_RS_C_AG": lambda prog: fuse_RS_C_AG(prog, STATE),
}

LR = 1e-2
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2


def program(dtype: cc.DType = cc.float32) -> cc.Program:
    """One Adam step over a flat parameter tensor ``p[N]``."""
    N = cc.Dim("N")
    g = cc.Tensor("g", dtype, [N], cc.Local)
    p, m, v = (cc.Tensor(name, dtype, [N], cc.Replicated) for name in ("p", "m", "v"))
    lr, beta1, beta2, eps, weight_decay, step = (
        cc.Scalar(name) for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
    )

    g_sum = cc.all_reduce(g, name="g_sum")
    d_p = (g_sum + weight_decay * p).named("d_p")
    m_new = (beta1 * m + (1 - beta1) * d_p).named("m_new")
    v_new = (beta2 * v + (1 - beta2) * d_p * d_p).named("v_new")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (cc.sqrt(v_new) / cc.sqrt(bias_correction2) + eps).named("denom")
    p_new = (p - lr / bias_correction1 * (m_new / denom)).named("p_new")
    return cc.Program(
        "adam",
        [g, p, m, v, lr, beta1, beta2, eps, weight_decay, step],
        [cc.update(p, p_new), cc.update(m, m_new), cc.update(v, v_new)],
    )


def make_inputs(
    world: int, size: int = 4096, seed: int = 0, step: int = 1, dtype: torch.dtype = torch.float32
) -> dict:
    """Random simulator inputs: one gradient per rank, parameters, the moments of ``step``
    (zeros on step 1) and this example's hyper-parameters (``adam_family_inputs``)."""
    hyper = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
    return adam_family_inputs(world, size, seed, step, dtype, **hyper)


def reference(inputs: dict, steps: int = 1) -> dict[str, torch.Tensor]:
    """``steps`` steps of torch.optim.Adam from ``inputs``, each with the summed gradient:
    the new ``p``, ``m`` (torch's ``exp_avg``) and ``v`` (``exp_avg_sq``)."""
    return torch_adam_reference(torch.optim.Adam, inputs, steps)


def errors(world: int, size: int, steps: int = 3) -> tuple[float, float]:
    """Simulate ``steps`` steps (state fed back) and compare with the torch reference."""
    inputs = make_inputs(world, size)
    return max_errors(simulate_steps(program(), inputs, world, steps), reference(inputs, steps))


def check(world: int, size: int, steps: int = 3) -> float:
    """The max relative error of ``steps`` simulated steps vs torch.optim.Adam."""
    return errors(world, size, steps)[1]


def main() -> int:
    """Print the check on 2 and 4 virtual ranks; exit status 0 if within TOLERANCE."""
    return report("adam", errors, TOLERANCE, size=4096)


if __name__ == "__main__":
    if "--distributed" in sys.argv:  # under `coconet run --nproc N` or torchrun
        sys.exit(run_distributed(program(), SCHEDULES, lambda world: make_inputs(world, 4099)))
    sys.exit(main())
