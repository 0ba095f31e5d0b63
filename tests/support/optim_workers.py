"""Rank bodies for test_dist_optim.py: coconet.optim against torch.optim, on real ranks.

Every rank builds the same small model (a real ``nn.Module``: many parameters of different
sizes, uneven over 3 or 4 ranks); a global batch of 12 samples is split evenly over the ranks
(12 divides by 1, 2, 3 and 4, so the average of the ranks' mean losses is the global mean). The
reference runs on every rank, in the same process: a copy of the model whose gradients are the
average of every rank's gradients (summed in rank order, divided by the world size, as DDP
does), stepped by the torch optimizer.
"""

from __future__ import annotations

import torch

import coconet
from coconet.options import CompileOptions
from coconet.runtime import Communicator

BATCH = 12
EAGER = CompileOptions(fused_kernels=False)  # the same programs, without torch.compile's cost


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7),
        torch.nn.Tanh(),
        torch.nn.LayerNorm(7),
        torch.nn.Linear(7, 3),
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 3, generator=gen)


def _loss(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def groups(net: torch.nn.Module, **second) -> list[dict]:
    """Weights in one group, biases and the norm in another (with ``second``'s settings)."""
    weights = [p for n, p in net.named_parameters() if n.endswith("weight") and p.dim() == 2]
    others = [p for n, p in net.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": weights}, {"params": others, **second}]


def _reference_grads(ref: torch.nn.Module, world: int, step: int) -> None:
    """ref's .grad = the average over ranks of each rank's gradient, summed in rank order."""
    x, y = batch(step)
    total = None
    for xs, ys in zip(torch.tensor_split(x, world), torch.tensor_split(y, world), strict=True):
        ref.zero_grad(set_to_none=True)
        _loss(ref, xs, ys).backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    for p, g in zip(ref.parameters(), total, strict=True):
        p.grad = g / world


def _reference_class(name: str):
    if name == "LAMB":  # no torch counterpart: the library users install for it
        import pytorch_optimizer

        return lambda params, **kw: pytorch_optimizer.Lamb(params, foreach=False, **kw)
    return getattr(torch.optim, name)


def against_torch(comm: Communicator, name: str, kwargs: dict, second: dict, steps: int,
                  scheduler: bool, compiled: bool = False) -> dict:
    """``steps`` steps of coconet.optim.<name> and torch.optim.<name>: the worst relative error
    (max |p - ref| / max |ref| over the parameters) and whether every rank holds the same."""
    net, ref = model(), model()
    ours = getattr(coconet.optim, name)(
        groups(net, **second), comm=comm, options=None if compiled else EAGER, **kwargs
    )
    theirs = _reference_class(name)(groups(ref, **second), **kwargs)
    scheds = []
    if scheduler:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (ours,
                                                                                        theirs)]
    _step_both(comm, net, ref, ours, theirs, steps, scheds)
    rel = _worst_relative_error(net, ref)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    rank0 = flat.clone()
    torch.distributed.broadcast(rank0, 0) if comm.world > 1 else None
    return {
        "rel": rel,
        "same_on_every_rank": bool(torch.equal(flat, rank0)),
        "grads_are_views": all(
            p.grad is not None and p.grad._base is not None for p in net.parameters()
        ),
        "lr_now": [g["lr"] for g in ours.param_groups],
    }


def _train(net, opt, comm, first: int, steps: int) -> None:
    for k in range(first, first + steps):
        x, y = batch(k)
        opt.zero_grad()
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        _loss(net, xs, ys).backward()
        opt.step()


def save_checkpoint(comm: Communicator, path: str) -> list[float]:
    """5 steps of coconet.optim.Adam, a checkpoint (model + optimizer, rank 0 writes it), 5 more:
    the final parameters."""
    net = model()
    opt = coconet.optim.Adam(net.parameters(), lr=1e-2, comm=comm, options=EAGER)
    _train(net, opt, comm, 0, 5)
    sd = opt.state_dict()  # collective
    if comm.rank == 0:
        torch.save({"model": net.state_dict(), "optim": sd}, path)
    torch.save(opt.sharded_state_dict(), f"{path}.shard{comm.rank}")  # no communication
    _train(net, opt, comm, 5, 5)
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def load_shard(comm: Communicator, path: str) -> list[float]:
    """This rank's shard back into a like job (same world size), then the same 5 steps."""
    saved = torch.load(path, weights_only=False)
    net = model()
    net.load_state_dict(saved["model"])
    opt = coconet.optim.Adam(net.parameters(), lr=1e-2, comm=comm, options=EAGER)
    opt.load_state_dict(torch.load(f"{path}.shard{comm.rank}", weights_only=False))
    _train(net, opt, comm, 5, 5)
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def load_checkpoint(comm: Communicator, path: str, into: str) -> list[float]:
    """The checkpoint loaded into coconet.optim.Adam (``into="coconet"``, at this world size) or
    into torch.optim.Adam (``"torch"``: the average gradient of the same split), then the same 5
    steps: the final parameters."""
    saved = torch.load(path, weights_only=False)
    net = model()
    net.load_state_dict(saved["model"])
    if into == "coconet":
        opt = coconet.optim.Adam(net.parameters(), lr=1e-2, comm=comm, options=EAGER)
        opt.load_state_dict(saved["optim"])
        _train(net, opt, comm, 5, 5)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        opt.load_state_dict(saved["optim"])
        for k in range(5, 10):
            _reference_grads(net, 2, k)  # the split the checkpoint was trained with
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist()


def from_torch(comm: Communicator, steps: int) -> float:
    """torch.optim.Adam trains 3 steps, its state dict goes into coconet.optim.Adam, which
    continues; against torch continuing on its own: the worst relative error."""
    net, ref = model(), model()
    theirs = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for k in range(3):
        _reference_grads(ref, comm.world, k)
        theirs.step()
    net.load_state_dict(ref.state_dict())
    ours = coconet.optim.Adam(net.parameters(), lr=1e-2, comm=comm, options=EAGER)
    ours.load_state_dict(theirs.state_dict())
    _train(net, ours, comm, 3, steps)
    for k in range(3, 3 + steps):
        _reference_grads(ref, comm.world, k)
        theirs.step()
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(net.parameters(), ref.parameters(), strict=True)
    )


