"""coconet.optim as a drop-in for torch.optim, on a world of one (this process, no spawning).

Adapted from PyTorch's own optimizer tests, CPU float32: the hyper-parameter sets are
``optim_inputs_func_sgd`` / ``optim_inputs_func_adam`` / ``optim_inputs_func_adamw`` (and the
``*_error_inputs_*`` ones) of ``torch/testing/_internal/common_optimizers.py`` (torch 2.13), the
tests are ``TestOptimRenewed`` of ``test/test_optim.py`` (named in each test's docstring). LAMB's
are adapted from pytorch_optimizer's own tests (``tests/constants.py``' Lamb entries,
``tests/test_optimizers.py``, ``tests/test_general_optimizer_parameters.py``), against
``pytorch_optimizer.Lamb``. Where torch compares with itself (a loss that goes the right way),
these compare every parameter with the torch optimizer's, stepped on the same gradients, within
``tolerances.OPTIM_RTOL``. Every case either passes or is a documented refusal: a CoconetError
naming the setting and saying what to do.

The 2-rank versions (sliced state, a parameter straddling two ranks' slices) are in
``tests/dist/test_dist_optim_dropin.py``.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.tolerances import OPTIM_RTOL

import coconet
import coconet.optim
from coconet import runtime
from coconet.errors import ConfigError, ConfigValueError, GradientError
from coconet.options import CompileOptions
from coconet.runtime import CommOptions

EAGER = CompileOptions(fused_kernels=False)  # the same programs, without torch.compile's cost
P = torch.nn.Parameter

# optim_inputs_func_* (CPU: the CUDA-only "capturable" and MPS-only "Tensor lr" entries left out)
ADAM_INPUTS = {
    "default": {},
    "non-default lr": {"lr": 0.01},
    "nonzero weight_decay": {"weight_decay": 0.1},
    "maximize": {"weight_decay": 0.1, "maximize": True},
}
SGD_INPUTS = {
    "default": {},
    "non-default lr": {"lr": 1e-2},
    "tensor lr": {"lr": torch.tensor(0.001)},
    "non-zero weight_decay": {"weight_decay": 0.5},
    "momentum": {"momentum": 0.9},
    "maximize": {"weight_decay": 0.1, "maximize": True},
    "dampening": {"momentum": 0.9, "dampening": 0.5},
    "weight_decay w/ momentum": {"momentum": 0.9, "weight_decay": 0.1},
    "nesterov": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
}
# torch's "global cliquey" kwargs: foreach and fused choose torch's implementation (accepted and
# ignored); differentiable is refused (below)
CLIQUEY = ({}, {"foreach": True}, {"foreach": False}, {"fused": True})
CASES = [
    *((name, desc, kw) for name in ("Adam", "AdamW") for desc, kw in ADAM_INPUTS.items()),
    *(("SGD", desc, kw) for desc, kw in SGD_INPUTS.items()),
    ("Adam", "decoupled_weight_decay (torch 2.13)", {"decoupled_weight_decay": True,
                                                    "weight_decay": 0.1}),
]
# pytorch_optimizer's tests/constants.py Lamb entries, 5 steps (those coconet refuses are in
# test_lamb_refuses_what_it_does_not_compute). Their lr is 1e0 on a logistic regression; on this
# quadratic loss a LAMB step of lr 1 (a step as long as |p|) overshoots, so lr 1e-1 (1e-2 for
# adam=True, whose first steps, without the second moment's bias correction, are ~30 lr long).
LAMB_INPUTS = {
    "weight_decay": {"lr": 1e-1, "weight_decay": 1e-3},
    "degenerated_to_sgd": {"lr": 1e-1, "weight_decay": 1e-3, "degenerated_to_sgd": True},
    "adam": {"lr": 1e-2, "weight_decay": 1e-3, "adam": True, "eps": 1e-8},
    "grad_averaging off": {"lr": 1e-1, "grad_averaging": False},
    "fixed_decay": {"lr": 1e-1, "weight_decay": 1e-2, "fixed_decay": True},
    "maximize": {"lr": 1e-1, "maximize": True},
}


@pytest.fixture(scope="module")
def comm():
    """A world of one in this process (coconet.runtime.init without torchrun's environment)."""
    c = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    yield c
    runtime.shutdown(c)


def _reference(name: str):
    if name == "LAMB":
        lamb = pytest.importorskip("pytorch_optimizer").Lamb
        return lambda params, **kw: lamb(params, foreach=False, **kw)
    return getattr(torch.optim, name)


def _twins(seed: int = 0, shapes=((10, 5), (10,), (3,))) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) for s in shapes]
    return [P(v.clone()) for v in values], [P(v.clone()) for v in values]


