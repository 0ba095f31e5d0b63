"""Rank bodies for tests/dist/test_dist_optim_misuse.py: ``coconet.optim`` misused across ranks.

One table of misuse cases (issue 24), each run on every rank by ``misuse``: a fresh model and
optimizer, a healthy step or two, then the misuse (on every rank, or on one), timed from the
misusing call to its error on each rank. Each case records, per rank, the error (its class and
message, or None when the call was accepted), the seconds it took, and whether the parameters,
their step counts and the param groups are as they were before the call. After the table the
ranks take a healthy step and compare their parameters: the communicator survived every refusal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import coconet.optim
from coconet.errors import CoconetError
from coconet.options import CompileOptions
from coconet.runtime import Communicator

EAGER = CompileOptions(fused_kernels=False)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same model on every rank
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))


def _opt(comm: Communicator, params, **kw) -> coconet.optim.Adam:
    return coconet.optim.Adam(params, lr=1e-2, comm=comm, options=EAGER, **kw)


def _train(opt, model, comm: Communicator, k: int = 0) -> None:
    opt.zero_grad()
    x = torch.arange(8.0).reshape(2, 4) / (4 + comm.rank + k)
    model(x).pow(2).sum().backward()
    opt.step()


def _snapshot(opt) -> tuple:
    return (
        [p.detach().clone() for g in opt.param_groups for p in g["params"]],
        [list(b.steps) for b in opt.buckets],
        len(opt.param_groups),
        [len(g["params"]) for g in opt.param_groups],
        [{n: x.clone() for n, x in b.state.items()} for b in opt.buckets],
    )


def _same(a: tuple, b: tuple) -> bool:
    params_a, steps_a, n_a, lens_a, state_a = a
    params_b, steps_b, n_b, lens_b, state_b = b
    return (
        len(params_a) == len(params_b)
        and all(x.shape == y.shape and torch.equal(x, y)
                for x, y in zip(params_a, params_b, strict=True))
        and steps_a == steps_b and n_a == n_b and lens_a == lens_b
        and all(sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
                for sa, sb in zip(state_a, state_b, strict=True))
    )


def _timed(comm: Communicator, call: Callable[[], Any]) -> tuple[dict | None, float]:
    """Run the misusing ``call`` right after a barrier (so the ranks start together): its error
    (class, message, the whole text; None when accepted) and the seconds until it."""
    comm.barrier()
    start = time.monotonic()
    try:
        call()
    except CoconetError as e:
        err = {"class": type(e).__name__, "message": e.message, "text": str(e)}
        return err, time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - a raw error is an outcome the test refuses
        err = {"class": f"raw {type(e).__name__}", "message": str(e), "text": str(e)}
        return err, time.monotonic() - start
    return None, time.monotonic() - start


# -- the cases: each returns (error, seconds, unchanged) on this rank --------------------------


def _swapped_order(comm):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    params = list(model.parameters())
    if comm.rank == 1:
        params = params[2:] + params[:2]  # the same shapes, the other layer first
    err, s = _timed(comm, lambda: _opt(comm, params))
    return err, s, True


def _named_swapped(comm):
    model = _model()
    named = list(model.named_parameters())
    if comm.rank == 1:
        named[0], named[2] = (named[2][0], named[0][1]), (named[0][0], named[2][1])
    err, s = _timed(comm, lambda: _opt(comm, named))
    return err, s, True


def _with_state(comm, **kw):
    model = _model()
    opt = _opt(comm, model.parameters(), **kw)
    _train(opt, model, comm)
    _train(opt, model, comm, 1)
    return model, opt


def _load_edit(edit, ranks=(0, 1)):
    def case(comm):
        model, opt = _with_state(comm)
        sd = opt.state_dict()
        if comm.rank in ranks:
            edit(sd)
        before = _snapshot(opt)
        err, s = _timed(comm, lambda: opt.load_state_dict(sd))
        return err, s, _same(before, _snapshot(opt))

    return case


def _transpose(sd):
    e = sd["state"][2]  # the second Linear's weight, (3, 4)
    e["exp_avg"] = e["exp_avg"].t().contiguous()


def _one_element(sd):
    sd["state"][0]["exp_avg_sq"] = torch.ones(1)


def _wrong_numel(sd):
    sd["state"][1]["exp_avg"] = torch.ones(3)


def _missing_param(sd):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]
    sd["state"].pop(3, None)


def _unknown_param(sd):
    sd["state"][9] = dict(sd["state"][0])


def _edit_param_case(edit, ranks=(0, 1)):
    def case(comm):
        model, opt = _with_state(comm)
        flats = [b.flat.clone() for b in opt.buckets]
        steps = [list(b.steps) for b in opt.buckets]
        state = [{n: x.clone() for n, x in b.state.items()} for b in opt.buckets]
        if comm.rank in ranks:
            edit(model)

        def go():
            opt.zero_grad()
            p0 = next(model.parameters())
            x = (torch.arange(8.0).reshape(2, 4) / 5).to(p0.dtype)
            model(x).pow(2).sum().backward()
            opt.step()

        err, s = _timed(comm, go)
        same = (
            [list(b.steps) for b in opt.buckets] == steps
            and all(torch.equal(b.flat, f) for b, f in zip(opt.buckets, flats, strict=True))
            and all(torch.equal(b.state[n], st[n])
                    for b, st in zip(opt.buckets, state, strict=True) for n in st)
        )
        return err, s, same

    return case


def _reassign_data(model):
    w = model[0].weight
    w.data = w.data.clone()


def _reinit(model):
    # each rank draws its own values (a seed that depends on the rank): the ranks differ
    rank = torch.distributed.get_rank()
    model[1].weight.data = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))


def _grad_off(model):
    model[0].bias.requires_grad_(False)


def _to_double(model):
    model.double()


def _frozen_everywhere(comm):
    """Not a misuse: a parameter frozen on every rank mid-training is skipped, as torch skips a
    parameter without a gradient (error None; "unchanged": its value and step count)."""
    model, opt = _with_state(comm)
    model[0].bias.requires_grad_(False)
    bias = model[0].bias.detach().clone()
    steps = list(opt.buckets[0].steps)
    err, s = _timed(comm, lambda: _train(opt, model, comm))
    same = torch.equal(model[0].bias, bias) and opt.buckets[0].steps[1] == steps[1]
    return err, s, same and opt.buckets[0].steps[0] == steps[0] + 1


def _add_group(shapes_by_rank, ranks=(0, 1)):
    def case(comm):
        model, opt = _with_state(comm)
        before = _snapshot(opt)
        torch.manual_seed(1)
        extra = torch.nn.Parameter(torch.randn(shapes_by_rank[comm.rank]))

        def go():
            if comm.rank in ranks:
                opt.add_param_group({"params": [extra], "lr": 1e-3})
            else:
                _train(opt, model, comm)

        err, s = _timed(comm, go)
        return err, s, _same(before, _snapshot(opt))

    return case


def _steps_then_state_dict(extra_on_rank1: int):
    """Rank 1 skips a step (-1) or repeats one (+1) of a loop, then every rank checkpoints: the
    loop's steps pair up by count, so the ranks meet at the end, one in step() and the other in
    state_dict(). Timed over the loop (a few healthy steps) and the meeting."""

    def case(comm):
        model, opt = _with_state(comm)
        n = 3 + (extra_on_rank1 if comm.rank == 1 else 0)
        before: list[tuple] = []

        def go():
            for k in range(n):
                before[:] = [_snapshot(opt)]
                _train(opt, model, comm, k)
            before[:] = [_snapshot(opt)]
            opt.state_dict()

        err, s = _timed(comm, go)
        return err, s, _same(before[0], _snapshot(opt))

    return case


def _state_dict_while_step(comm):
    model, opt = _with_state(comm)
    before = _snapshot(opt)
    err, s = _timed(comm, (lambda: opt.state_dict()) if comm.rank == 1
                    else (lambda: _train(opt, model, comm)))
    return err, s, _same(before, _snapshot(opt))


def _state_dict_before_the_first_step(comm):
    """The peer's first step (its shapes not yet exchanged: a full exchange) meets a
    state_dict()."""
    model = _model()
    opt = _opt(comm, model.parameters())
    before = _snapshot(opt)
    err, s = _timed(comm, (lambda: opt.state_dict()) if comm.rank == 1
                    else (lambda: _train(opt, model, comm)))
    return err, s, _same(before, _snapshot(opt))


def _load_while_step(comm):
    model, opt = _with_state(comm)
    sd = opt.state_dict()
    before = _snapshot(opt)
    err, s = _timed(comm, (lambda: opt.load_state_dict(sd)) if comm.rank == 1
                    else (lambda: _train(opt, model, comm)))
    return err, s, _same(before, _snapshot(opt))


def _peer_shard(comm):
    model, opt = _with_state(comm)
    shards = comm.exchange(opt.sharded_state_dict(), "shards")
    before = _snapshot(opt)
    err, s = _timed(comm, lambda: opt.load_state_dict(shards[1 - comm.rank]))
    return err, s, _same(before, _snapshot(opt))


def _group_twice(comm):
    """Rank 1 adds a parameter the optimizer already holds (torch's own check refuses it)."""
    model, opt = _with_state(comm)
    before = _snapshot(opt)
    torch.manual_seed(1)
    extra = torch.nn.Parameter(torch.randn(2))
    again = [model[0].bias] if comm.rank == 1 else [extra]
    err, s = _timed(comm, lambda: opt.add_param_group({"params": again}))
    return err, s, _same(before, _snapshot(opt))


CASES: dict[str, Callable] = {
    "swapped same-shape parameters": _swapped_order,
    "named parameters in another order": _named_swapped,
    "load: a transposed tensor": _load_edit(_transpose),
    "load: a one-element tensor": _load_edit(_one_element),
    "load: a wrong number of elements": _load_edit(_wrong_numel),
    "load: a parameter missing": _load_edit(_missing_param),
    "load: state of an unknown parameter": _load_edit(_unknown_param),
    "load: a bad tensor on rank 1 only": _load_edit(_transpose, ranks=(1,)),
    "p.data replaced (rank 1)": _edit_param_case(_reassign_data, ranks=(1,)),
    "re-initialised by assignment, differently": _edit_param_case(_reinit),
    "requires_grad off (rank 0)": _edit_param_case(_grad_off, ranks=(0,)),
    "model.double() after construction": _edit_param_case(_to_double),
    "requires_grad off on every rank (accepted)": _frozen_everywhere,
    "add_param_group on rank 1 only": _add_group([(2,), (2,)], ranks=(1,)),
    "add_param_group with different shapes": _add_group([(2,), (3,)]),
    "add_param_group refused by torch on rank 1": _group_twice,
    "load: the other rank's shard": _peer_shard,
    "rank 1 skips a step": _steps_then_state_dict(-1),
    "rank 1 repeats a step": _steps_then_state_dict(+1),
    "state_dict while a peer steps": _state_dict_while_step,
    "load_state_dict while a peer steps": _load_while_step,
    "state_dict while a peer takes its first step": _state_dict_before_the_first_step,
}


def misuse(comm: Communicator, names: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model()  # a healthy warm-up (the first collectives set up their connections)
    opt = _opt(comm, model.parameters())
    _train(opt, model, comm)
    opt.state_dict()
    for name, case in CASES.items():
        if names is not None and name not in names:
            continue
        err, seconds, unchanged = case(comm)
        print(f"rank {comm.rank}: {name}: {seconds:.3f} s", file=sys.stderr, flush=True)
        out[name] = {"error": err, "seconds": seconds, "unchanged": unchanged}
    # the communicator is still usable: a healthy step, the same parameters on every rank
    model = _model()
    opt = _opt(comm, model.parameters())
    for k in range(2):
        _train(opt, model, comm, k)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = comm.exchange(flat, "compare the parameters")
    out["usable_after"] = all(torch.equal(every[0], f) for f in every)
    return out
