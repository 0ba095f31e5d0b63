"""coconet.optim.LocalSGD and OverlapLocalSGD on a world of one, in this process
(``runtime.init``): the plain-torch meaning of ``local_sgd_workers.reference`` bit for bit,
state dicts (the wrapped optimizer's alone too), the torch.optim face an LR scheduler needs, and
each refused argument. The ranks' averages are tests/dist/test_dist_local_sgd.py's."""

from __future__ import annotations

import pytest
import torch
from support import local_sgd_workers as w

import coconet.optim
from coconet import runtime
from coconet.errors import ConfigError
from coconet.options import CommOptions

OVERLAP = {"name": "overlap", "inner": "adamw", "period": 3, "pull": 0.4, "momentum": 0.5}
LOCAL = {"name": "local", "inner": "sgd", "period": 2, "warmup": 1}


@pytest.fixture(scope="module")
def comm():
    c = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    yield c
    runtime.shutdown(c)


@pytest.mark.parametrize("algo", [OVERLAP, LOCAL, {**OVERLAP, "momentum": 0.0}])
def test_one_rank_follows_the_plain_torch_algorithm(comm, algo):
    got = w.train(comm, algo, 9, resume_at=5)
    ref = w.reference(1, algo, 9)
    for mine, want in zip(got["params"], ref["params"][0], strict=True):
        for a, b in zip(mine, want, strict=True):
            assert torch.equal(torch.from_numpy(a), b)
    for a, b in zip(got["resumed"], got["params"][-1], strict=True):
        assert (a == b).all()
    assert got["losses"] == ref["losses"][0]


def test_a_world_of_one_overlap_pulls_toward_the_anchor(comm):
    """One rank: the average is the model itself, so a sync pulls the model toward the anchor
    of the sync before (not a no-op); Local SGD's average is."""
    net = w.model()
    opt = coconet.optim.OverlapLocalSGD(torch.optim.SGD(net.parameters(), lr=0.1), period=1,
                                        pull=0.5, comm=comm)  # fmt: skip
    start = [p.detach().clone() for p in net.parameters()]
    w.loss_of(net, 0, 0).backward()
    before = [p.detach().add(p.grad, alpha=-0.1) for p in net.parameters()]
    opt.step()
    for p, x, z in zip(net.parameters(), before, start, strict=True):
        assert torch.equal(p.detach(), torch.lerp(x, z, 0.5))


def test_the_torch_optimizer_face(comm):
    net = w.model()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    opt = coconet.optim.LocalSGD(inner, period=2, comm=comm)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    w.loss_of(net, 0, 0).backward()
    opt.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == 0.05
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    assert "the models averaged every 2 steps" in opt.explain()
    # a state dict of the wrapped optimizer alone loads: the count starts again at 0
    opt.steps = 5
    opt.load_state_dict(inner.state_dict())
    assert opt.steps == 0
    with pytest.raises(ConfigError, match="cannot be added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})


def test_a_state_dict_that_does_not_fit_is_refused(comm):
    opt = coconet.optim.OverlapLocalSGD(torch.optim.SGD(w.model().parameters(), lr=0.1),
                                        period=2, comm=comm)  # fmt: skip
    other = torch.nn.Linear(3, 3)
    small = coconet.optim.OverlapLocalSGD(torch.optim.SGD(other.parameters(), lr=0.1),
                                          period=2, comm=comm)  # fmt: skip
    with pytest.raises(ConfigError, match="anchor does not fit this model"):
        opt.load_state_dict(small.state_dict())


def test_a_state_dict_that_fails_to_load_changes_nothing(comm):
    """Its own part checked whole, and the wrapped optimizer's load, before anything moves."""
    net = w.model()
    opt = coconet.optim.OverlapLocalSGD(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                        period=2, momentum=0.5, comm=comm)  # fmt: skip
    for step in range(3):
        opt.zero_grad()
        w.loss_of(net, step, 0).backward()
        opt.step()
    before = opt.state_dict()
    saved = opt.state_dict()
    saved["local_sgd"] = {**saved["local_sgd"], "steps": 99,
                          "arrived": {k: torch.zeros(1) for k in saved["local_sgd"]["anchor"]}}
    with pytest.raises(ConfigError, match="arrived does not fit this model"):
        opt.load_state_dict(saved)  # the anchor and the step count before it fit
    wrong_inner = opt.state_dict()
    wrong_inner["local_sgd"] = {**wrong_inner["local_sgd"], "steps": 99}
    wrong_inner["param_groups"] = wrong_inner["param_groups"] * 2
    with pytest.raises(ValueError):  # torch's own refusal of the wrapped optimizer's part
        opt.load_state_dict(wrong_inner)
    after = opt.state_dict()
    assert after["local_sgd"]["steps"] == before["local_sgd"]["steps"] == 3
    for part in ("anchor", "velocity"):
        for k, v in before["local_sgd"][part].items():
            assert torch.equal(after["local_sgd"][part][k], v)


@pytest.mark.parametrize("kwargs, message", [
    ({"period": 0}, "period=0"), ({"period": 2.5}, "period=2.5"), ({"period": True}, "True"),
    ({"period": 2, "warmup_steps": -1}, "warmup_steps=-1"),
    ({"period": 2, "host_period": 0}, "host_period=0"),
])  # fmt: skip
def test_bad_periods_are_refused(comm, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        coconet.optim.LocalSGD(torch.optim.SGD(w.model().parameters(), lr=0.1), comm=comm,
                               **kwargs)  # fmt: skip


@pytest.mark.parametrize("kwargs, message", [
    ({"pull": 0.0}, "pull=0.0"), ({"pull": float("nan")}, "pull=nan"),
    ({"momentum": 1.0}, "momentum=1.0"), ({"momentum": -0.1}, "momentum=-0.1"),
])  # fmt: skip
def test_bad_pulls_and_momenta_are_refused(comm, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        coconet.optim.OverlapLocalSGD(torch.optim.SGD(w.model().parameters(), lr=0.1),
                                      period=2, comm=comm, **kwargs)  # fmt: skip