def _pair(comm, name: str, kwargs: dict, seed: int = 0, groups=None, options=EAGER):
    """coconet.optim.<name> and its reference over two equal sets of parameters."""
    ours, theirs = _twins(seed)
    o_params = groups(ours) if groups else ours
    t_params = groups(theirs) if groups else theirs
    o = getattr(coconet.optim, name)(o_params, comm=comm, options=options, **kwargs)
    t = _reference(name)(t_params, **kwargs)
    return ours, theirs, o, t


def _loss(params, x: torch.Tensor, used=None) -> torch.Tensor:
    """torch's test loss ((W x + b)^2 summed), plus the third parameter's; ``used`` picks which
    parameters take part (the others get no gradient)."""
    w, b, c = params
    used = used if used is not None else (True, True, True)
    out = torch.zeros(())
    if used[0] or used[1]:
        y = (w if used[0] else w.detach()).mv(x) + (b if used[1] else b.detach())
        out = out + y.pow(2).sum()
    if used[2]:
        out = out + (c * c.sin()).sum()
    return out


def _step_both(ours, theirs, o, t, steps: int, seed: int = 1, masks=None, scheds=(),
               x=None) -> None:
    """``steps`` steps of both on the same gradients: a new input each step, or ``x``."""
    gen = torch.Generator().manual_seed(seed)
    fixed = x
    for k in range(steps):
        x = torch.randn(5, generator=gen) if fixed is None else fixed
        used = masks[k % len(masks)] if masks else None
        for params, opt in ((ours, o), (theirs, t)):
            opt.zero_grad()
            if used is None or any(used):
                _loss(params, x, used).backward()
            opt.step()
        for sched in scheds:
            sched.step()


def _rel(ours, theirs) -> float:
    """The worst normwise relative error (max |a - b| / max |b|) over the tensors."""
    return max(
        ((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(ours, theirs, strict=True)
    )


# -- the update: TestOptimRenewed.test_forloop_goes_right_direction, against torch -------------


@pytest.mark.parametrize(("name", "desc", "kwargs"), CASES, ids=[f"{n}-{d}" for n, d, _ in CASES])
def test_forloop_goes_right_direction_and_matches_torch(comm, name, desc, kwargs):
    """TestOptimRenewed.test_forloop_goes_right_direction (the loss goes down, up for maximize),
    and every parameter equals torch's after 30 steps."""
    for cliquey in CLIQUEY:
        if name == "SGD" and cliquey.get("fused"):
            continue  # torch's fused SGD is CUDA only
        kw = {**kwargs, **cliquey}
        ours, theirs, o, t = _pair(comm, name, kw)
        x = torch.randn(5, generator=torch.Generator().manual_seed(7))
        before = _loss(ours, x).item()
        _step_both(ours, theirs, o, t, 30)
        after = _loss(ours, x).item()
        assert (after > before) if kw.get("maximize") else (after < before), (desc, cliquey)
        assert _rel(ours, theirs) <= OPTIM_RTOL, (desc, cliquey)


def test_the_compiled_step_matches_torch_too(comm):
    ours, theirs, o, t = _pair(comm, "AdamW", {"lr": 1e-2}, options=None)
    _step_both(ours, theirs, o, t, 20)
    assert _rel(ours, theirs) <= OPTIM_RTOL


def test_param_groups_weight_decay_and_lr_with_a_scheduler(comm):
    """TestOptimRenewed.test_param_groups_weight_decay, test_param_groups_lr and
    test_param_group_with_lrscheduler_goes_right_direction."""
    def groups(ps):
        return [{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.5, "lr": 3e-2}]

    for name, kw in (("Adam", {"lr": 1e-2}), ("AdamW", {}), ("SGD", {"lr": 1e-2,
                                                                      "momentum": 0.9})):
        ours, theirs, o, t = _pair(comm, name, kw, groups=groups)
        scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) for opt in (o, t)]
        _step_both(ours, theirs, o, t, 12, scheds=scheds)
        assert _rel(ours, theirs) <= OPTIM_RTOL, name
        assert o.param_groups[1]["lr"] == t.param_groups[1]["lr"]


