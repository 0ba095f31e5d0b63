"""The checking harness the examples share; it knows nothing about any one workload.

Each example keeps what documents it: its DSL ``program``, ``make_inputs`` and the plain-PyTorch
``reference``. This module holds the rest, the same for all of them: float32 rounding of runtime
scalars, the reference's gradient sum, the error measure, the multi-step simulation loop and the
lines ``main`` prints; and, for the Adam family (Adam, AdamW, LAMB), the shared random inputs
and the ``torch.optim`` reference. The examples import it as ``_harness`` after putting their
own folder on ``sys.path`` (so it is found however an example is loaded: as a script, by
``coconet show`` or ``coconet run``, or by file path from the tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import coconet as cc


def f32(x: float) -> float:
    """The float32 value of ``x``: what a runtime scalar holds, so the reference can use it too."""
    return float(torch.tensor(x, dtype=torch.float32))


def sum_over_ranks(grads: list[torch.Tensor]) -> torch.Tensor:
    """The data-parallel gradient, summed in rank order like the simulator's all_reduce."""
    total = grads[0].clone()
    for g in grads[1:]:
        total = total + g
    return total


def max_errors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(max absolute error, max relative error) over the tensors of ``expected``.

    The relative error of a tensor is max|actual - expected| / max|expected|: element-wise ratios
    blow up where a value crosses zero, which says nothing about the update's accuracy.
    """
    abs_err = rel_err = 0.0
    for name, want in expected.items():
        if want.numel() == 0:
            continue
        diff = (actual[name].double() - want.double()).abs().max().item()
        scale = want.double().abs().max().item()
        abs_err = max(abs_err, diff)
        rel_err = max(rel_err, diff / scale if scale > 0 else diff)
    return abs_err, rel_err


def simulate_steps(program: cc.Program, inputs: dict, world: int, steps: int) -> dict:
    """The inputs after ``steps`` simulated steps of ``program`` on ``world`` virtual ranks.

    Each step's updated values are fed back as the next step's inputs, and the runtime scalar
    ``step`` counts up by one per step (it ends one past the last step simulated).
    """
    state = dict(inputs)
    for _ in range(steps):
        result = cc.simulate(program, state, world)
        state.update({name: result.updated(name) for name in result.updates})
        state["step"] += 1
    return state


def report(
    name: str,
    errors: Callable[[int, int], tuple[float, float]],
    tolerance: float,
    size: int,
    worlds: tuple[int, ...] = (2, 4),
) -> int:
    """An example's ``main``: ``errors(world, size)`` on each world size, one line printed each.

    Returns the exit status: 0 if every max relative error is within ``tolerance``, else 1.
    """
    ok = True
    for world in worlds:
        abs_err, rel_err = errors(world, size)
        good = rel_err <= tolerance
        ok &= good
        print(
            f"{name}  world={world}  max abs err {abs_err:.3e}  max rel err {rel_err:.3e}  "
            f"(tolerance {tolerance:.0e})  {'ok' if good else 'MISMATCH'}"
        )
    return 0 if ok else 1


def adam_family_inputs(
    world: int,
    size: int,
    seed: int,
    step: int,
    dtype: torch.dtype,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> dict:
    """Random inputs of an Adam-family program: one gradient per rank, parameters, the moments
    ``m`` and ``v`` of ``step``, and the hyper-parameters rounded to float32.

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
        "lr": f32(lr),
        "beta1": f32(betas[0]),
        "beta2": f32(betas[1]),
        "eps": f32(eps),
        "weight_decay": f32(weight_decay),
        "step": step,
    }


def torch_adam_reference(
    optimizer: type[torch.optim.Optimizer], inputs: dict, steps: int
) -> dict[str, torch.Tensor]:
    """``steps`` steps of ``torch.optim.Adam`` or ``AdamW`` from ``inputs``, each with the summed
    gradient; the new ``p``, ``m`` (torch's ``exp_avg``) and ``v`` (``exp_avg_sq``)."""
    param = torch.nn.Parameter(inputs["p"].clone())
    opt = optimizer(
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
