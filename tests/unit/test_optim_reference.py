"""The simulated optimizer examples against PyTorch: torch.optim.SGD / Adam / AdamW, and LAMB
against a plain-torch float64 reference written out here.

Every step draws new per-rank gradients; torch gets their sum (in rank order, as the simulator's
all_reduce adds them) as ``.grad``. State is compared after every step.
"""

import pytest
import torch
from support.examples_loader import load_example

import coconet as cc

STEPS = 5
SIZE = 257
TOLERANCE = 1e-6


def f32(x: float) -> float:
    """The float32 value a runtime scalar holds; torch gets the same value."""
    return float(torch.tensor(x, dtype=torch.float32))


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    return diff / scale if scale > 0 else diff


def rank_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    total = grads[0].clone()
    for g in grads[1:]:
        total = total + g
    return total


def sim_step(prog, state, grads, scalars, step, world):
    """One simulated step; returns the new state and checks every rank holds the same value."""
    result = cc.simulate(prog, {**state, "g": grads, **scalars, "step": step}, world)
    for name, per_rank in result.updates.items():
        for r in range(1, world):
            assert torch.equal(per_rank[r], per_rank[0]), f"{name} differs on rank {r}"
    return {name: result.updated(name) for name in result.updates}


# name -> (example, torch optimizer, hyper-parameters as torch takes them)
CASES = {
    "sgd_momentum_wd": ("sgd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-4)),
    "sgd_dampening": (
        "sgd",
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.8, dampening=0.25, weight_decay=1e-3),
    ),
    "sgd_plain": ("sgd", torch.optim.SGD, dict(lr=0.1, momentum=0.0, weight_decay=0.0)),
    "adam": ("adam", torch.optim.Adam, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)),
    "adam_l2": (
        "adam",
        torch.optim.Adam,
        dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    ),
    "adamw": ("adamw", torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)),
    "adamw_no_decay": ("adamw", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0)),
}
# the program's state inputs -> torch's state keys
STATE = {
    "sgd": {"buf": "momentum_buffer"},
    "adam": {"m": "exp_avg", "v": "exp_avg_sq"},
    "adamw": {"m": "exp_avg", "v": "exp_avg_sq"},
}


def torch_setup(cls, hyper: dict):
    """The hyper-parameters rounded to float32, for torch and as the program's scalars."""
    hyper = {k: tuple(map(f32, v)) if isinstance(v, tuple) else f32(v) for k, v in hyper.items()}
    defaults = {
        torch.optim.SGD: dict(momentum=0.0, dampening=0.0, weight_decay=0.0),
        torch.optim.Adam: dict(betas=(f32(0.9), f32(0.999)), eps=f32(1e-8), weight_decay=0.0),
    }
    defaults[torch.optim.AdamW] = {**defaults[torch.optim.Adam], "weight_decay": f32(1e-2)}
    hyper = {**defaults[cls], **hyper}
    scalars = dict(hyper)
    if "betas" in scalars:
        scalars["beta1"], scalars["beta2"] = scalars.pop("betas")
    return hyper, scalars


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optim(case, world):
    example, cls, hyper = CASES[case]
    hyper, scalars = torch_setup(cls, hyper)
    prog = load_example(example).program()
    gen = torch.Generator().manual_seed(world)
    p0 = torch.randn(SIZE, generator=gen)
    param = torch.nn.Parameter(p0.clone())
    opt = cls([param], **hyper, foreach=False)
    state = {"p": p0, **{name: torch.zeros(SIZE) for name in STATE[example]}}

    for step in range(1, STEPS + 1):
        grads = [torch.randn(SIZE, generator=gen) for _ in range(world)]
        param.grad = rank_sum(grads)
        opt.step()
        state = sim_step(prog, state, grads, scalars, step, world)

        assert rel_error(state["p"], param.detach()) <= TOLERANCE, f"p at step {step}"
        for name, key in STATE[example].items():
            if key in opt.state[param]:  # torch keeps no momentum buffer when momentum is 0
                err = rel_error(state[name], opt.state[param][key])
                assert err <= TOLERANCE, f"{name} at step {step}: {err:.2e}"


