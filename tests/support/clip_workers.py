"""Rank bodies for test_dist_optim_clip.py: ``max_grad_norm=`` against what a DDP user writes.

The reference (on every rank, in the same process, as ``optim_workers``' references): the
gradients averaged over the ranks (summed in rank order, divided by the world size, as DDP
does), ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` over every parameter, then the
torch optimizer's step. The loss is scaled by a factor that changes from step to step, so that
the clip is active in some steps and not in others (each run reports which).
"""

from __future__ import annotations

import torch

import coconet.optim
from coconet.errors import ConfigError
from coconet.runtime import Communicator
from support import optim_workers
from support.optim_workers import EAGER, batch, groups, model

# the loss of step k is multiplied by SCALES[k % len(SCALES)]: norms on either side of 1.0
SCALES = (0.05, 4.0, 0.3, 1.0, 12.0)


def _scale(k: int) -> float:
    return SCALES[k % len(SCALES)]


def _loss(net, x, y, k):
    return torch.nn.functional.mse_loss(net(x), y) * _scale(k)


def _reference_step(ref, theirs, world: int, k: int, max_norm: float, clip: bool = True
                    ) -> torch.Tensor:
    """DDP's average, clip_grad_norm_ over every parameter (``clip``; else the optimizer
    scales itself: Lamb's pre_norm), torch's step; returns the norm."""
    x, y = batch(k)
    total = None
    for xs, ys in zip(torch.tensor_split(x, world), torch.tensor_split(y, world), strict=True):
        ref.zero_grad(set_to_none=True)
        _loss(ref, xs, ys, k).backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    for p, g in zip(ref.parameters(), total, strict=True):
        p.grad = g / world
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    theirs.step()
    return norm


def against_torch(comm: Communicator, name: str, kwargs: dict, second: dict | None,
                  steps: int, max_norm: float = 1.0, schedule: str | None = None,
                  param_storage: str | None = None) -> dict:
    """``steps`` steps of ``coconet.optim.<name>(max_grad_norm=max_norm)`` against the
    reference; ``second``: the settings of a second param group (None: one group, one
    bucket)."""
    net, ref = model(), model()
    params = (lambda m: groups(m, **second)) if second is not None else (
        lambda m: list(m.parameters()))
    lamb = name == "LAMB"  # Lamb's own global scaling: pre_norm=True, its max_grad_norm
    ours = getattr(coconet.optim, name)(
        params(net), comm=comm, options=EAGER, max_grad_norm=max_norm, schedule=schedule,
        param_storage=param_storage, **({"pre_norm": True} if lamb else {}), **kwargs,
    )
    if lamb:
        import pytorch_optimizer

        theirs = pytorch_optimizer.Lamb(params(ref), foreach=False, pre_norm=True,
                                        max_grad_norm=max_norm, **kwargs)
    else:
        theirs = getattr(torch.optim, name)(params(ref), **kwargs)
    norms, ref_norms = [], []
    for k in range(steps):
        x, y = batch(k)
        ours.zero_grad()
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        _loss(net, xs, ys, k).backward()
        result = ours.step()
        assert result is None  # torch's contract: step() returns the closure's loss
        norms.append(float(ours.last_grad_norm))
        ref_norms.append(float(_reference_step(ref, theirs, comm.world, k, max_norm,
                                               clip=not lamb)))
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    rank0 = flat.clone()
    if comm.world > 1:
        torch.distributed.broadcast(rank0, 0)
    return {
        "rel": optim_workers._worst_relative_error(net, ref),
        "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
        "clipped": [n > max_norm for n in ref_norms],
        "same_on_every_rank": bool(torch.equal(flat, rank0)),
        "buckets": len(ours.buckets),
        "clip": [b.clip.value for b in ours.buckets],
        # the first bucket's calls of each of its steps, by how it clips (a speculative
        # bucket's other steps are compiled at their first use)
        "runs": {c.value: s.calls for c, s in ours.buckets[0].forms.items()},
        # with several buckets: the largest speculates (its calls as "runs" counts them), and
        # how many steps ran a norm pass over the others only, over every bucket
        "sizes": [b.size for b in ours.buckets],
        "lead_runs": next(({c.value: s.calls for c, s in b.forms.items()}
                           for b in ours.buckets if b.clip.value == "speculative"), {}),
        "norm_passes": sorted(s.calls for s in ours.clipper.norm_passes.values()),
    }


