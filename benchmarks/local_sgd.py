"""Local SGD across hosts: the ranks of ``multi_host.py --local-sgd`` (one process group, two
namespace hosts, a shaped link).

Each rank trains its own copy of a stack of square float32 ``Linear`` layers (``params``
parameters in all, tanh between) on its own random batch of ``batch`` rows: a *local step* is
the forward, the backward and ``torch.optim.Adam(fused=True)``. ``batch=0`` leaves the forward
and backward out (one fixed gradient per rank: the update alone, ``data_parallel.py``'s work),
which is the largest share the link can take. Contenders, each in a block of its own (a barrier
before each period of ``k`` steps, the slowest rank's time of each period, divided by ``k``; the
``k``-th step's own time beside it):

- ``local step``: the Adam step alone, no communication (the floor);
- ``coconet OverlapLocalSGD (k)``: ``coconet.optim.OverlapLocalSGD`` over it, ``period=k``: the
  average started at a sync is waited for ``k`` steps later, across hosts in two levels (shared
  memory inside a host, torch.distributed across, in flight);
- ``coconet LocalSGD (k)``: ``coconet.optim.LocalSGD``, ``period=k``: the average waited for at
  once (two levels, the hierarchical transport);
- ``torch post-local-sgd (k)``: ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager(k)``
  (torch's Local SGD: a flat gloo all_reduce of the flattened parameters every ``k`` steps);
- ``sync hierarchical``: ``coconet.optim.Adam`` over the same gradient, every step an average
  (the data-parallel step: two levels across hosts).

The blocks are not interleaved: an overlapped average in flight at the end of a period would
travel during the next contender's time. Each block starts after ``warmup`` untimed periods, so
each timed sync of the overlapped contender waits for an average started ``k`` steps before.
After its block the overlapped contender waits for its last average (untimed).

The link bound of one average across two hosts in two levels is ``4 * params / rate`` bytes
each way (each host's half of the sum out and the other half back: ``S / rate``), per ``k``
steps: ``S / rate / k`` per step, what an average that is not hidden adds to a step at least.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import coconet.optim


class Stepper:
    """One contender: ``step()`` is one training step of its model."""

    def __init__(self, name: str, net: torch.nn.Module, opt, x: torch.Tensor | None) -> None:
        self.name, self.net, self.opt, self.x = name, net, opt, x

    def step(self) -> None:
        if self.x is not None:
            self.opt.zero_grad()
            self.net(self.x).square().mean().backward()
        self.opt.step()

    def settle(self) -> None:
        """Untimed, after the block: nothing of it left travelling."""
        if isinstance(self.opt, coconet.optim.OverlapLocalSGD):
            self.opt.wait_average()


WIDTH = 1024  # the layers' width: params // WIDTH**2 layers


def model(cfg: dict, rank: int) -> torch.nn.Module:
    """The stack (the same on every rank), with a fixed gradient of this rank's where
    ``batch=0``."""
    torch.manual_seed(cfg["seed"])
    layers = max(1, cfg["params"] // (WIDTH * WIDTH))
    net = torch.nn.Sequential(*[m for _ in range(layers) for m in
                                (torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Tanh())])
    if not cfg["batch"]:
        gen = torch.Generator().manual_seed(100 + rank)
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return net


def contenders(comm, cfg: dict) -> list[Stepper]:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    k, lr = cfg["period"], 1e-3
    x = None
    if cfg["batch"]:
        x = torch.randn(cfg["batch"], WIDTH,
                        generator=torch.Generator().manual_seed(200 + comm.rank))

    def adam(net):
        return torch.optim.Adam(net.parameters(), lr=lr, fused=True)

    out = []
    net = model(cfg, comm.rank)
    out.append(Stepper("local step", net, adam(net), x))
    net = model(cfg, comm.rank)
    out.append(Stepper(f"coconet OverlapLocalSGD (k={k})", net,
                       coconet.optim.OverlapLocalSGD(adam(net), period=k, comm=comm), x))
    net = model(cfg, comm.rank)
    out.append(Stepper(f"coconet LocalSGD (k={k})", net,
                       coconet.optim.LocalSGD(adam(net), period=k, comm=comm), x))
    net = model(cfg, comm.rank)
    out.append(Stepper(f"torch post-local-sgd (k={k})", net,
                       PostLocalSGDOptimizer(adam(net), PeriodicModelAverager(period=k)), x))
    net = model(cfg, comm.rank)
    grads = [p.grad for p in net.parameters()]
    opt = coconet.optim.Adam(net.parameters(), lr=lr, comm=comm)
    if x is None:  # (.grad is the optimizer's bucket view now)
        for p, g in zip(net.parameters(), grads, strict=True):
            p.grad.copy_(g)
    out.append(Stepper("sync hierarchical (coconet.optim.Adam)", net, opt, x))
    return out


def worker(comm, cfg: dict) -> dict:
    torch.set_num_threads(1)
    k = cfg["period"]
    steppers = contenders(comm, cfg)
    explain = steppers[1].opt.explain()
    rows = []
    for c in steppers:
        if comm.rank == 0:
            print(f"  {c.name} ...", file=sys.stderr, flush=True)
        times, syncs = [], []  # per period: ms per step; the sync step's own ms (the k-th)
        for period in range(cfg["warmup"] + cfg["periods"]):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(k - 1):
                c.step()
            ts = time.perf_counter()
            c.step()
            end = time.perf_counter()
            if period >= cfg["warmup"]:
                times.append((end - t) * 1e3 / k)
                syncs.append((end - ts) * 1e3)
        c.settle()
        worst = torch.tensor([times, syncs], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        ts, ss = worst.tolist()
        rows.append({"name": c.name, "median_ms": round(statistics.median(ts), 3),
                     "min_ms": round(min(ts), 3), "max_ms": round(max(ts), 3),
                     "sync_step_ms": round(statistics.median(ss), 3)})
    # the models after LocalSGD's last sync: the same on every rank (a check, not a timing)
    same = torch.tensor([float(sum(p.detach().double().sum() for p in
                                   steppers[2].net.parameters()))], dtype=torch.float64)
    spread = same.clone()
    dist.all_reduce(same, op=dist.ReduceOp.MAX)
    dist.all_reduce(spread, op=dist.ReduceOp.MIN)
    return {"rows": rows, "explain": explain,
            "local_sgd_models_equal_after_sync": bool(same.item() == spread.item())}


def targets(run: dict) -> list[dict]:
    """The Local-SGD issue's targets from this run's medians (2 x 2 ranks, 1 Gbit/s, k = 8)."""
    by = {r["name"].split(" (")[0]: r["median_ms"] for r in run["rows"]}
    overlap, local = by["coconet OverlapLocalSGD"], by["local step"]
    k = run["period"]
    out = []
    for name, value, threshold, at_most in (
        (f"overlap local-sgd (k={k}) step over local step", overlap / local, 1.1, True),
        (f"overlap local-sgd (k={k}) speedup over sync hierarchical",
         by["sync hierarchical"] / overlap, 3.0, False),
        (f"overlap local-sgd speedup over torch post-local-sgd (k={k})",
         by["torch post-local-sgd"] / overlap, 1.3, False),
    ):
        met = value <= threshold if at_most else value >= threshold
        out.append({"name": f"2 x 2, {run['rate']}: {name}", "value": round(value, 3),
                    "threshold": threshold, "met": met})
    return out


def table(doc: dict) -> str:
    cfg, run = doc["config"], doc["run"]
    work = (f"forward + backward of {cfg['batch']} rows + adam" if cfg["batch"] else
            "adam alone (a fixed gradient)")
    lines = [f"local sgd: {work}, {cfg['params']:,} float32 params, 2 namespace hosts x 2 ranks, "
             f"link {run['rate']}, k = {cfg['period']}; {cfg['periods']} timed periods after "
             f"{cfg['warmup']}; {doc['machine']['cpu_model']}, {doc['machine']['cpus']} cpus",
             f"an average across the link at its rate: {run['link_ms']:.1f} ms, "
             f"{run['link_ms'] / cfg['period']:.1f} ms per step at k = {cfg['period']}", ""]
    local = run["rows"][0]["median_ms"]
    width = max(len(r["name"]) for r in run["rows"])
    lines.append(f"  {'name':<{width}} {'ms/step':>9} {'min':>8} {'max':>8} {'x local':>8} "
                 f"{'k-th step':>10}")
    for r in run["rows"]:
        lines.append(f"  {r['name']:<{width}} {r['median_ms']:>9.1f} {r['min_ms']:>8.1f} "
                     f"{r['max_ms']:>8.1f} {r['median_ms'] / local:>8.2f} "
                     f"{r['sync_step_ms']:>10.1f}")
    lines += ["", "  " + run["explain"].replace("\n", "\n  "),
              f"  LocalSGD's models equal on every rank after its last sync: "
              f"{run['local_sgd_models_equal_after_sync']}", "",
              "targets (ratios of medians from this run):"]
    for t in doc["targets"]:
        op = "<=" if "over local step" in t["name"] else ">="
        lines.append(f"  {t['name']}: {t['value']} ({op} {t['threshold']}: "
                     f"{'met' if t['met'] else 'MISSED'})")
    return "\n".join(lines)