def test_tensor_lr(comm):
    """TestOptimRenewed.test_tensor_lr (a 0-d tensor lr gives what the float gives)."""
    ours, theirs, o, t = _pair(comm, "Adam", {"lr": torch.tensor(0.01)})
    _step_both(ours, theirs, o, t, 10)
    assert _rel(ours, theirs) <= OPTIM_RTOL


# -- parameters without a gradient -------------------------------------------------------------


def test_a_parameter_without_a_gradient_is_not_stepped(comm):
    """The issue's repro: torch skips ``b`` at the second step (no decay, no moment change)."""
    for name in ("AdamW", "Adam", "SGD"):
        kw = {"lr": 0.1, "weight_decay": 0.1, **({"momentum": 0.9} if name == "SGD" else {})}
        pairs = []
        makers = (
            lambda ps, name=name, kw=kw: getattr(coconet.optim, name)(
                ps, comm=comm, options=EAGER, **kw),
            lambda ps, name=name, kw=kw: getattr(torch.optim, name)(ps, **kw),
        )
        for make in makers:
            a, b = P(torch.ones(4)), P(torch.ones(4))
            opt = make([a, b])
            (a.sum() + b.sum()).backward()
            opt.step()
            opt.zero_grad()
            a.sum().backward()
            opt.step()
            pairs.append((a, b, opt))
        (a, b, o), (ra, rb, t) = pairs
        assert _rel([a, b], [ra, rb]) <= OPTIM_RTOL, name
        if name != "SGD":
            assert o.state[b]["step"] == t.state[rb]["step"] == 1
            assert o.state[a]["step"] == t.state[ra]["step"] == 2
            torch.testing.assert_close(o.state[b]["exp_avg"], t.state[rb]["exp_avg"], rtol=0,
                                       atol=0)


def test_step_is_noop_when_params_have_no_grad(comm):
    """TestOptimRenewed.test_step_is_noop_when_params_have_no_grad: parameters that do not
    require grad are accepted and never stepped."""
    for name, inputs in (("Adam", ADAM_INPUTS), ("AdamW", ADAM_INPUTS), ("SGD", SGD_INPUTS)):
        params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
        old = [p.clone() for p in params]
        for kw in inputs.values():
            opt = getattr(coconet.optim, name)(params, comm=comm, options=EAGER, **kw)
            assert opt.step(lambda: torch.tensor([1.0])) == torch.tensor([1.0])
            assert all(torch.equal(p, q) for p, q in zip(params, old, strict=True))
            assert len(opt.state) == 0


def test_step_is_noop_for_zero_grads(comm):
    """TestOptimRenewed.test_step_is_noop_for_zero_grads (inputs without weight decay and
    maximize, whose zero gradient still moves the parameters)."""
    for name, inputs in (("Adam", ADAM_INPUTS), ("SGD", SGD_INPUTS)):
        for kw in inputs.values():
            if kw.get("weight_decay"):
                continue
            param = P(torch.randn(5, 1))
            old = param.detach().clone()
            opt = getattr(coconet.optim, name)([param], comm=comm, options=EAGER, **kw)
            param.grad = torch.zeros_like(param)
            opt.step()
            assert torch.equal(param.detach(), old), kw