def closure_and_sparse_grads(comm: Communicator, steps: int) -> dict:
    """Parameters without a gradient in some steps (torch skips them, and clip_grad_norm_
    leaves them out), one without a gradient on the last rank only in some steps (the ranks
    then exchange which have one and step again: DDP averages a zero for it), and
    ``step(closure)``: its loss is returned, the norm kept."""
    net, ref = model(), model()
    ours = coconet.optim.Adam(groups(net), comm=comm, options=EAGER, max_grad_norm=0.5, lr=1e-2)
    theirs = torch.optim.Adam(groups(ref), lr=1e-2)
    last = list(net.parameters())[-1]  # the last bias: without a gradient in odd steps
    ref_last = list(ref.parameters())[-1]
    first = list(net.parameters())[0]  # without a gradient on the last rank in some steps
    norm_rel = 0.0
    for k in range(steps):
        x, y = batch(k)
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]

        def closure(xs=xs, ys=ys, k=k):
            ours.zero_grad()
            loss = _loss(net, xs, ys, k)
            loss.backward()
            if k % 2:
                last.grad = None
            if k % 3 == 2 and comm.rank == comm.world - 1:
                first.grad = None
            return loss

        loss = ours.step(closure)
        assert isinstance(loss, torch.Tensor)
        total = None
        for r, (xr, yr) in enumerate(zip(torch.tensor_split(x, comm.world),
                                         torch.tensor_split(y, comm.world), strict=True)):
            theirs.zero_grad(set_to_none=True)
            _loss(ref, xr, yr, k).backward()
            grads = [p.grad.clone() for p in ref.parameters()]
            if k % 3 == 2 and r == comm.world - 1:
                grads[0].zero_()  # that rank has none: DDP's average counts a zero
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        for p, g in zip(ref.parameters(), total, strict=True):
            p.grad = g / comm.world
        if k % 2:
            ref_last.grad = None
        norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        theirs.step()
        norm_rel = max(norm_rel, abs(float(ours.last_grad_norm) - float(norm)) / float(norm))
    return {"rel": optim_workers._worst_relative_error(net, ref), "norm_rel": norm_rel}


def ddp_refusal(comm: Communicator) -> str:
    """``max_grad_norm=`` with ``ddp=``: refused, saying why and what to do."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(model())
    try:
        coconet.optim.AdamW(net.parameters(), comm=comm, ddp=net, max_grad_norm=1.0)
    except ConfigError as e:
        return str(e)
    return "not refused"


def differing_max_norm(comm: Communicator, second: dict | None) -> str:
    """Ranks given different ``max_grad_norm``s: the step fails on every rank naming it."""
    from coconet.errors import RuntimeFault

    net = model()
    params = groups(net, **second) if second is not None else list(net.parameters())
    opt = coconet.optim.AdamW(params, comm=comm, options=EAGER,
                              max_grad_norm=1.0 if comm.rank == 0 else 2.0)
    x, y = batch(0)
    xs = torch.tensor_split(x, comm.world)[comm.rank]
    ys = torch.tensor_split(y, comm.world)[comm.rank]
    before = [p.detach().clone() for p in net.parameters()]
    _loss(net, xs, ys, 4).backward()  # a large norm: both ranks clip, by different factors
    try:
        opt.step()
    except RuntimeFault as e:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
        return f"{e} | unchanged={unchanged}"
    return "not refused"


def local_clip_warning(comm: Communicator) -> dict:
    """A clip_grad_norm_ between backward() and step() (the trap): warned once, naming
    max_grad_norm=, at the user's line; a plain loop and a fresh backward() are not."""
    import warnings

    net = model()
    opt = coconet.optim.AdamW(groups(net), comm=comm, options=EAGER)
    out = {}
    for label, clip in (("plain", False), ("clipped", True), ("again", True)):
        x, y = batch(0)
        opt.zero_grad()
        _loss(net, x, y, 4).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        found = [w for w in caught
                 if issubclass(w.category, coconet.optim.LocalGradientEditWarning)]
        out[label] = [(str(w.message), w.filename) for w in found]
    return out


