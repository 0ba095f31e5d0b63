"""coconet.optim.agreement without processes: the call values the ranks compare and the errors
made from them (the same on every rank), and on a world of one the per-step check that a
parameter is still the view of its bucket, and load_state_dict's checks (every tensor's exact
shape, every parameter present) before anything changes. The cases across real ranks are in
tests/dist/test_dist_optim_misuse.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import coconet.optim
from coconet import runtime
from coconet.errors import ConfigError
from coconet.optim import agreement as identity
from coconet.optim.agreement import Call, CallKind
from coconet.options import CompileOptions
from coconet.runtime import CommOptions

EAGER = CompileOptions(fused_kernels=False)


@pytest.fixture(scope="module")
def comm():
    c = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    yield c
    runtime.shutdown(c)


def _texts(*calls: Call) -> list[str]:
    return [c.text() for c in calls]


def test_a_call_value_round_trips():
    c = Call(CallKind.LOAD_STATE_DICT, 7, "abc", "content", "it was refused")
    back = Call.parse(c.text())
    assert (back.kind, back.steps, back.digest, back.content, back.refusal) == (
        CallKind.LOAD_STATE_DICT, 7, "abc", "content", "it was refused")
    assert Call.parse(None) is None


def test_different_calls_name_both_ranks_calls():
    e = identity.mismatch_error(
        _texts(Call(CallKind.STEP, 3, "d"), Call(CallKind.STATE_DICT, 3, "d")), "op", "hint")
    assert isinstance(e, ConfigError)
    assert "rank 1 called state_dict (after 3 steps) while rank 0 called step" in e.message


def test_a_refusal_on_one_rank_is_named_on_every_rank():
    e = identity.mismatch_error(
        _texts(Call(CallKind.LOAD_STATE_DICT, 1, "d", "x"),
               Call(CallKind.LOAD_STATE_DICT, 1, "d", "", "bad shape")), "op", "the hint")
    assert e.message == "load_state_dict was refused on rank 1: bad shape"
    assert e.hint == "the hint"


def test_different_step_counts_are_a_skipped_or_repeated_step():
    e = identity.mismatch_error(
        _texts(Call(CallKind.STEP, 4, "d"), Call(CallKind.STEP, 3, "d")), "op", "hint")
    assert "skipped or repeated step()" in e.message


def test_different_groups_name_the_first_differing_parameter():
    a = json.dumps(["param group 1: hyper-parameters lr=0.1",
                    "param group 1, parameter 0: shape (2,), torch.float32"])
    b = json.dumps(["param group 1: hyper-parameters lr=0.1",
                    "param group 1, parameter 0: shape (3,), torch.float32"])
    e = identity.mismatch_error(
        _texts(Call(CallKind.ADD_PARAM_GROUP, 0, "d", a),
               Call(CallKind.ADD_PARAM_GROUP, 0, "d", b)), "op", "hint")
    assert e.message.startswith("the ranks hold different parameters: param group 1, "
                                "parameter 0: rank 0 has shape (2,)")


def test_only_the_digest_differing_is_left_to_the_caller():
    assert identity.mismatch_error(
        _texts(Call(CallKind.STEP, 1, "a"), Call(CallKind.STEP, 1, "b")), "op", "h") is None


def _model_and_opt(comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    opt = coconet.optim.Adam(model.parameters(), lr=1e-2, comm=comm, options=EAGER)
    return model, opt


def _train(model, opt):
    opt.zero_grad()
    model(torch.ones(2, 4).to(next(model.parameters()).dtype)).pow(2).sum().backward()
    opt.step()


def test_a_cast_parameter_is_refused_at_the_next_step(comm):
    """model.double() after the optimizer was built: coconet.optim steps float32 parameters
    (the DSL has no float64): refused, naming the parameter, nothing changed."""
    model, opt = _model_and_opt(comm)
    _train(model, opt)
    flat = opt.buckets[0].flat.clone()
    state = {k: v.clone() for k, v in opt.buckets[0].state.items()}
    model.double()
    opt.zero_grad()  # no torch error here (it used to be torch's grad-dtype error)
    with pytest.raises(ConfigError, match="param group 0, parameter") as info:
        _train(model, opt)
    assert "cast to torch.float64" in info.value.message
    assert "build a new optimizer" in info.value.hint
    assert torch.equal(opt.buckets[0].flat, flat) and opt.buckets[0].steps == [1] * 4
    assert all(torch.equal(opt.buckets[0].state[k], v) for k, v in state.items())


@pytest.mark.parametrize("edit", ["clone", "new values"])
def test_a_replaced_data_is_taken_in_again_as_torch_steps_it(comm, edit):
    """``p.data = ...`` after construction (a wrapper re-pointing the storage: accelerate's
    prepare; a re-initialisation by assignment): the next step takes the new values in and
    steps them, the parameter's state kept, as torch's optimizer (which holds the parameter
    object, whatever its .data) does."""
    model, opt = _model_and_opt(comm)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ref, ref_opt)):
        _train(m, o)
        torch.manual_seed(5)
        w = m[0].weight
        w.data = w.data.clone() if edit == "clone" else torch.randn(4, 4)
        for _ in range(2):
            _train(m, o)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert opt.buckets[0].detachment(0) is None  # a view of its bucket again
    assert opt.buckets[0].steps == [3] * 4


def test_a_parameter_frozen_after_construction_is_skipped_as_torch_skips_it(comm):
    model, opt = _model_and_opt(comm)
    _train(model, opt)
    model[0].bias.requires_grad_(False)  # no gradient from now on: torch skips it
    bias = model[0].bias.detach().clone()
    _train(model, opt)
    assert torch.equal(model[0].bias, bias) and opt.buckets[0].steps == [2, 1, 2, 2]


def test_writing_in_place_stays_attached(comm):
    model, opt = _model_and_opt(comm)
    with torch.no_grad():
        torch.nn.init.normal_(model[0].weight)  # in place: still the bucket's view
        model[1].bias.copy_(torch.ones(3))
    _train(model, opt)
    assert opt.buckets[0].steps == [1] * 4


def test_storage_the_optimizer_re_points_stays_attached(comm):
    """The check compares with the bucket the optimizer holds now (a storage mode that moves
    the parameters keeps them attached)."""
    model, opt = _model_and_opt(comm)
    b = opt.buckets[0]
    moved = b.flat.clone()
    b.flat = moved
    for i, p in enumerate(b.params):
        start, stop = b.span(i)
        p.data = moved[start:stop].view_as(p)
    assert all(b.detachment(i) is None for i in range(len(b.params)))
    _train(model, opt)
    assert b.steps == [1] * 4


def test_a_frozen_parameter_unfrozen_later_is_stepped_as_torch_steps_it(comm):
    """Gradual unfreezing (ULMFiT's recipe): a parameter that did not require grad when the
    optimizer was built and does later is packed then and stepped from its first gradient,
    as torch's optimizer steps it once it has one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = coconet.optim.Adam(model.parameters(), lr=1e-2, comm=comm, options=EAGER)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for k in range(4):
        if k == 2:
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        for m, o in ((model, opt), (ref, ref_opt)):
            _train(m, o)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert int(opt.state[model[0].weight]["step"]) == 2 == int(ref_opt.state[ref[0].weight]["step"])


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda sd: sd["state"][2].update(exp_avg=sd["state"][2]["exp_avg"].t()),
         "parameter 2 (shape (3, 4)) is Tensor (4, 3)"),
        (lambda sd: sd["state"][0].update(exp_avg_sq=torch.ones(1)), "is Tensor (1,)"),
        (lambda sd: sd["state"][1].update(exp_avg=torch.ones(3)), "is Tensor (3,)"),
        (lambda sd: sd["state"].__setitem__(9, sd["state"][0]), "parameter(s) [9]"),
    ],
    ids=["transposed", "one element", "wrong numel", "unknown parameter"],
)
def test_load_state_dict_checks_every_tensor_before_anything_changes(comm, edit, words):
    model, opt = _model_and_opt(comm)
    _train(model, opt)
    sd = opt.state_dict()
    _train(model, opt)
    before = {k: v.clone() for k, v in opt.buckets[0].state.items()}
    steps = list(opt.buckets[0].steps)
    lr = opt.param_groups[0]["lr"]
    sd["param_groups"][0]["lr"] = 0.5
    edit(sd)
    with pytest.raises(ConfigError, match="load_state_dict") as info:
        opt.load_state_dict(sd)
    assert words in info.value.message
    assert opt.buckets[0].steps == steps and opt.param_groups[0]["lr"] == lr
    assert all(torch.equal(opt.buckets[0].state[k], v) for k, v in before.items())