def test_frozen_parameters_next_to_trainable_ones(comm):
    ours, theirs = _twins()
    for ps in (ours, theirs):
        ps[1].requires_grad_(False)
    o = coconet.optim.Adam(ours, comm=comm, options=EAGER, lr=1e-2)
    t = torch.optim.Adam(theirs, lr=1e-2)
    _step_both(ours, theirs, o, t, 5)
    assert _rel(ours, theirs) <= OPTIM_RTOL
    assert ours[1] not in o.state and len(o.state) == 2
    ours[1].grad = torch.ones(10)  # a gradient for the frozen one: refused, nothing stepped
    before = [p.detach().clone() for p in ours]
    with pytest.raises(GradientError, match="did not require grad when the optimizer was built"):
        o.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(ours, before, strict=True))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["Adam", "AdamW", "SGD"]),
    masks=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1,
                   max_size=6),
    weight_decay=st.sampled_from([0.0, 0.1]),
    zero_grad_to_none=st.booleans(),
)
def test_any_pattern_of_missing_gradients_matches_torch(comm, name, masks, weight_decay,
                                                        zero_grad_to_none):
    """Whatever parameters lack a gradient at each step (so their step counts drift apart and a
    bucket's parameters are at different steps), coconet steps what torch steps."""
    kw = {"lr": 1e-2, "weight_decay": weight_decay}
    if name == "SGD":
        kw["momentum"] = 0.9
    ours, theirs, o, t = _pair(comm, name, kw)
    gen = torch.Generator().manual_seed(3)
    for k in range(12):
        used = masks[k % len(masks)]
        x = torch.randn(5, generator=gen)
        for params, opt in ((ours, o), (theirs, t)):
            opt.zero_grad(set_to_none=zero_grad_to_none)
            if any(used):
                _loss(params, x, used).backward()
            opt.step()
    assert _rel(ours, theirs) <= OPTIM_RTOL
    if name != "SGD":
        for a, b in zip(ours, theirs, strict=True):
            assert (a in o.state) == (b in t.state)
            if b in t.state:
                assert int(o.state[a]["step"]) == int(t.state[b]["step"])
                assert _rel([o.state[a]["exp_avg_sq"]], [t.state[b]["exp_avg_sq"]]) <= OPTIM_RTOL


def test_a_failed_mixed_step_leaves_the_bucket_as_it_was(comm, monkeypatch):
    """A bucket at two step counts runs two fused steps; when the second fails, the first one's
    results are taken back too: parameters, state and step counts as before the step."""
    ours, theirs, o, t = _pair(comm, "Adam", {"lr": 1e-2, "weight_decay": 0.1})
    _step_both(ours, theirs, o, t, 3, masks=[(True, False, True)])  # the bias falls behind
    o.zero_grad()
    _loss(ours, torch.randn(5)).backward()
    params = [p.detach().clone() for p in ours]
    state = {i: {k: v.clone() for k, v in o.state[p].items()} for i, p in enumerate(ours)}
    calls = []
    real = o.stepper.run

    def second_fails(b, scalars, agree, plan):
        calls.append(scalars["step_size"])
        if len(calls) == 2:
            raise RuntimeError("the second step failed")
        return real(b, scalars, agree, plan)

    monkeypatch.setattr(o.stepper, "run", second_fails)
    with pytest.raises(RuntimeError, match="the second step failed"):
        o.step()
    assert len(calls) == 2 and calls[0] != calls[1]  # two step counts: two steps
    assert all(torch.equal(p.detach(), q) for p, q in zip(ours, params, strict=True))
    for i, p in enumerate(ours):
        assert set(o.state[p]) == set(state[i])
        assert all(torch.equal(o.state[p][k], v) for k, v in state[i].items())
    monkeypatch.setattr(o.stepper, "run", real)
    o.step()  # and it steps as torch once it succeeds
    t.zero_grad()
    for p, q in zip(theirs, ours, strict=True):
        p.grad = q.grad.clone()
    t.step()
    assert _rel(ours, theirs) <= OPTIM_RTOL


def test_gradients_assigned_or_set_to_none_count_as_torch_counts_them(comm):
    ours, theirs, o, t = _pair(comm, "Adam", {"lr": 1e-2, "weight_decay": 0.1})
    gen = torch.Generator().manual_seed(5)
    for k in range(6):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for params, opt in ((ours, o), (theirs, t)):
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if (i + k) % 3 == 0 else g.clone()
            opt.step()
    assert _rel(ours, theirs) <= OPTIM_RTOL
    # a zero_grad(set_to_none=False) keeps a gradient (zero), which is stepped: decay applies
    o.zero_grad(set_to_none=False)
    t.zero_grad(set_to_none=False)
    for p in theirs:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # torch keeps None where it was None
    for p in ours:
        p.grad = torch.zeros_like(p)
    o.step()
    t.step()
    assert _rel(ours, theirs) <= OPTIM_RTOL


