"""Data-parallel AdamW (decoupled weight decay), written in the coconet DSL.

Each rank holds its own gradient ``g`` (Local); the data-parallel gradient is the sum over ranks
(``all_reduce`` with SUM), and the plain-PyTorch reference gets exactly that sum as ``.grad``.
The update is ``torch.optim.AdamW``'s (``amsgrad=False``, ``maximize=False``): the decay
shrinks the parameters directly instead of joining the gradient (Loshchilov & Hutter)::

    p_decayed = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g_sum
    v = beta2 * v + (1 - beta2) * g_sum * g_sum
    p = p_decayed - lr / (1 - beta1 ** step) * m / (sqrt(v) / sqrt(1 - beta2 ** step) + eps)

Every hyper-parameter and the step count (1 on the first step) is a runtime float32 ``Scalar``,
so one program serves every step; the bias corrections are computed in the program from
``step``. Because the program holds scalars in float32, ``make_inputs`` rounds the
hyper-parameters to float32 and the torch reference runs with those same values (torch would
otherwise compute ``1 - beta2`` from the double 0.999, which float32 cannot hold).

Inputs: ``g`` (Local); ``p``, ``m``, ``v`` (Replicated); scalars ``lr``, ``beta1``, ``beta2``,
``eps``, ``weight_decay``, ``step``.
Named nodes: ``g_sum`` (the gradient all_reduce), ``p_decayed``, ``m_new``, ``v_new``,
``denom``, ``p_new``. Updates: ``p``, ``m``, ``v``.

Run ``python examples/adamw.py`` to simulate it on 2 and 4 virtual ranks against
torch.optim.AdamW.
"""

from __future__ import annotations

import pathlib
import sys

import torch

import coconet as cc
from coconet.runtime import run_distributed
from coconet.schedule import AR_C, RS_C_AG, fuse_RS_C_AG

# Import the examples' shared checking code (examples/_harness.py) however this file is loaded.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import f32, max_errors, report, simulate_steps, sum_over_ranks  # noqa: E402

TOLERANCE = 1e-6  # max relative error vs torch.optim.AdamW in float32

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
WEIGHT_DECAY = 0.1  # larger than Adam's: decoupled decay is scaled by lr


def program(dtype: cc.DType = cc.float32) -> cc.Program:
    """One AdamW step over a flat parameter tensor ``p[N]``."""
    N = cc.Dim("N")
    g = cc.Tensor("g", dtype, [N], cc.Local)
    p, m, v = (cc.Tensor(name, dtype, [N], cc.Replicated) for name in ("p", "m", "v"))
    lr, beta1, beta2, eps, weight_decay, step = (
        cc.Scalar(name) for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "step")
    )

    g_sum = cc.all_reduce(g, name="g_sum")
    p_decayed = (p * (1 - lr * weight_decay)).named("p_decayed")
    m_new = (beta1 * m + (1 - beta1) * g_sum).named("m_new")
    v_new = (beta2 * v + (1 - beta2) * g_sum * g_sum).named("v_new")
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (cc.sqrt(v_new) / cc.sqrt(bias_correction2) + eps).named("denom")
    p_new = (p_decayed - lr / bias_correction1 * (m_new / denom)).named("p_new")
    return cc.Program(
        "adamw",
        [g, p, m, v, lr, beta1, beta2, eps, weight_decay, step],
        [cc.update(p, p_new), cc.update(m, m_new), cc.update(v, v_new)],
    )


def make_inputs(
    world: int, size: int = 4096, seed: int = 0, step: int = 1, dtype: torch.dtype = torch.float32
) -> dict:
    """Random simulator inputs: one gradient per rank, parameters, and the moments of ``step``.

    On step 1 the moments are zeros, as torch starts them; later steps get plausible random ones.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn() -> torch.Tensor:
        return torch.randn(size, generator=gen, dtype=torch.float32).to(dtype)

    first = step == 1
    return {
        "g": [randn() for _ in range(world)],
        "p": randn(),
        "m": torch.zeros(size, dtype=dtype) if first else 0.1 * randn(),
        "v": torch.zeros(size, dtype=dtype) if first else 0.01 * randn() ** 2,
        "lr": f32(LR),
        "beta1": f32(BETAS[0]),
        "beta2": f32(BETAS[1]),
        "eps": f32(EPS),
        "weight_decay": f32(WEIGHT_DECAY),
        "step": step,
    }


def reference(inputs: dict, steps: int = 1) -> dict[str, torch.Tensor]:
    """``steps`` steps of torch.optim.AdamW from ``inputs``, each with the summed gradient.

    Returns the new ``p``, ``m`` (torch's ``exp_avg``) and ``v`` (``exp_avg_sq``).
    """
    param = torch.nn.Parameter(inputs["p"].clone())
    opt = torch.optim.AdamW(
        [param],
        lr=inputs["lr"],
        betas=(inputs["beta1"], inputs["beta2"]),
        eps=inputs["eps"],
        weight_decay=inputs["weight_decay"],
        foreach=False,
    )
    if inputs["step"] > 1:  # resume from the given state, as if steps 1..step-1 had run
        opt.state[param] = {
            "step": torch.tensor(float(inputs["step"] - 1)),
            "exp_avg": inputs["m"].clone(),
            "exp_avg_sq": inputs["v"].clone(),
        }
    grad = sum_over_ranks(inputs["g"])
    for _ in range(steps):
        param.grad = grad.clone()
        opt.step()
    state = opt.state[param]
    return {"p": param.detach(), "m": state["exp_avg"], "v": state["exp_avg_sq"]}


def errors(world: int, size: int, steps: int = 3) -> tuple[float, float]:
    """Simulate ``steps`` steps (state fed back) and compare with the torch reference."""
    inputs = make_inputs(world, size)
    return max_errors(simulate_steps(program(), inputs, world, steps), reference(inputs, steps))


def check(world: int, size: int, steps: int = 3) -> float:
    """The max relative error of ``steps`` simulated steps vs torch.optim.AdamW."""
    return errors(world, size, steps)[1]


def main() -> int:
    """Print the check on 2 and 4 virtual ranks; exit status 0 if within TOLERANCE."""
    return report("adamw", errors, TOLERANCE, size=4096)


if __name__ == "__main__":
    if "--distributed" in sys.argv:  # under `coconet run --nproc N` or torchrun
        sys.exit(run_distributed(program(), SCHEDULES, lambda world: make_inputs(world, 4099)))
    sys.exit(main())
