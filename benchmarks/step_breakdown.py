"""Where one coconet data-parallel Adam step spends its time, phase by phase (a profile, not a
benchmark: the phases are timed by wrapping coconet's runtime methods, which adds a little).

Two ranks (1 torch thread each) on the transport ``--transport`` chooses (default: shared memory,
what coconet uses on one host; ``torch.distributed`` for gloo), ``--params`` float32 values,
``--steps`` steps of each contender after a warm-up; each phase's median over the steps, on the
slowest rank. Phases:

- ``bind``: checking this rank's inputs (no communication);
- ``handshake``: the start-of-step all_reduce of program hash / shapes (``check_every_step``);
- ``collective start``: launching the collectives, including the copies they make of their input
  (over shared memory a collective does all its work here; so does the opening of a one-pass unit:
  publishing the input and waiting until every peer has);
- ``collective wait``: waiting for them; over shared memory also the closing of a one-pass unit
  (waiting until every peer wrote its slot, or read this rank's rows);
- ``fused kernel``: the torch.compile'd kernel(s) (one-pass: including the reduction of the peers'
  slices it reads);
- ``other step code``: the rest of the generated step (eager ops of unfused code, views);
- ``commit vote``: the all_reduce confirming every rank succeeded (``commit_vote``);
- ``commit copies``: copying the step's new tensors into the caller's ``p``, ``m``, ``v`` (with a
  one-pass unit's published gather: the gather itself, from the peers' slots into ``p``; with
  ``--commit swap`` the state is swapped in, not copied).

For scale, ``ddp`` is split into its ``all_reduce`` and ``Adam(fused=True).step()``.

    python benchmarks/step_breakdown.py --params 4194304 --steps 10
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import f32, gradient, initial_param, load_adam  # noqa: E402

PHASES = [
    "bind",
    "handshake",
    "collective start",
    "collective wait",
    "fused kernel",
    "other step code",
    "commit vote",
    "commit copies",
    "total",
]


def worker(comm, cfg):
    import coconet
    from coconet.options import TransportKind
    from coconet.runtime import handshake
    from coconet.testing import rank_inputs

    torch.set_num_threads(cfg["threads"])
    n = cfg["params"]
    adam = load_adam()
    program = adam.program()
    hp = {
        "lr": f32(adam.LR),
        "beta1": f32(adam.BETAS[0]),
        "beta2": f32(adam.BETAS[1]),
        "eps": f32(adam.EPS),
        "weight_decay": f32(adam.WEIGHT_DECAY),
    }
    g = gradient(0, comm.rank, 0, n)
    p0 = initial_param(0, n)
    acc: dict[str, float] = collections.defaultdict(float)

    def wrap(obj, attr, label, pick=None):
        orig = getattr(obj, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[pick(a, k) if pick else label] += (time.perf_counter() - t) * 1e3

        setattr(obj, attr, timed)

    wrap(handshake, "settle", "handshake:settle")
    wrap(comm, "agree_max", "", pick=lambda a, k: "agree:" + k.get("op", "handshake"))
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        wrap(comm, f"{op}_start", "collective start")
    wrap(comm, "wait", "collective wait")
    # the shared-memory transport's one-pass units and in-place all_reduce (its channel is made
    # once per axis: the generated code calls this object)
    if comm.transport_of(None) is TransportKind.SHARED_MEMORY:
        channel = comm.one_pass(None)
        for attr in ("begin", "slot", "reduce_in_place"):
            wrap(channel, attr, "collective start")
        for attr in ("end", "finish"):
            wrap(channel, attr, "collective wait")

    out = {}
    targets = {"unscheduled": program, **{k: f(program) for k, f in adam.SCHEDULES.items()}}
    for name, target in targets.items():
        fn = coconet.compile(target, comm=comm, cache_dir=cfg["cache_dir"], commit=cfg["commit"])
        wrap(fn, "_bind", "bind")
        wrap(fn, "_commit", "commit copies")
        wrap(fn.module, "step", "module.step")
        for kname in list(fn.kernels._kernels):
            wrap(fn.kernels._kernels[kname], "fn", "fused kernel")
        zeros = torch.zeros(n)
        st = rank_inputs(fn.program, {"p": p0, "m": zeros, "v": zeros}, comm.mesh, comm.rank)
        rows = collections.defaultdict(list)
        for k in range(cfg["warmup"] + cfg["steps"]):
            acc.clear()
            dist.barrier()
            t = time.perf_counter()
            fn(g=g, step=float(k + 1), **st, **hp)
            total = (time.perf_counter() - t) * 1e3
            if k < cfg["warmup"]:
                continue
            inner = acc["collective start"] + acc["collective wait"] + acc["fused kernel"]
            rows["bind"].append(acc["bind"])
            rows["handshake"].append(acc["handshake:settle"])
            rows["collective start"].append(acc["collective start"])
            rows["collective wait"].append(acc["collective wait"])
            rows["fused kernel"].append(acc["fused kernel"])
            rows["other step code"].append(acc["module.step"] - inner)
            rows["commit vote"].append(acc["agree:commit vote"])
            rows["commit copies"].append(acc["commit copies"])
            rows["total"].append(total)
        out[f"coconet:{name}"] = {ph: statistics.median(v) for ph, v in rows.items()}

    param = torch.nn.Parameter(p0.clone())
    param.grad = torch.empty(n)
    betas = (hp["beta1"], hp["beta2"])
    opt = torch.optim.Adam(
        [param],
        lr=hp["lr"],
        betas=betas,
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        fused=True,
    )
    rows = collections.defaultdict(list)
    for k in range(cfg["warmup"] + cfg["steps"]):
        param.grad.copy_(g)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(param.grad)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if k >= cfg["warmup"]:
            rows["all_reduce"].append((t1 - t0) * 1e3)
            rows["Adam(fused=True).step"].append((t2 - t1) * 1e3)
            rows["total"].append((t2 - t0) * 1e3)
    out["ddp"] = {ph: statistics.median(v) for ph, v in rows.items()}

    # The slowest rank's median per phase.
    names = sorted(out)
    keys = [(c, ph) for c in names for ph in sorted(out[c])]
    t = torch.tensor([out[c][ph] for c, ph in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    worst = collections.defaultdict(dict)
    for (c, ph), v in zip(keys, t.tolist(), strict=True):
        worst[c][ph] = v
    worst = dict(worst)
    worst["transport"] = comm.transport_of(None).value
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "shared memory", "torch.distributed"],
        help="what runs coconet's collectives (auto: shared memory on one host)",
    )
    ap.add_argument("--commit", default="copy", choices=["copy", "swap"])
    args = ap.parse_args(argv)

    import tempfile

    from coconet.runtime import CommOptions, spawn

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="coconet-breakdown-") as tmp:
        cfg = {
            "params": args.params,
            "steps": args.steps,
            "warmup": args.warmup,
            "threads": args.threads,
            "cache_dir": tmp,
            "commit": args.commit,
        }
        options = CommOptions(cache_dir=tmp, transport=args.transport)
        res = spawn(worker, 2, cfg, options=options, timeout=1200)[0]
    cols = [c for c in res if c.startswith("coconet:")]
    print(
        f"step_breakdown: {args.params:,} float32 params, 2 ranks x {args.threads} thread(s), "
        f"coconet over {res['transport']}, commit={args.commit}; ddp over gloo; median of "
        f"{args.steps} steps, slowest rank, ms (load average {os.getloadavg()[0]:.2f})"
    )
    print(f"{'phase':<18}" + "".join(f"{c.removeprefix('coconet:'):>15}" for c in cols))
    for ph in PHASES:
        print(f"{ph:<18}" + "".join(f"{res[c].get(ph, 0.0):>15.1f}" for c in cols))
    print()
    print("ddp: " + ", ".join(f"{ph} {v:.1f}" for ph, v in res["ddp"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
