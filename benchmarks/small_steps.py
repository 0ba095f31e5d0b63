"""Small steps: what a collective and a compiled step cost when the data is small (issue 19.3).

Two local ranks, back-to-back float32 SUM all_reduces of one tensor, at each size from 4 KiB to
64 MiB; for every contender the **slowest rank's** time per call of each round (a barrier, then
``--iters`` calls back to back, scaled down for large sizes), and the **median of ``--rounds``
rounds** (7). Contenders, in alternation within every round, in one process group:

- ``deepspeed``: DeepSpeed's CPU shared-memory all_reduce, ``deepspeed.comm.inference_all_reduce``
  (in place; left out, with the reason, when DeepSpeed or its shared-memory op is missing);
- ``shm_bare``: coconet's shared-memory all_reduce without a compiled step:
  ``comm.all_reduce_start(x, SUM, donate=True)`` on a tensor in symmetric memory
  (``comm.symmetric_tensor``), then ``comm.wait``;
- ``step[shm]``: a compiled coconet step of a program that is one all_reduce (``out =
  all_reduce(g)``), with every default guarantee: the per-step agreement, the commit vote;
- ``step[shm][placed]``: the same program with its input placed where the transport reads it
  and its output where it writes it: ``g`` is the step's ``input_buffer`` (symmetric memory) and
  donated (``donate=("g",)``), so the result is written into it in place, as DDP reduces a
  gradient bucket (issue 47: a step whose data is placed costs the bare collective plus a fixed
  few microseconds);
- ``step[shm][no vote]``: the same as ``step[shm]`` with ``commit_vote=False``, which trades "a
  step is all or nothing" (README, *Safety at the edges*) for one round of signals less: what the
  vote costs;
- ``step[gloo]``: the same step on a second communicator whose collectives run on gloo.

Every contender's result is checked against the rank-order sum (``x0 + x1``, bitwise) in the same
run. ``--wait`` adds, at 8 KiB, the bare all_reduce under each way of waiting for a peer
(``coconet.runtime.symmem.WaitPolicy``: sleep at once, spin, yield, the default), and the
one-round against the two-round all_reduce at each size up to 4 MiB (``shmem.ONE_SHOT_BYTES``).

Two ranks fill this 2-core machine (one torch thread each); other jobs share it, so quote ratios
from one run. ``--json`` writes every median and a ``targets`` list (name, measured ratio of
medians from this run, threshold, met).

    python benchmarks/small_steps.py --json benchmarks/results/small_steps.json \
        | tee benchmarks/results/small_steps.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import coconet as cc
from coconet.ir.ops import ReduceOp
from coconet.runtime import CommOptions, Communicator, shmem, spawn, symmem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import deepspeed_available, remove_deepspeed_segments  # noqa: E402

KIB = 1024
SIZES = [4 * KIB, 8 * KIB, 64 * KIB, 512 * KIB, 4 << 20, 32 << 20, 64 << 20]
CONTENDERS = ("deepspeed", "shm_bare", "step[shm]", "step[shm][placed]", "step[shm][no vote]",
              "step[gloo]")
# (label, WaitPolicy fields in microseconds) for --wait
WAITS = (
    ("sleep at once", 0.0, 0.0),
    ("spin 50 us, then sleep", 50.0, 50.0),
    ("spin 20 us, then yield 2 ms, then sleep", 20.0, 2000.0),
    ("yield 2 ms, then sleep (the default, symmem.WaitPolicy())", 0.0, 2000.0),
    ("spin only", 1e9, 1e9),
)


def program() -> cc.Program:
    n = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [n], cc.Local)
    return cc.Program("one_all_reduce", [g], [cc.all_reduce(g, name="total")])


def _iters(nbytes: int, iters: int) -> int:
    """Calls per round: ``iters`` for small sizes, fewer for large ones (~20 MB moved a round)."""
    return max(3, min(iters, (20 << 20) // nbytes))


def _alternate(timed, n: int, rounds: int) -> dict[str, list[float]]:
    """Per-call seconds of each round of each variant (this rank's; the caller takes the max),
    the variants in alternation within every round (A B C ... A B C ...: a burst of load from
    another job falls on one round of each, not on all of one), each after a barrier and with a
    warm-up before the first round."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in timed}
    default_rounds = shmem.ONE_SHOT_BYTES
    for r in range(rounds):
        for name, fn, setting in timed:
            symmem.WAIT = setting[1] if setting and setting[0] == "wait" else symmem.WaitPolicy()
            limit = setting[1] if setting and setting[0] == "rounds" else default_rounds
            shmem.ONE_SHOT_BYTES = limit
            if r == 0:
                for _ in range(max(2, n // 10)):
                    fn()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out[name].append((time.perf_counter() - t0) / n)
    symmem.WAIT, shmem.ONE_SHOT_BYTES = symmem.WaitPolicy(), default_rounds
    return out


def _data(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g)


def worker(comm, cfg: dict) -> dict:
    torch.set_num_threads(1)
    rank, world = comm.rank, comm.world
    gloo = Communicator(
        comm.mesh, CommOptions(timeout=comm.options.timeout, transport="torch.distributed")
    )
    why_not = deepspeed_available(world) if "deepspeed" in cfg["contenders"] else "not asked for"
    if why_not == "":
        import deepspeed.comm as ds

        ds_all_reduce = ds.inference_all_reduce
    steps = {
        "step[shm]": cc.compile(program(), comm=comm),
        # commit_vote=False trades "a step is all or nothing" for one round of signals less
        "step[shm][no vote]": cc.compile(program(), comm=comm, commit_vote=False),
        "step[gloo]": cc.compile(program(), comm=gloo),
        "step[shm][placed]": cc.compile(program(), comm=comm, donate=("g",)),
    }
    results: dict = {"times": {}, "checks": {}, "skipped": {}}
    if why_not:
        results["skipped"]["deepspeed"] = why_not
    for nbytes in cfg["sizes"]:
        numel = nbytes // 4
        n = _iters(nbytes, cfg["iters"])
        sym = comm.symmetric_tensor((numel,), torch.float32)
        plain = torch.empty(numel)
        g = torch.empty(numel)
        mine = _data(rank, numel)
        expected = _data(0, numel)
        for r in range(1, world):
            expected = expected + _data(r, numel)  # rank order: ((x0 + x1) + x2) ...
        def deepspeed(plain=plain):
            ds_all_reduce(plain)  # in place

        def shm_bare(sym=sym):
            work = comm.all_reduce_start(sym, ReduceOp.SUM, axis=None, donate=True, label="x")
            return comm.wait(work)

        runs = {"deepspeed": (plain, deepspeed), "shm_bare": (sym, shm_bare)}
        for name, step in steps.items():
            buf = step.input_buffer("g", (numel,)) if name == "step[shm][placed]" else g
            runs[name] = (buf, lambda step=step, buf=buf: step(g=buf)["total"])
        # every timed variant: (name, the call, a setting to apply before it)
        timed: list[tuple[str, object, object]] = []
        for name in cfg["contenders"]:
            if name not in runs or name in results["skipped"]:
                continue
            buf, fn = runs[name]
            # the check: one call on each rank's own data, against the rank-order sum
            buf.copy_(mine)
            out = fn()
            got = buf if out is None or name in ("deepspeed", "shm_bare") else out
            results["checks"][f"{name} {nbytes}"] = bool(torch.equal(got, expected))
            buf.zero_()  # timed on zeros: in-place sums stay finite
            timed.append((name, fn, None))
        bare = runs["shm_bare"][1]
        if cfg["wait"] and nbytes == 8 * KIB:
            for label, spin_us, yield_us in WAITS:
                policy = symmem.WaitPolicy(spin_us * 1e-6, yield_us * 1e-6)
                timed.append((f"shm_bare, wait: {label}", bare, ("wait", policy)))
        if cfg["wait"] and nbytes <= 4 << 20:
            for label, limit in (("one round", 1 << 40), ("two rounds", 0)):
                timed.append((f"shm_bare, {label}", bare, ("rounds", limit)))
        times = _alternate(timed, n, cfg["rounds"])
        results["times"][nbytes] = times
    if why_not == "":
        dist.barrier()  # every rank is done with DeepSpeed's workspace
        if rank == 0:
            results["removed"] = remove_deepspeed_segments()
    gloo.close()
    return results


def _fmt_us(s: float) -> str:
    return f"{s * 1e6:,.1f}" if s < 1e-3 else f"{s * 1e3:,.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                        help="bytes per rank, comma-separated")
    parser.add_argument("--iters", type=int, default=300, help="calls per round (small sizes)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--wait", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the ways of waiting and one round vs two")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cfg = {
        "sizes": [int(s) for s in args.sizes.split(",")],
        "iters": args.iters,
        "rounds": args.rounds,
        "contenders": args.contenders.split(","),
        "wait": args.wait,
    }
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = os.getloadavg()[0]
    ranks = spawn(worker, 2, cfg, options=CommOptions(timeout=60), timeout=3600)
    # per round, the slowest rank; then the median over rounds
    medians: dict[int, dict[str, float]] = {}
    for nbytes in cfg["sizes"]:
        per = {}
        for name in ranks[0]["times"][nbytes]:
            rounds = zip(*(r["times"][nbytes][name] for r in ranks), strict=True)
            per[name] = statistics.median(max(t) for t in rounds)
        medians[nbytes] = per
    cpu = platform.processor() or platform.machine()
    print(f"small steps: 2 ranks on {os.cpu_count()} cores ({cpu}, torch {torch.__version__}): "
          "the ranks fill the machine; other jobs share it "
          f"(load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end)")
    print("float32 SUM all_reduce, back to back; slowest rank per round, median of "
          f"{cfg['rounds']} rounds; microseconds unless marked")
    main_names = [c for c in CONTENDERS if c in cfg["contenders"]]
    widths = [max(12, len(c)) for c in main_names]
    named = zip(main_names, widths, strict=True)
    header = f"{'size':>8} " + " ".join(f"{c:>{w}}" for c, w in named)
    header += f" {'bare/ds':>8} {'step/ds':>8} {'step/bare':>9} {'placed/bare':>11}"
    print(header)
    for nbytes, per in medians.items():
        cells = [(_fmt_us(per[c]) if c in per else "-") for c in main_names]
        ds, bare, step = per.get("deepspeed"), per.get("shm_bare"), per.get("step[shm]")
        placed = per.get("step[shm][placed]")
        print(f"{_size(nbytes):>8} "
              + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
              + f" {ratio(bare, ds):>8} {ratio(step, ds):>8} {ratio(step, bare):>9}"
              + f" {ratio(placed, bare):>11}")
    extra = [(nb, k, v) for nb, per in medians.items() for k, v in per.items()
             if k not in CONTENDERS]
    if extra:
        print("\nvariants of shm_bare (same run):")
        for nb, k, v in extra:
            print(f"{_size(nb):>8}  {k:<66} {_fmt_us(v):>12}")
    skipped = ranks[0]["skipped"]
    for name, why in skipped.items():
        print(f"left out {name}: {why}")
    checks = {k: all(r["checks"].get(k, True) for r in ranks) for k in ranks[0]["checks"]}
    bad = [k for k, ok in checks.items() if not ok]
    print(f"results checked against the rank-order sum (bitwise): "
          f"{'all equal' if not bad else 'WRONG: ' + ', '.join(bad)}")
    targets = _targets(medians)
    print("\ntargets (ratios of medians from this run):")
    for t in targets:
        print(f"  {t['name']:<58} {t['measured']:>10.3g} {t['op']} {t['threshold']:<6g} "
              f"{'met' if t['met'] else 'NOT met'}")
    if ranks[0].get("removed"):
        print(f"removed DeepSpeed's /dev/shm workspace: {', '.join(ranks[0]['removed'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "config": cfg, "torch": torch.__version__, "cores": os.cpu_count(),
                "load_start": load, "ranks": 2,
                "medians_s": {str(k): v for k, v in medians.items()},
                "checks": checks, "skipped": skipped, "targets": targets,
            }, f, indent=1)
    sys.exit(1 if bad else 0)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _targets(medians: dict[int, dict[str, float]]) -> list[dict]:
    """Issue 19.3's targets, from this run's medians (a target whose contenders did not run is
    left out)."""
    out = []

    def add(name, a, b, op, threshold):
        if a is None or b is None:
            return
        measured = a / b if b else float("inf")
        met = measured <= threshold if op == "<=" else measured < threshold
        out.append({"name": name, "measured": measured, "op": op, "threshold": threshold,
                    "met": met})

    for nb in (8 * KIB, 64 * KIB, 512 * KIB):
        per = medians.get(nb, {})
        add(f"shm_bare / deepspeed at {_size(nb)}", per.get("shm_bare"), per.get("deepspeed"),
            "<=", 2.0)
    for nb in sorted(medians):
        if nb >= 4 << 20:
            per = medians[nb]
            add(f"shm_bare / deepspeed at {_size(nb)} (faster)", per.get("shm_bare"),
                per.get("deepspeed"), "<", 1.0)
    # issue 47: a compiled all_reduce whose data is placed, at the bare transport's cost; the
    # bare transport at least DeepSpeed's speed at 64 KiB
    for nb in (4 << 20, 32 << 20):
        per = medians.get(nb, {})
        add(f"compiled all_reduce {_size(nb)}: time over bare", per.get("step[shm][placed]"),
            per.get("shm_bare"), "<=", 1.3)
    per = medians.get(64 * KIB, {})
    add("bare all_reduce 64 KiB: time over deepspeed", per.get("shm_bare"), per.get("deepspeed"),
        "<=", 1.0)
    step8 = medians.get(8 * KIB, {}).get("step[shm]")
    if step8 is not None:
        add("step[shm] at 8 KiB, in units of 50 us", step8, 50e-6, "<=", 1.0)
    step4 = medians.get(4 * KIB, {}).get("step[shm]")
    if step4 is not None:
        add("step[shm] at 4 KiB, in units of 50 us", step4, 50e-6, "<", 1.0)
    return out


if __name__ == "__main__":
    main()
