"""Data-parallel LAMB (layer-wise adaptive moments), written in the coconet DSL.

Each rank holds its own gradient ``g`` (Local); the data-parallel gradient is the sum over ranks
(``all_reduce`` with SUM), and the plain-PyTorch reference gets exactly that sum as its gradient.

The variant is Algorithm 2 (LAMB) of You et al. 2020, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", with Adam's bias correction, decoupled weight decay inside
the trust-ratio direction, and the scaling function phi the identity::

    m = beta1 * m + (1 - beta1) * g_sum
    v = beta2 * v + (1 - beta2) * g_sum * g_sum
    adam_dir  = (m / (1 - beta1 ** step)) / (sqrt(v / (1 - beta2 ** step)) + eps)
    direction = adam_dir + weight_decay * p
    trust     = ||p|| / ||direction||, or 1.0 when either norm is 0
    p = p - lr * trust * direction

The program updates one tensor, so the trust ratio is per tensor (per layer): run one program per
parameter tensor. The norms are ``norm(...)`` of Replicated values here; a schedule that slices
the update must turn them into ``sqrt(all_reduce(sum(x * x)))``.

Every hyper-parameter and the step count (1 on the first step) is a runtime float32 ``Scalar``;
the bias corrections are computed in the program from ``step``. ``make_inputs`` rounds the
hyper-parameters to float32 so the reference runs with the values the program sees.

Inputs: ``g`` (Local); ``p``, ``m``, ``v`` (Replicated); scalars ``lr``, ``beta1``, ``beta2``,
``eps``, ``weight_decay``, ``step``.
Named nodes: ``g_sum`` (the gradient all_reduce), ``m_new``, ``v_new``, ``adam_dir``,
``direction``, ``p_norm``, ``dir_norm``, ``trust_ratio``, ``p_new``. Updates: ``p``, ``m``, ``v``.

Run ``python examples/lamb.py`` to simulate it on 2 and 4 virtual ranks against a plain-PyTorch
LAMB (torch has no LAMB optimizer; ``reference`` writes it out with torch ops).
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
    sum_over_ranks,
)

TOLERANCE = 1e-6  # max relative error vs the plain-PyTorch LAMB in float32

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
EPS = 1e-6
WEIGHT_DECAY = 1e-2


def program(dtype: cc.DType = cc.float32) -> cc.Program:
    """One LAMB step over one parameter tensor ``p[N]`` (one layer)."""
    N = cc.Dim("N")
    g = cc.Tensor("g", dtype, [N], cc.Local)
    p, m, v = (cc.Tensor(name, dtype, [N], cc.Replicated) for name in ("p", "m", "v"))
    lr, beta1, beta2, eps, weight_decay, step = (
        cc.Scalar(name) for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
    )

    g_sum = cc.all_reduce(g, name="g_sum")
    m_new = (beta1 * m + (1 - beta1) * g_sum).named("m_new")
    v_new = (beta2 * v + (1 - beta2) * g_sum * g_sum).named("v_new")
    m_hat = m_new / (1 - beta1**step)
    v_hat = v_new / (1 - beta2**step)
    adam_dir = (m_hat / (cc.sqrt(v_hat) + eps)).named("adam_dir")
    direction = (adam_dir + weight_decay * p).named("direction")
    p_norm = cc.norm(p).named("p_norm")
    dir_norm = cc.norm(direction).named("dir_norm")
    # A zero norm (fresh zero weights, or no update at all) falls back to a plain step.
    ratio = cc.where(dir_norm > 0, p_norm / dir_norm, 1.0)
    trust_ratio = cc.where(p_norm > 0, ratio, 1.0).named("trust_ratio")
    # Each scalar multiplies the tensor in turn: two scalars of different dtypes (lr is float32,
    # trust_ratio has the parameters' dtype) do not mix in the DSL.
    p_new = (p - lr * (trust_ratio * direction)).named("p_new")
    return cc.Program(
        "lamb",
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
    """``steps`` LAMB steps from ``inputs`` in plain PyTorch, each with the summed gradient.

    Written independently of the DSL program, the way a PyTorch user would: scalar arithmetic
    in Python floats, tensor arithmetic in torch. Returns the new ``p``, ``m`` and ``v``.
    """
    p, m, v = (inputs[name].clone() for name in ("p", "m", "v"))
    lr, beta1, beta2 = inputs["lr"], inputs["beta1"], inputs["beta2"]
    eps, weight_decay = inputs["eps"], inputs["weight_decay"]
    grad = sum_over_ranks(inputs["g"])
    for t in range(inputs["step"], inputs["step"] + steps):
        m = m.mul(beta1).add(grad, alpha=1 - beta1)
        v = v.mul(beta2).addcmul(grad, grad, value=1 - beta2)
        adam_dir = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
        direction = adam_dir + weight_decay * p
        p_norm = torch.linalg.vector_norm(p).item()
        dir_norm = torch.linalg.vector_norm(direction).item()
        trust = p_norm / dir_norm if p_norm > 0 and dir_norm > 0 else 1.0
        p = p - lr * trust * direction
    return {"p": p, "m": m, "v": v}


def errors(world: int, size: int, steps: int = 3) -> tuple[float, float]:
    """Simulate ``steps`` steps (state fed back) and compare with the torch reference."""
    inputs = make_inputs(world, size)
    return max_errors(simulate_steps(program(), inputs, world, steps), reference(inputs, steps))


def check(world: int, size: int, steps: int = 3) -> float:
    """The max relative error of ``steps`` simulated steps vs the plain-PyTorch LAMB."""
    return errors(world, size, steps)[1]


def main() -> int:
    """Print the check on 2 and 4 virtual ranks; exit status 0 if within TOLERANCE."""
    return report("lamb", errors, TOLERANCE, size=4096)


if __name__ == "__main__":
    if "--distributed" in sys.argv:  # under `coconet run --nproc N` or torchrun
        sys.exit(run_distributed(program(), SCHEDULES, lambda world: make_inputs(world, 4099)))
    sys.exit(main())
