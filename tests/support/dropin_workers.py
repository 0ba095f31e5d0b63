"""Rank bodies for test_dist_optim_dropin.py: coconet.optim as a drop-in on real ranks.

The cases of tests/unit/test_optim_dropin.py (torch's TestOptimRenewed CPU float32 inputs,
pytorch_optimizer's Lamb entries) on 2 ranks, where the state is sliced and the first parameter
(50 of the 63 values) straddles the two ranks' slices. Every rank computes the reference itself:
the torch optimizer stepped on the average of every rank's gradient, a parameter without a
gradient on any rank left ``None`` (torch skips it), one without a gradient on some ranks
averaged with zeros there (what DDP computes). Everything is batched into one spawned group.
"""

from __future__ import annotations

import io

import torch

import coconet.optim
from coconet.errors import CoconetError, GradientError
from coconet.options import CompileOptions
from coconet.runtime import Communicator

EAGER = CompileOptions(fused_kernels=False)
P = torch.nn.Parameter
SHAPES = ((10, 5), (10,), (3,))


def _values(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _loss(params, x: torch.Tensor, used) -> torch.Tensor:
    """The unit tier's loss: ``used`` picks which parameters take part."""
    w, b, c = params
    out = torch.zeros(())
    if used[0] or used[1]:
        y = (w if used[0] else w.detach()).mv(x) + (b if used[1] else b.detach())
        out = out + y.pow(2).sum()
    if used[2]:
        out = out + (c * c.sin()).sum()
    return out


def _reference(name: str):
    if name == "LAMB":
        import pytorch_optimizer

        return lambda params, **kw: pytorch_optimizer.Lamb(params, foreach=False, **kw)
    return getattr(torch.optim, name)


def _inputs(world: int, k: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    return [torch.randn(5, generator=gen) for _ in range(world)]


def _reference_grads(params, world: int, k: int, used_by_rank) -> None:
    """params' .grad: the average over ranks of each rank's gradient (zero where a rank has
    none), None where no rank has one."""
    total: list[torch.Tensor | None] = [None] * len(params)
    for r, x in enumerate(_inputs(world, k)):
        used = used_by_rank[r]
        for p in params:
            p.grad = None
        if any(used):
            _loss(params, x, used).backward()
        for i, p in enumerate(params):
            if p.grad is not None:
                total[i] = p.grad.clone() if total[i] is None else total[i] + p.grad
    for p, g in zip(params, total, strict=True):
        p.grad = None if g is None else g / world


def _rel(ours, theirs) -> float:
    return max(
        ((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(ours, theirs, strict=True)
    )


def _run(comm, name, kwargs, steps, masks=None, options=EAGER, set_to_none=True):
    """``steps`` steps of coconet.optim.<name> and its reference; ``masks[k][r]`` says which
    parameters rank r uses at step k (all, by default)."""
    ours = [P(v.clone()) for v in _values()]
    theirs = [P(v.clone()) for v in _values()]
    o = getattr(coconet.optim, name)(ours, comm=comm, options=options, **kwargs)
    t = _reference(name)(theirs, **kwargs)
    _train(comm, ours, theirs, o, t, 0, steps, masks, set_to_none)
    return ours, theirs, o, t


def _train(comm, ours, theirs, o, t, first, steps, masks=None, set_to_none=True):
    every = [(True, True, True)] * comm.world
    for k in range(first, first + steps):
        used_by_rank = masks[k % len(masks)] if masks else every
        o.zero_grad(set_to_none=set_to_none)
        used = used_by_rank[comm.rank]
        if any(used):
            _loss(ours, _inputs(comm.world, k)[comm.rank], used).backward()
        o.step()
        had = [p.grad is not None for p in theirs]
        _reference_grads(theirs, comm.world, k, used_by_rank)
        if not set_to_none:  # torch's zero_grad(set_to_none=False) keeps a zero gradient
            for p, h in zip(theirs, had, strict=True):
                if h and p.grad is None:
                    p.grad = torch.zeros_like(p)
        t.step()


ADAM_INPUTS = [{}, {"lr": 0.01}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "maximize": True}]
SGD_INPUTS = [
    {}, {"lr": 1e-2}, {"lr": torch.tensor(0.001)}, {"weight_decay": 0.5}, {"momentum": 0.9},
    {"weight_decay": 0.1, "maximize": True}, {"momentum": 0.9, "dampening": 0.5},
    {"momentum": 0.9, "weight_decay": 0.1}, {"momentum": 0.9, "nesterov": True,
                                             "weight_decay": 0.1},
]
LAMB_INPUTS = [
    {"lr": 1e-1, "weight_decay": 1e-3}, {"lr": 1e-2, "weight_decay": 1e-3, "adam": True,
                                         "eps": 1e-8},
    {"lr": 1e-1, "grad_averaging": False}, {"lr": 1e-1, "weight_decay": 1e-2, "fixed_decay": True},
]
CASES = [
    *(("Adam", kw) for kw in ADAM_INPUTS),
    *(("AdamW", kw) for kw in ADAM_INPUTS),
    *(("SGD", kw) for kw in SGD_INPUTS),
    ("Adam", {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    *(("LAMB", kw) for kw in LAMB_INPUTS),
]
# which parameters each of 2 ranks uses, step by step: all; the bias on rank 0 only; nothing on
# rank 1; the third parameter on no rank (so its step count falls behind the others')
MASKS = [
    [(True, True, True), (True, True, True)],
    [(True, True, False), (True, False, False)],
    [(True, True, True), (False, False, False)],
    [(False, True, True), (False, True, False)],
]


def dropin(comm: Communicator) -> dict:
    """Every check of the 2-rank tier, in one spawned group."""
    out: dict = {"cases": {}, "missing": {}}
    for name, kw in CASES:
        ours, theirs, *_ = _run(comm, name, kw, 20)
        out["cases"][f"{name} {kw}"] = _rel(ours, theirs)
    for name, kw in (("Adam", {"lr": 1e-2, "weight_decay": 0.1}), ("AdamW", {"lr": 1e-2}),
                     ("SGD", {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}),
                     ("LAMB", {"lr": 1e-1, "weight_decay": 1e-2})):
        for set_to_none in (True, False):
            ours, theirs, o, t = _run(comm, name, kw, 12, MASKS, set_to_none=set_to_none)
            out["missing"][f"{name} set_to_none={set_to_none}"] = _rel(ours, theirs)
    out["compiled"] = _rel(*_run(comm, "AdamW", {"lr": 1e-2}, 10, MASKS, options=None)[:2])
    out.update(_state_and_checkpoints(comm))
    out.update(_refusals(comm))
    return out


def _state_and_checkpoints(comm: Communicator) -> dict:
    out = {}
    ours, theirs, o, t = _run(comm, "Adam", {"lr": 1e-2}, 8, MASKS)
    # opt.state: this rank's slice of each parameter's state, as torch's flattened state
    worst, ranges = 0.0, []
    for a, b in zip(ours, theirs, strict=True):
        start, stop = o.state_range(a)
        ranges.append((start, stop))
        entry = o.state[a]
        assert int(entry["step"]) == int(t.state[b]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            ref = t.state[b][key].reshape(-1)[start:stop]
            if stop > start:
                worst = max(worst, _rel([entry[key]], [ref]))
            assert entry[key].shape == ref.shape
    out["state_view"] = worst
    out["state_ranges"] = ranges
    # the gathered state dict has torch's per-parameter steps; torch continues it, and coconet
    # continues torch's (whose steps differ between parameters)
    sd = o.state_dict()
    out["steps"] = sorted(int(e["step"]) for e in sd["state"].values())
    out["torch_steps"] = sorted(int(e["step"]) for e in t.state_dict()["state"].values())
    fresh = [P(p.detach().clone()) for p in theirs]
    o2 = coconet.optim.Adam(fresh, comm=comm, options=EAGER, lr=1e-2)
    o2.load_state_dict(t.state_dict())
    _train(comm, fresh, theirs, o2, t, 8, 4, MASKS)
    out["from_torch"] = _rel(fresh, theirs)
    # LAMB to and from pytorch_optimizer.Lamb (its step is the group's): after 3 steps each
    # loads the other's checkpoint, the two continue side by side, and the original pair too
    kw = {"lr": 1e-1, "weight_decay": 1e-2}
    ours, theirs, o, t = _run(comm, "LAMB", kw, 3)
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)  # collective (gathered): every rank holds the whole dict
    buf.seek(0)
    into_lamb = [P(p.detach().clone()) for p in ours]
    t2 = _reference("LAMB")(into_lamb, **kw)
    t2.load_state_dict(torch.load(buf, weights_only=True))
    into_ours = [P(p.detach().clone()) for p in theirs]
    o2 = coconet.optim.LAMB(into_ours, comm=comm, options=EAGER, **kw)
    o2.load_state_dict(t.state_dict())
    out["lamb_group_step"] = o2.param_groups[0]["step"]
    _train(comm, into_ours, into_lamb, o2, t2, 3, 3)
    _train(comm, ours, theirs, o, t, 3, 3)
    out["lamb_from_lamb"] = _rel(into_ours, theirs)
    out["lamb_to_lamb"] = _rel(into_lamb, theirs)
    return out


def _refusals(comm: Communicator) -> dict:
    out = {}
    # frozen parameters are accepted and skipped
    params = [P(v.clone()) for v in _values()]
    params[1].requires_grad_(False)
    frozen = params[1].detach().clone()
    o = coconet.optim.Adam(params, comm=comm, options=EAGER, lr=1e-2)
    _loss(params, _inputs(comm.world, 0)[comm.rank], (True, True, True)).backward()
    o.step()
    out["frozen_unchanged"] = bool(torch.equal(params[1].detach(), frozen))
    # a sparse gradient on rank 1 only: every rank refuses, nothing moves, the job goes on
    before = [p.detach().clone() for p in params]
    if comm.rank == 1:
        params[0].grad = torch.ones(10, 5).to_sparse()
    try:
        o.step()
        out["sparse"] = "no error"
    except GradientError as e:
        out["sparse"] = f"{type(e).__name__}: {e}"
    out["sparse_unchanged"] = all(
        torch.equal(p.detach(), q) for p, q in zip(params, before, strict=True))
    params[0].grad = torch.ones(10, 5)
    o.step()
    out["usable_after"] = not torch.equal(params[0].detach(), before[0])
    # comm defaults to the runtime's world (the process group spawn started)
    d = coconet.optim.AdamW([P(torch.ones(4))], lr=0.1, options=EAGER)
    out["default_world"] = d.comm.world
    # an unsupported flag in a group is refused on every rank
    try:
        coconet.optim.Adam([{"params": [P(torch.ones(3))], "amsgrad": True}], comm=comm)
        out["amsgrad_group"] = "no error"
    except CoconetError as e:
        out["amsgrad_group"] = str(e)
    return out


# -- LAMB's buckets of rows: many small tensors of one size in one step ----------------------------

# Repeated sizes, as a model's layers repeat them: four tensors of 24 elements (two shapes) and
# two of 7 share a bucket each (one tensor per row; on 3 ranks the two 7s are fewer than the
# ranks and step alone), 25 and 3 are alone.
ROW_SHAPES = ((4, 6), (7,), (4, 6), (5, 5), (7,), (2, 12), (3,), (4, 6))
# which tensors each rank uses, step by step (a row bucket with some rows missing a gradient on
# some ranks, or on all, and nothing at all on one rank)
ROW_MASKS = [
    None,
    [(0, 1, 2), (2, 3)],
    [(1, 4, 5, 6, 7), ()],
    [(), ()],
    [(0, 5), (0, 5, 7)],
]


def _row_values(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in ROW_SHAPES]


def _row_loss(params, x: torch.Tensor, used) -> torch.Tensor:
    out = torch.zeros(())
    for i in used:
        p = params[i]
        out = out + (p * p.sin() * x[: p.numel()].view_as(p)).sum() + p.pow(2).sum() * x[i]
    return out


def _row_grads(params, world: int, k: int, used_by_rank) -> None:
    """The reference's gradients: the average over ranks (None where no rank has one)."""
    total: list[torch.Tensor | None] = [None] * len(params)
    for r in range(world):
        for p in params:
            p.grad = None
        used = used_by_rank[r]
        if used:
            _row_loss(params, _row_x(k, r), used).backward()
        for i, p in enumerate(params):
            if p.grad is not None:
                total[i] = p.grad.clone() if total[i] is None else total[i] + p.grad
    for p, g in zip(params, total, strict=True):
        p.grad = None if g is None else g / world


def _row_x(k: int, rank: int) -> torch.Tensor:
    return torch.randn(25, generator=torch.Generator().manual_seed(1000 * k + rank))


def _row_masks(world: int, k: int):
    mask = ROW_MASKS[k % len(ROW_MASKS)]
    every = tuple(range(len(ROW_SHAPES)))
    return [every] * world if mask is None else [mask[r % 2] for r in range(world)]


def _row_train(comm, ours, theirs, o, t, first, steps, masked=True, set_to_none=True):
    every = [tuple(range(len(ROW_SHAPES)))] * comm.world
    for k in range(first, first + steps):
        used_by_rank = _row_masks(comm.world, k) if masked else every
        o.zero_grad(set_to_none=set_to_none)
        if used_by_rank[comm.rank]:
            _row_loss(ours, _row_x(k, comm.rank), used_by_rank[comm.rank]).backward()
        o.step()
        had = [p.grad is not None for p in theirs]
        _row_grads(theirs, comm.world, k, used_by_rank)
        if not set_to_none:
            for p, h in zip(theirs, had, strict=True):
                if h and p.grad is None:
                    p.grad = torch.zeros_like(p)
        t.step()


def lamb_rows(comm: Communicator) -> dict:
    """coconet.optim.LAMB over ``ROW_SHAPES`` against pytorch_optimizer.Lamb on the averaged
    gradient: the buckets it makes, every rank's parameters after training (all tensors used,
    and ``ROW_MASKS``), ``pre_norm`` (the global-norm factor), and checkpoints both ways."""
    lamb = _reference("LAMB")
    out: dict = {"cases": {}}
    cases = [
        ("all", {"lr": 1e-1, "weight_decay": 1e-2}, False, True),
        ("masked", {"lr": 1e-1, "weight_decay": 1e-2}, True, True),
        ("masked, set_to_none=False", {"lr": 1e-1, "weight_decay": 1e-2}, True, False),
        ("adam", {"lr": 1e-2, "adam": True, "eps": 1e-8}, True, True),
        ("pre_norm", {"lr": 1e-1, "pre_norm": True, "max_grad_norm": 0.5}, True, True),
    ]
    for label, kw, masked, set_to_none in cases:
        ours = [P(v.clone()) for v in _row_values()]
        theirs = [P(v.clone()) for v in _row_values()]
        o = coconet.optim.LAMB(ours, comm=comm, options=EAGER, **kw)
        t = lamb(theirs, **kw)
        _row_train(comm, ours, theirs, o, t, 0, 10, masked, set_to_none)
        out["cases"][label] = _rel(ours, theirs)
        if label == "all":
            where = {id(p): i for i, p in enumerate(ours)}
            out["buckets"] = [[where[id(p)] for p in b.params] for b in o.buckets]
            out["rows"] = [b.row for b in o.buckets]
            # opt.state[p]: this rank's part of each tensor, as the reference's flattened state
            worst = 0.0
            for a, b in zip(ours, theirs, strict=True):
                start, stop = o.state_range(a)
                if stop > start:
                    ref = t.state[b]["exp_avg"].reshape(-1)[start:stop]
                    worst = max(worst, _rel([o.state[a]["exp_avg"]], [ref]))
            out["state_view"] = worst
    # checkpoints both ways after 4 masked steps, then 4 more side by side (compiled steps)
    kw = {"lr": 1e-1, "weight_decay": 1e-2}
    ours = [P(v.clone()) for v in _row_values()]
    theirs = [P(v.clone()) for v in _row_values()]
    o = coconet.optim.LAMB(ours, comm=comm, **kw)
    t = lamb(theirs, **kw)
    _row_train(comm, ours, theirs, o, t, 0, 4)
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)
    buf.seek(0)
    into_lamb = [P(p.detach().clone()) for p in ours]
    t2 = lamb(into_lamb, **kw)
    t2.load_state_dict(torch.load(buf, weights_only=True))
    into_ours = [P(p.detach().clone()) for p in theirs]
    o2 = coconet.optim.LAMB(into_ours, comm=comm, **kw)
    o2.load_state_dict(t.state_dict())
    _row_train(comm, into_ours, into_lamb, o2, t2, 4, 4)
    _row_train(comm, ours, theirs, o, t, 4, 4)
    out["compiled"] = _rel(ours, theirs)
    out["from_lamb"] = _rel(into_ours, theirs)
    out["to_lamb"] = _rel(into_lamb, theirs)
    return out