def misuse(comm: Communicator) -> dict[str, str]:
    """What bad use raises (each a CoconetError's message)."""
    out = {}
    cases = {
        "no comm": lambda: coconet.optim.Adam(model().parameters(), comm="gloo"),
        "amsgrad": lambda: coconet.optim.Adam(model().parameters(), amsgrad=True, comm=comm),
        "amsgrad group": lambda: coconet.optim.Adam(
            [{"params": model().parameters(), "amsgrad": True}], comm=comm),
        "bad lr": lambda: coconet.optim.SGD(model().parameters(), lr=-1.0, comm=comm),
        "schedule": lambda: coconet.optim.Adam(model().parameters(), comm=comm, schedule="x"),
        "float64": lambda: coconet.optim.Adam(model().double().parameters(), comm=comm),
    }
    for label, make in cases.items():
        try:
            make()
            out[label] = "no error"
        except coconet.CoconetError as e:
            out[label] = f"{type(e).__name__}: {e}"
    # different models on different ranks: every rank fails
    net = model() if comm.rank == 0 else torch.nn.Linear(5, 3)
    try:
        coconet.optim.Adam(net.parameters(), comm=comm, options=EAGER)
        out["mismatch"] = "no error"
    except coconet.CoconetError as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    return out


def _grown_loss(net, extra, x, y, grown: bool):
    """The loss, plus a term through the ``extra`` layer once it has been added."""
    loss = _loss(net, x, y)
    return loss + (extra(net(x)) ** 2).mean() if grown else loss