# -- state, state dicts, hooks ----------------------------------------------------------------


def test_non_empty_state_is_torchs_state(comm):
    """TestOptimRenewed.test_non_empty_state; ``opt.state[p]`` holds torch's keys and values (a
    world of one: whole tensors shaped like the parameter)."""
    for name, kw in (("Adam", {"lr": 1e-2}), ("SGD", {"momentum": 0.9})):
        ours, theirs, o, t = _pair(comm, name, kw)
        assert len(o.state) == 0 and o.state[ours[0]] == {}
        _step_both(ours, theirs, o, t, 3)
        assert len(o.state) == 3 and all(p in o.state for p in ours)
        for a, b in zip(ours, theirs, strict=True):
            assert set(o.state[a]) <= set(t.state[b]) and o.state[a]
            for key, value in o.state[a].items():
                ref = t.state[b][key]
                assert value.shape == ref.shape, key
                assert _rel([value.float()], [ref.float()]) <= OPTIM_RTOL, key
            assert o.state_range(a) == (0, a.numel())


def test_state_dict_deterministic_and_weights_only(comm):
    """TestOptimRenewed.test_state_dict_deterministic and
    test_save_load_equality_with_weights_only: a reloaded optimizer continues exactly (the same
    compiled program on the same values: bitwise)."""
    ours, theirs, o, t = _pair(comm, "AdamW", {"lr": 1e-2})
    _step_both(ours, theirs, o, t, 3)
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    clones = [P(p.detach().clone()) for p in ours]
    o2 = coconet.optim.AdamW(clones, comm=comm, options=EAGER, lr=1e-2)
    o2.load_state_dict(loaded)
    _step_both(ours, clones, o, o2, 4, seed=9)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(ours, clones, strict=True))
    sd = o.state_dict()
    assert sd["param_groups"][0]["params"] == [0, 1, 2] and set(sd["state"]) == {0, 1, 2}


def test_can_load_older_state_dict_and_a_non_tensor_step(comm):
    """TestOptimRenewed.test_can_load_older_state_dict (keys an older torch did not save) and
    test_load_nontensor_step (a Python number as step)."""
    ours, theirs, o, t = _pair(comm, "Adam", {"lr": 1e-2})
    _step_both(ours, theirs, o, t, 3)
    sd = copy.deepcopy(t.state_dict())
    for group in sd["param_groups"]:
        for key in ("foreach", "fused", "maximize", "capturable", "differentiable",
                    "decoupled_weight_decay"):
            group.pop(key, None)
    for entry in sd["state"].values():
        entry["step"] = float(entry["step"])
    o2 = coconet.optim.Adam([P(p.detach().clone()) for p in theirs], comm=comm, options=EAGER,
                            lr=1e-2)
    o2.load_state_dict(sd)
    ours2 = [p for g in o2.param_groups for p in g["params"]]
    _step_both(ours2, theirs, o2, t, 3, seed=4)
    assert _rel(ours2, theirs) <= OPTIM_RTOL


def test_a_torch_checkpoint_with_different_step_counts_loads(comm):
    ours, theirs, o, t = _pair(comm, "Adam", {"lr": 1e-2})
    _step_both(ours, theirs, o, t, 4, masks=[(True, True, True), (True, False, True)])
    steps = sorted(int(e["step"]) for e in t.state_dict()["state"].values())
    assert len(set(steps)) == 2
    fresh = [P(p.detach().clone()) for p in theirs]
    o2 = coconet.optim.Adam(fresh, comm=comm, options=EAGER, lr=1e-2)
    o2.load_state_dict(t.state_dict())
    _step_both(fresh, theirs, o2, t, 3, seed=6)
    assert _rel(fresh, theirs) <= OPTIM_RTOL
    assert sorted(int(e["step"]) for e in o2.state_dict()["state"].values()) == sorted(
        int(e["step"]) for e in t.state_dict()["state"].values())