def test_sgd_first_step_ignores_the_buffer_input():
    """Step 1 starts the momentum buffer as a copy of the gradient, whatever buf holds."""
    sgd = load_example("sgd")
    inputs = sgd.make_inputs(2, 16)
    with_junk = {**inputs, "buf": torch.full((16,), 1e3), "dampening": 0.5}
    clean = {**inputs, "dampening": 0.5}
    a = cc.simulate(sgd.program(), with_junk, 2)
    b = cc.simulate(sgd.program(), clean, 2)
    assert torch.equal(a.updated("buf"), b.updated("buf"))
    assert torch.equal(a.updated("p"), b.updated("p"))


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lamb"])
@pytest.mark.parametrize("start", [1, 4])
def test_example_reference_and_check(name, start):
    """The examples' own check (state fed back over steps), also resuming at a later step."""
    example = load_example(name)
    if start == 1:
        assert example.check(3, 100, steps=5) <= example.TOLERANCE
        return
    inputs = example.make_inputs(3, 100, seed=1, step=start)
    state = dict(inputs)
    for _ in range(3):
        result = cc.simulate(example.program(), state, 3)
        state.update({k: result.updated(k) for k in result.updates})
        state["step"] += 1
    _, rel = example.max_errors(state, example.reference(inputs, steps=3))
    assert rel <= example.TOLERANCE


# ---------------------------------------------------------------------------------------------
# LAMB: no torch.optim class, so a textbook reference (You et al. 2020, Alg. 2) in float64


def lamb_float64(p, m, v, grad, step, lr, beta1, beta2, eps, weight_decay):
    p, m, v, grad = (t.double() for t in (p, m, v, grad))
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    r = (m / (1 - beta1**step)) / (torch.sqrt(v / (1 - beta2**step)) + eps)
    u = r + weight_decay * p
    w_norm, u_norm = p.norm(), u.norm()
    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else torch.tensor(1.0)
    return p - lr * trust * u, m, v


LAMB_HYPER = dict(lr=f32(1e-2), beta1=f32(0.9), beta2=f32(0.999), eps=f32(1e-6))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb_matches_float64_reference(world, weight_decay):
    prog = load_example("lamb").program()
    scalars = {**LAMB_HYPER, "weight_decay": f32(weight_decay)}
    gen = torch.Generator().manual_seed(10 + world)
    state = {"p": torch.randn(SIZE, generator=gen), "m": torch.zeros(SIZE), "v": torch.zeros(SIZE)}
    ref = dict(state)
    for step in range(1, STEPS + 1):
        grads = [torch.randn(SIZE, generator=gen) for _ in range(world)]
        state = sim_step(prog, state, grads, scalars, step, world)
        # Both start each step from the simulated state, so the float32 error does not compound.
        new = lamb_float64(ref["p"], ref["m"], ref["v"], rank_sum(grads), step, **scalars)
        for name, want in zip(("p", "m", "v"), new, strict=True):
            err = rel_error(state[name], want)
            assert err <= TOLERANCE, f"{name} at step {step}: {err:.2e}"
        ref = dict(state)


def test_lamb_trust_ratio_is_one_for_zero_weights():
    """||p|| = 0 (fresh zero weights): a plain step of lr * direction."""
    lamb = load_example("lamb")
    inputs = lamb.make_inputs(2, 32)
    inputs["p"] = torch.zeros(32)
    got = cc.simulate(lamb.program(), inputs, 2).updated("p")
    want = lamb.reference(inputs)["p"]
    assert rel_error(got, want) <= TOLERANCE
    # with zero weights the decay term vanishes and the step is -lr * the Adam direction, whose
    # first-step entries are +-1 / (1 + eps / |g|): about lr in magnitude
    assert torch.allclose(got.abs(), torch.full((32,), inputs["lr"]), rtol=1e-3)


def test_lamb_trust_ratio_is_one_for_zero_direction():
    """A zero gradient and zero decay: ||direction|| = 0, so no NaN and no change."""
    lamb = load_example("lamb")
    inputs = lamb.make_inputs(2, 32)
    inputs["g"] = [torch.zeros(32), torch.zeros(32)]
    inputs["weight_decay"] = 0.0
    got = cc.simulate(lamb.program(), inputs, 2).updated("p")
    assert torch.equal(got, inputs["p"])