def victim_after_the_norm_pass(comm: Communicator, victim: int, dies: bool) -> dict:
    """Two param groups, a good step, then ``victim`` fails (raises, or is killed) after the
    norm pass and before any bucket is updated: the others get a RuntimeFault at once and keep
    their parameters and state as they were."""
    import os
    import signal
    import time

    from coconet.errors import RuntimeFault

    net = model()
    opt = coconet.optim.AdamW(groups(net, weight_decay=0.0), comm=comm, options=EAGER,
                              max_grad_norm=0.5)
    for k in range(2):
        x, y = batch(k)
        opt.zero_grad()
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        _loss(net, xs, ys, k).backward()
        if k == 1 and comm.rank == victim:
            def fail(*args, **kwargs):
                if dies:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected after the norm pass")

            opt.stepper.step_bucket = fail
        before = [p.detach().clone() for p in net.parameters()]
        state = [{n: x.clone() for n, x in b.state.items()} for b in opt.buckets]
        start = time.monotonic()
        try:
            opt.step()
        except (RuntimeFault, RuntimeError) as e:
            return {
                "status": type(e).__name__,
                "message": str(e),
                "seconds": time.monotonic() - start,
                "norm_pass_ran": sum(s.calls for s in opt.clipper.norm_passes.values()) == 2,
                "unchanged": all(torch.equal(a, p) for a, p in
                                 zip(before, net.parameters(), strict=True))
                and all(torch.equal(s[n], b.state[n]) for s, b in
                        zip(state, opt.buckets, strict=True) for n in s),
            }
    return {"status": "ok"}


def declined_steps(comm: Communicator, size: int = 1000) -> dict:
    """``CompiledStep.run(commit_if=)``: the example Adam under fuse_RS_C_AG (over shared memory
    its gather is published), declined by the last rank alone at calls 0 and 2 of 4. With the
    commit vote every rank declines with it: nothing is written, the outputs come back, and the
    published slots are let go (the next call would wait for them otherwise). The two calls
    that commit leave what two undeclined calls of another compiled step leave, bit for bit."""
    from coconet import compile as cc_compile
    from coconet.testing import rank_inputs
    from support.examples_loader import load_example

    adam = load_example("adam")
    target = adam.SCHEDULES["fuse_RS_C_AG"](adam.program())
    inputs = adam.make_inputs(comm.world, size, step=2)
    runs = {}
    for label in ("declining", "plain"):
        step = cc_compile(target, comm=comm)
        # (copies: rank_inputs may hand out the inputs' own tensors, which the commit writes)
        mine = {n: v.clone() if isinstance(v, torch.Tensor) else v
                for n, v in rank_inputs(step.program, inputs, comm.mesh, comm.rank).items()}
        declined, unchanged = [], []
        for k in range(4 if label == "declining" else 2):
            before = {n: v.clone() for n, v in mine.items() if isinstance(v, torch.Tensor)}
            last = comm.rank == comm.world - 1 and label == "declining"
            out = step.run(mine, commit_if=lambda out, k=k, last=last: not (last and k in (0, 2)))
            declined.append(step.last_declined)
            if step.last_declined:
                unchanged.append(all(torch.equal(before[n], mine[n]) for n in before))
                assert isinstance(out, dict)
        runs[label] = ({n: mine[n] for n in ("p", "m", "v")}, declined, unchanged)
    (got, declined, unchanged), (want, _, _) = runs["declining"], runs["plain"]
    return {
        "declined": declined,
        "unchanged": unchanged,
        "same": all(torch.equal(got[n], want[n]) for n in got),
    }