def test_a_sharded_checkpoint_keeps_per_parameter_steps(comm):
    ours, theirs, o, t = _pair(comm, "Adam", {"lr": 1e-2})
    _step_both(ours, theirs, o, t, 3, masks=[(True, False, True)])
    shard = o.sharded_state_dict()
    merged = coconet.optim.merge_shards([shard])
    assert set(merged["state"]) == {0, 2}  # the parameter never stepped has no state
    fresh = [P(p.detach().clone()) for p in ours]
    o2 = coconet.optim.Adam(fresh, comm=comm, options=EAGER, lr=1e-2)
    o2.load_state_dict(shard)
    assert [int(o2.state[p]["step"]) for p in (fresh[0], fresh[2])] == [3, 3]
    assert o2.state[fresh[1]] == {}


def test_state_dict_hooks_run_as_torchs(comm):
    """TestOptimRenewed.test_optimizer_state_dict_pre_hook / post_hook,
    test_optimizer_load_state_dict_pre_hook / post_hook / pre_post_hook."""
    ours, theirs, o, t = _pair(comm, "SGD", {"lr": 1e-2, "momentum": 0.9})
    _step_both(ours, theirs, o, t, 1)
    calls = []

    def pre(opt):
        calls.append("pre")
        opt.param_groups[0]["lr"] = 0.5  # torch's test: a pre-hook's change is saved

    def post(opt, sd):
        calls.append("post")
        sd["extra"] = "x"
        return sd

    o.register_state_dict_pre_hook(pre)
    o.register_state_dict_post_hook(post)
    sd = o.state_dict()
    assert calls == ["pre", "post"] and sd["extra"] == "x"
    assert sd["param_groups"][0]["lr"] == 0.5

    def load_pre(opt, sd):
        calls.append("load_pre")
        sd = dict(sd)
        sd["param_groups"] = copy.deepcopy(sd["param_groups"])
        sd["param_groups"][0]["lr"] = 0.002
        return sd

    def load_post(opt):
        calls.append("load_post")
        opt.param_groups[0]["momentum"] = 0.5

    o2 = coconet.optim.SGD([P(p.detach().clone()) for p in ours], comm=comm, options=EAGER,
                           lr=1e-2, momentum=0.9)
    o2.register_load_state_dict_pre_hook(load_pre)
    o2.register_load_state_dict_post_hook(load_post)
    o2.load_state_dict(sd)
    assert calls[-2:] == ["load_pre", "load_post"]
    assert o2.param_groups[0]["lr"] == 0.002 and o2.param_groups[0]["momentum"] == 0.5


def test_step_hooks_and_printing(comm):
    """TestOptimRenewed.test_step_all_hooks and test_optimizer_can_be_printed."""
    ours, _, o, _ = _pair(comm, "Adam", {})
    calls = []
    o.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    o.register_step_post_hook(lambda opt, args, kwargs: calls.append(2))
    o.step()
    assert calls == [1, 2]
    assert repr(o).startswith("Adam (") and "lr: 0.001" in repr(o)


# -- refusals: documented, clear ----------------------------------------------------------------


