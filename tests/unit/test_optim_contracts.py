"""torch's (and pytorch_optimizer's) optimizer contracts that coconet.optim refused or broke
silently (issue 42, items 4, 5, 12, 13), each against the library it stands in for, on one rank
(the multi-rank forms: tests/dist/test_dist_optim_dropin.py)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import coconet.optim
from coconet.errors import ConfigError
from coconet.options import CompileOptions

EAGER = CompileOptions(fused_kernels=False)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _loss(m: torch.nn.Module, k: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    x, y = torch.randn(6, 8, generator=g) * scale, torch.randn(6, 4, generator=g)
    return torch.nn.functional.mse_loss(m(x), y) * scale


# -- item 4: LAMB pre_norm scales the gradient in place, as Lamb does --------------------------


@pytest.mark.parametrize("maximize", [False, True])
def test_lamb_pre_norm_leaves_the_gradient_as_lamb_does(maximize):
    """pytorch_optimizer.Lamb(pre_norm=True) multiplies each gradient in place by the global
    factor (and negates it for maximize): gradients accumulated without zero_grad() afterwards
    start from those values. Before, coconet's left them as they were: at the second step the
    accumulated gradient differed by the factor (1e8 relative where it was 1e-8)."""
    import pytorch_optimizer

    ours_m, ref_m = _model(), _model()
    kwargs = {"lr": 1e-2, "pre_norm": True, "max_grad_norm": 1e-3, "maximize": maximize}
    ours = coconet.optim.LAMB(ours_m.parameters(), options=EAGER, **kwargs)
    ref = pytorch_optimizer.Lamb(ref_m.parameters(), foreach=False, **kwargs)
    for k in range(4):  # zero_grad only once: every step accumulates onto the last
        for m, o in ((ours_m, ours), (ref_m, ref)):
            if k == 0:
                o.zero_grad()
            _loss(m, k, scale=30.0).backward()
            o.step()
        for p, q in zip(ours_m.parameters(), ref_m.parameters(), strict=True):
            assert _rel(p.grad, q.grad) <= 1e-5, k
            assert _rel(p, q) <= 1e-5, k


# -- item 5: a state dict whose entry lacks a key torch's optimizer needs ----------------------


@pytest.mark.parametrize("missing", ["exp_avg_sq", "exp_avg", "step"])
def test_an_entry_missing_a_state_key_is_refused_as_torch_refuses_it(missing):
    m = _model()
    torch_opt = torch.optim.AdamW(m.parameters())
    _loss(m, 0).backward()
    torch_opt.step()
    sd = copy.deepcopy(torch_opt.state_dict())
    del sd["state"][1][missing]
    ours = coconet.optim.AdamW(_model().parameters(), options=EAGER)
    with pytest.raises(ConfigError, match=f"has no '{missing}'"):
        ours.load_state_dict(sd)
    assert len(ours.state) == 0  # nothing loaded


def test_a_parameter_without_an_entry_starts_afresh_as_in_torch():
    m = _model()
    torch_opt = torch.optim.AdamW(m.parameters())
    _loss(m, 0).backward()
    torch_opt.step()
    sd = copy.deepcopy(torch_opt.state_dict())
    del sd["state"][1]
    ours = coconet.optim.AdamW(_model().parameters(), options=EAGER)
    ours.load_state_dict(sd)
    params = [p for g in ours.param_groups for p in g["params"]]
    assert ours.state[params[1]] == {} and int(ours.state[params[0]]["step"]) == 1


# -- item 12: state-dict hooks and edits that write state ---------------------------------------


def _hooked(opt) -> None:
    # torch's own hooks (test/optim/test_optim.py, TestOptimRenewed's state-dict hook tests)
    def pre(optimizer):
        optimizer.state["test"] = 1

    def post(optimizer, state_dict):
        state_dict["ran_state_dict_pre_hook"] = "test" in state_dict["state"]
        state_dict["state"].pop("test", None)
        return state_dict

    def load_pre(optimizer, state_dict):
        state_dict = copy.deepcopy(state_dict)
        state_dict["param_groups"][0]["lr"] = 0.003
        return state_dict

    def load_post(optimizer):
        optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
        optimizer.state["ran_load_state_dict_post_hook"] = True

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(load_post)


def test_torch_state_dict_hooks_that_write_the_state_run_as_in_torch():
    got = {}
    for name, make in (("torch", torch.optim.AdamW),
                       ("coconet", lambda ps: coconet.optim.AdamW(ps, options=EAGER))):
        m = _model()
        opt = make(m.parameters())
        _hooked(opt)
        _loss(m, 0).backward()
        opt.step()
        sd = opt.state_dict()
        opt.load_state_dict(sd)
        got[name] = (sd["ran_state_dict_pre_hook"], "test" in sd["state"],
                     opt.state["ran_load_state_dict_pre_hook2"],
                     opt.state["ran_load_state_dict_post_hook"], opt.param_groups[0]["lr"])
    assert got["coconet"] == got["torch"] == (True, False, True, True, 0.003)


def test_writes_into_opt_state_reach_the_next_step_as_in_torch():
    """``opt.state[p][key] = t``, ``opt.state[p] = {...}`` and ``del opt.state[p]``, then a
    step: the same parameters as torch's AdamW given the same edits (before, the write went
    into a dict made for the read and was lost)."""
    results = []
    for make in (torch.optim.AdamW, lambda ps: coconet.optim.AdamW(ps, options=EAGER)):
        m = _model()
        opt = make(m.parameters())
        _loss(m, 0).backward()
        opt.step()
        w, b, w2, b2 = m.parameters()
        opt.state[w]["exp_avg"] = torch.full_like(w, 0.5)
        opt.state[w]["step"] = torch.tensor(7.0)
        opt.state[b] = {"step": torch.tensor(2.0), "exp_avg": torch.ones_like(b),
                        "exp_avg_sq": torch.full_like(b, 2.0)}
        del opt.state[w2]
        opt.state[b2]["note"] = "kept"
        opt.zero_grad()
        _loss(m, 1).backward()
        opt.step()
        results.append((m, opt))
    (ref, ref_opt), (ours, ours_opt) = results
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert _rel(p, q) <= 1e-6
    w, b, w2, b2 = ours.parameters()
    rw, rb, rw2, rb2 = ref.parameters()
    assert int(ours_opt.state[w]["step"]) == int(ref_opt.state[rw]["step"]) == 8
    assert int(ours_opt.state[w2]["step"]) == int(ref_opt.state[rw2]["step"]) == 1
    assert ours_opt.state[b2]["note"] == "kept"
    assert ours_opt.state_dict()["state"][3]["note"] == "kept"


def test_a_state_tensor_of_the_wrong_shape_is_refused():
    m = _model()
    opt = coconet.optim.AdamW(m.parameters(), options=EAGER)
    _loss(m, 0).backward()
    opt.step()
    w = next(m.parameters())
    with pytest.raises(ConfigError, match="must be a floating-point tensor of the parameter's"):
        opt.state[w]["exp_avg"] = torch.zeros(3)


# -- item 13: torch's defaults, Lamb's state keys -----------------------------------------------


def test_adam_and_adamw_signatures_and_defaults_are_torchs():
    assert inspect.signature(coconet.optim.Adam).parameters["decoupled_weight_decay"].default \
        is False  # fmt: skip
    m = _model()
    assert coconet.optim.Adam(m.parameters(), options=EAGER).defaults[
        "decoupled_weight_decay"] is torch.optim.Adam(m.parameters()).defaults[
        "decoupled_weight_decay"] is False  # fmt: skip
    assert coconet.optim.AdamW(m.parameters(), options=EAGER).defaults[
        "decoupled_weight_decay"] is True
    with pytest.raises(TypeError):
        torch.optim.AdamW(m.parameters(), decoupled_weight_decay=True)
    with pytest.raises(TypeError):
        coconet.optim.AdamW(m.parameters(), decoupled_weight_decay=True)


@pytest.mark.parametrize("adam", [False, True])
def test_lamb_keeps_lambs_per_parameter_diagnostics(adam):
    """weight_norm, adam_norm and trust_ratio in each parameter's state, as Lamb keeps them
    (its trust_ratio is the one it computed, also with adam=True); and in the state dict."""
    import pytorch_optimizer

    ours_m, ref_m = _model(), _model()
    # a model with several tensors of one size shares a step (one row each): both forms
    extra_o, extra_r = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    extra_r.load_state_dict(extra_o.state_dict())
    kwargs = {"lr": 1e-2, "weight_decay": 1e-2, "adam": adam}
    ours = coconet.optim.LAMB([*ours_m.parameters(), *extra_o.parameters()], options=EAGER,
                              **kwargs)  # fmt: skip
    ref = pytorch_optimizer.Lamb([*ref_m.parameters(), *extra_r.parameters()], foreach=False,
                                 **kwargs)  # fmt: skip
    for k in range(2):
        for m, e, o in ((ours_m, extra_o, ours), (ref_m, extra_r, ref)):
            o.zero_grad()
            (_loss(m, k) + e(torch.ones(2, 4)).sum()).backward()
            o.step()
    pairs = zip([*ours_m.parameters(), *extra_o.parameters()],
                [*ref_m.parameters(), *extra_r.parameters()], strict=True)
    for p, q in pairs:
        for key in ("weight_norm", "adam_norm", "trust_ratio"):
            assert _rel(ours.state[p][key], ref.state[q][key]) <= 1e-5, key
    saved = ours.state_dict()["state"][0]
    assert {"weight_norm", "adam_norm", "trust_ratio", "exp_avg", "exp_avg_sq"} <= set(saved)