def extras(comm: Communicator) -> dict:
    """step(closure), step hooks and add_param_group, against torch doing the same."""
    net, ref = model(), model()
    extra, extra_ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    extra_ref.load_state_dict(extra.state_dict())
    ours = coconet.optim.Adam(net.parameters(), lr=1e-2, comm=comm, options=EAGER)
    theirs = torch.optim.Adam(ref.parameters(), lr=1e-2)
    calls = []
    ours.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    ours.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    losses = []
    for k in range(6):
        if k == 2:  # a new group mid-training (collective: every rank adds it here)
            ours.add_param_group({"params": extra.parameters(), "lr": 2e-2})
            theirs.add_param_group({"params": extra_ref.parameters(), "lr": 2e-2})
        x, y = batch(k)
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]

        def closure(xs=xs, ys=ys, grown=k >= 2):
            ours.zero_grad()
            loss = _grown_loss(net, extra, xs, ys, grown)
            loss.backward()
            return loss

        losses.append(float(ours.step(closure)))
        total = None
        for xr, yr in zip(torch.tensor_split(x, comm.world), torch.tensor_split(y, comm.world),
                          strict=True):
            theirs.zero_grad(set_to_none=True)
            _grown_loss(ref, extra_ref, xr, yr, k >= 2).backward()
            params = [p for g in theirs.param_groups for p in g["params"]]
            grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        for p, g in zip(params, total, strict=True):
            p.grad = g / comm.world
        theirs.step()
    pairs = list(zip(net.parameters(), ref.parameters(), strict=True))
    pairs += list(zip(extra.parameters(), extra_ref.parameters(), strict=True))
    rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    return {"rel": rel, "calls": calls, "losses_are_floats": all(x == x for x in losses)}


def ddp_hook(comm: Communicator, name: str, kwargs: dict, steps: int, bucket_cap_mb: float):
    """DDP with coconet.optim.<name> as its communication hook against DDP + torch.optim.<name>
    (small buckets: several per step, and DDP rebuilds them after the first iteration)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net, ref = DDP(model(), bucket_cap_mb=bucket_cap_mb), DDP(model(), bucket_cap_mb=bucket_cap_mb)
    ours = getattr(coconet.optim, name)(
        net.parameters(), comm=comm, ddp=net, options=EAGER, **kwargs
    )
    theirs = getattr(torch.optim, name)(ref.parameters(), **kwargs)
    losses = {"coconet": [], "torch": []}
    for k in range(steps):
        x, y = batch(k)
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        for label, m, opt in (("coconet", net, ours), ("torch", ref, theirs)):
            opt.zero_grad()
            loss = _loss(m, xs, ys)
            loss.backward()
            opt.step()
            losses[label].append(loss.item())
    rel = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(net.parameters(), ref.parameters(), strict=True)
    )
    sd = ours.state_dict()  # collective: gathered from the slices of the final layouts
    return {
        "rel": rel,
        "loss_diff": max(abs(a - b) for a, b in zip(losses["coconet"], losses["torch"],
                                                    strict=True)),
        "layouts": len(ours.ddp_layouts),
        "state_entries": len(sd["state"]),
    }


class Lion(coconet.optim.DistributedOptimizer):
    """A user's own optimizer, not in torch: Lion (Chen et al. 2023), written as the README's
    coconet.optim section shows: a DSL program over a flat bucket, its state and its scalars."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, comm, **kw):
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        super().__init__(params, defaults, comm=comm, **kw)

    def program(self, group, dtype):
        import coconet as cc

        n = cc.Dim("N")
        g = cc.Tensor("g", dtype, [n], cc.Local)
        p, m = (cc.Tensor(name, dtype, [n], cc.Replicated) for name in ("p", "m"))
        lr, b1, c1, b2, c2, decay = (
            cc.Scalar(s) for s in ("lr", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
                                   "decay")
        )
        grad = cc.all_reduce(g, cc.ReduceOp.MEAN, name="grad")  # the average, as DDP's
        update = cc.sign(b1 * m + c1 * grad)
        p_new = decay * p - lr * update
        m_new = b2 * m + c2 * grad
        return cc.Program("lion", [g, p, m, lr, b1, c1, b2, c2, decay],
                          [cc.update(p, p_new), cc.update(m, m_new)])

    def state_names(self, group):
        return {"m": "exp_avg"}

    def scalars(self, group, step):
        lr, (b1, b2) = float(group["lr"]), group["betas"]
        return {"lr": lr, "beta1": b1, "one_minus_beta1": 1 - b1, "beta2": b2,
                "one_minus_beta2": 1 - b2, "decay": 1 - lr * group["weight_decay"]}