def test_errors_are_torchs_errors(comm):
    """TestOptimRenewed.test_errors over optim_error_inputs_func_{sgd,adam} (CPU): the same
    exception classes (a ConfigValueError is a ValueError) and torch's messages."""
    sample = P(torch.randn(1, 1))
    cases = [
        ("Adam", {"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ("Adam", {"lr": 1e-2, "betas": (1.0, 0.0)}, ValueError,
         "Invalid beta parameter at index 0: 1.0"),
        ("AdamW", {"lr": 1e-2, "weight_decay": -1}, ValueError, "Invalid weight_decay value: -1"),
        ("Adam", {"lr": 1e-2, "eps": -1.0}, ValueError, "Invalid epsilon value: -1.0"),
        ("Adam", {"lr": torch.tensor([0.001, 0.001])}, ValueError, "Tensor lr must be 1-element"),
        ("Adam", {"lr": 1e-2, "betas": (0.9, torch.tensor(0.99))}, ValueError,
         "betas must be either both floats or both Tensors"),
        ("SGD", {"lr": 1e-2, "momentum": -0.5}, ValueError, "Invalid momentum value: -0.5"),
        ("SGD", {"lr": 1e-2, "nesterov": True}, ValueError, "Nesterov momentum requires"),
    ]
    for name, kw, cls, text in cases:
        with pytest.raises(cls, match=text) as info:
            getattr(coconet.optim, name)([sample], comm=comm, options=EAGER, **kw)
        assert isinstance(info.value, ConfigValueError) and info.value.hint
    # torch's own checks of the params argument, unchanged
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        coconet.optim.Adam(sample, comm=comm)
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        coconet.optim.Adam([{"params": [sample]}, {"params": [sample]}], comm=comm)


def test_unsupported_flags_are_refused_wherever_they_come_from(comm):
    ps = [P(torch.randn(3))]
    for kw in ({"amsgrad": True}, {"differentiable": True}, {"capturable": True}):
        flag = next(iter(kw))
        with pytest.raises(ConfigError, match=f"{flag}=True is not supported"):
            coconet.optim.Adam(ps, comm=comm, **kw)
        with pytest.raises(ConfigError, match=rf"{flag}=True is not supported \(param group 0\)"):
            coconet.optim.Adam([{"params": ps, **kw}], comm=comm)
    # in a loaded checkpoint: refused before anything changes
    o = coconet.optim.Adam(ps, comm=comm, options=EAGER, lr=1e-2)
    ref = torch.optim.Adam([P(ps[0].detach().clone())], lr=1e-2, amsgrad=True)
    ref.param_groups[0]["params"][0].grad = torch.ones(3)
    ref.step()
    with pytest.raises(ConfigError, match="amsgrad=True is not supported") as info:
        o.load_state_dict(ref.state_dict())
    assert "state dict" in info.value.message and info.value.hint
    assert o.param_groups[0]["amsgrad"] is False and len(o.state) == 0
    # torch's decoupled Adam (AdamW's update) is honoured, from a checkpoint too
    adamw = torch.optim.AdamW([P(torch.randn(3))], lr=1e-2)
    o.load_state_dict(adamw.state_dict())
    assert o.param_groups[0]["decoupled_weight_decay"] is True


def test_sparse_gradients_are_refused_as_torch_refuses_them(comm):
    p = P(torch.randn(4))
    o = coconet.optim.Adam([p], comm=comm, options=EAGER)
    before = p.detach().clone()
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients") as info:
        o.step()
    assert isinstance(info.value, GradientError) and info.value.hint
    assert torch.equal(p.detach(), before) and len(o.state) == 0
    p.grad = torch.ones(4)  # the optimizer is usable after it
    o.step()
    assert not torch.equal(p.detach(), before)


def test_deepcopy_and_pickle_are_refused_clearly(comm):
    """TestOptimRenewed.test_deepcopy_copies_all_public_attrs: refused (a communicator and
    compiled steps cannot be copied); the hint says to go through the state dict."""
    o = coconet.optim.Adam([P(torch.randn(3))], comm=comm, options=EAGER)
    for attempt in (lambda: copy.deepcopy(o), lambda: pickle.dumps(o), lambda: copy.copy(o)):
        with pytest.raises(ConfigError, match="cannot be copied or pickled") as info:
            attempt()
        assert "state_dict" in info.value.hint


def test_comm_defaults_to_the_runtime_world(comm):
    a = P(torch.ones(4))
    o = coconet.optim.AdamW([a], lr=0.1, options=EAGER)  # no comm=
    assert o.comm is runtime.current()
    a.sum().backward()
    o.step()
    assert torch.all(a.detach() < 1)
    with pytest.raises(ConfigError, match="needs a communicator"):
        coconet.optim.AdamW([a], comm="gloo")


# -- LAMB against pytorch_optimizer.Lamb --------------------------------------------------------


@pytest.mark.parametrize("desc", list(LAMB_INPUTS))
def test_lamb_matches_pytorch_optimizer(comm, desc):
    """pytorch_optimizer's test_f32_optimizers over its Lamb entries: the loss goes down (up for
    maximize), and the parameters equal Lamb's."""
    kw = LAMB_INPUTS[desc]
    ours, theirs, o, t = _pair(comm, "LAMB", kw)
    x = torch.randn(5, generator=torch.Generator().manual_seed(7))
    before = _loss(ours, x).item()
    _step_both(ours, theirs, o, t, 5, x=x)  # one dataset, as pytorch_optimizer's test trains
    after = _loss(ours, x).item()
    assert (after > before) if kw.get("maximize") else (after < before)
    assert _rel(ours, theirs) <= OPTIM_RTOL


def test_lamb_skips_parameters_without_a_gradient_as_lamb(comm):
    """pytorch_optimizer's test_no_gradients: parameters without a gradient are skipped, the
    group's step counts on."""
    ours, theirs, o, t = _pair(comm, "LAMB", {"lr": 1e-1, "weight_decay": 1e-2})
    _step_both(ours, theirs, o, t, 6, masks=[(True, False, True), (False, True, True),
                                             (True, True, True), (False, False, False)])
    assert _rel(ours, theirs) <= OPTIM_RTOL
    assert o.param_groups[0]["step"] == t.param_groups[0]["step"] == 6


def test_lamb_checkpoints_move_to_and_from_pytorch_optimizer(comm):
    kw = {"lr": 1e-1, "weight_decay": 1e-2}
    ours, theirs, o, t = _pair(comm, "LAMB", kw)
    _step_both(ours, theirs, o, t, 3)
    lamb = _reference("LAMB")
    # coconet -> Lamb
    into_lamb = [P(p.detach().clone()) for p in ours]
    t2 = lamb(into_lamb, **kw)
    t2.load_state_dict(o.state_dict())
    # Lamb -> coconet
    into_ours = [P(p.detach().clone()) for p in theirs]
    o2 = coconet.optim.LAMB(into_ours, comm=comm, options=EAGER, **kw)
    o2.load_state_dict(t.state_dict())
    assert o2.param_groups[0]["step"] == 3
    _step_both(into_ours, into_lamb, o2, t2, 3, seed=8)  # bias correction continues at step 4
    _step_both(ours, theirs, o, t, 3, seed=8)
    assert _rel(into_ours, theirs) <= OPTIM_RTOL
    assert _rel(into_lamb, theirs) <= OPTIM_RTOL


def test_lamb_refuses_what_it_does_not_compute(comm):
    """pytorch_optimizer's entries coconet does not compute (rectify, L2 decay, AdaNorm)
    and its test_general_optimizer_parameters' ranges: refused, in the constructor, a group and
    a loaded state dict."""
    ps = [P(torch.randn(3))]
    for kw, text in (({"rectify": True}, "rectify=True is not supported"),
                     ({"weight_decouple": False}, "weight_decouple=False"),
                     ({"max_grad_norm": -0.1}, "Invalid max_grad_norm: -0.1"),
                     ({"lr": -1e-2}, "Invalid learning rate"),
                     ({"betas": (0.9, 1.1)}, "Invalid beta parameter at index 1"),
                     ({"eps": -1e-6}, "Invalid epsilon value"),
                     ({"weight_decay": -1e-3}, "Invalid weight_decay value")):
        with pytest.raises(ConfigError, match=text) as info:
            coconet.optim.LAMB(ps, comm=comm, **kw)
        assert info.value.hint
    for group in ({"rectify": True}, {"weight_decouple": False}, {"adanorm": True}):
        with pytest.raises(ConfigError, match="not supported"):
            coconet.optim.LAMB([{"params": ps, **group}], comm=comm)
    o = coconet.optim.LAMB(ps, comm=comm, options=EAGER)
    sd = o.state_dict()
    sd["param_groups"][0]["rectify"] = True
    with pytest.raises(ConfigError, match=r"rectify=True is not supported \(param group 0 of "):
        o.load_state_dict(sd)
    assert o.param_groups[0]["rectify"] is False


def test_param_storage_is_checked_and_one_rank_keeps_its_own_copy(comm):
    """``param_storage=``: a ``ParamStorage`` or its value; on a world of one the host's copy is
    the rank's own (nothing to share), and the step is torch's."""
    from coconet.errors import ConfigError

    w = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ConfigError, match="param_storage='shared' is not one of"):
        coconet.optim.Adam([w], comm=comm, param_storage="shared")
    ref = torch.nn.Parameter(w.detach().clone())
    opt = coconet.optim.Adam([w], lr=1e-2, comm=comm, param_storage="host-shared")
    ropt = torch.optim.Adam([ref], lr=1e-2)
    for k in range(3):
        g = torch.full((5,), float(k + 1))
        w.grad = g.clone()
        ref.grad = g.clone()
        opt.step()
        ropt.step()
    assert opt.buckets[0].replica is None
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=OPTIM_RTOL, atol=0)