def lion(comm: Communicator, steps: int) -> float:
    """The user's Lion against Lion in plain torch on the averaged gradient."""
    net, ref = model(), model()
    hp = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    ours = Lion(net.parameters(), comm=comm, options=EAGER, **hp)
    ms = [torch.zeros_like(p) for p in ref.parameters()]
    for k in range(steps):
        x, y = batch(k)
        ours.zero_grad()
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        _loss(net, xs, ys).backward()
        ours.step()
        _reference_grads(ref, comm.world, k)
        with torch.no_grad():
            for p, m in zip(ref.parameters(), ms, strict=True):
                update = torch.sign(0.9 * m + 0.1 * p.grad)
                p.mul_(1 - hp["lr"] * hp["weight_decay"]).add_(update, alpha=-hp["lr"])
                m.mul_(0.99).add_(p.grad, alpha=0.01)
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(net.parameters(), ref.parameters(), strict=True)
    )


def auto_schedule(comm: Communicator, name: str, kwargs: dict, steps: int) -> dict:
    """coconet.optim.<name>(schedule="auto") against torch (pytorch_optimizer for LAMB): the
    tuner chooses each bucket's schedule at construction (once per size class)."""
    net, ref = model(), model()
    ours = getattr(coconet.optim, name)(
        net.parameters(), comm=comm, options=EAGER, schedule="auto", **kwargs
    )
    theirs = _reference_class(name)(ref.parameters(), **kwargs)
    _step_both(comm, net, ref, ours, theirs, steps)
    rel = _worst_relative_error(net, ref)
    return {
        "rel": rel,
        "classes": len(ours.tuning),
        "winners": [str(r.winner) for r in ours.tuning],
        "explained": all("winner:" in r.explain() for r in ours.tuning),
        "buckets": len(ours.buckets),
    }


def _step_both(comm, net, ref, ours, theirs, steps: int, scheds=()) -> None:
    """``steps`` steps of ours (on this rank's share of the batch) and of the reference (on the
    averaged gradients), with the schedulers stepped after each."""
    for k in range(steps):
        x, y = batch(k)
        ours.zero_grad()
        xs = torch.tensor_split(x, comm.world)[comm.rank]
        ys = torch.tensor_split(y, comm.world)[comm.rank]
        _loss(net, xs, ys).backward()
        ours.step()
        _reference_grads(ref, comm.world, k)
        theirs.step()
        for sched in scheds:
            sched.step()


def _worst_relative_error(net, ref) -> float:
    """max |p - ref| / max |ref| over the parameters."""
    return max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(net.parameters(), ref.parameters(), strict=True)
    )


def ddp_refusals(comm: Communicator) -> dict:
    """What ``ddp=`` refuses, with the reason: two param groups (nanoGPT's decay / no decay),
    ``param_storage="host-shared"``, and LAMB (per-tensor norms: DDP's buckets mix tensors)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from coconet.errors import ConfigError

    net = DDP(model())
    decay = [p for p in net.parameters() if p.dim() > 1]
    rest = [p for p in net.parameters() if p.dim() <= 1]
    out = {}
    for label, make in (
        ("groups", lambda: coconet.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            comm=comm, ddp=net)),
        ("host-shared", lambda: coconet.optim.AdamW(
            net.parameters(), comm=comm, ddp=net, param_storage="host-shared")),
        ("lamb", lambda: coconet.optim.LAMB(net.parameters(), comm=comm, ddp=net)),
    ):
        try:
            make()
        except ConfigError as e:
            out[label] = str(e)
    return out
