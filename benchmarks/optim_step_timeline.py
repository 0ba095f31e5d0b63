"""Where a ``coconet.optim.Adam`` step's time goes around its fused kernel, on 2 local ranks over
shared memory: a profile (per-rank timestamps on the host's one monotonic clock), not a
contest.

Each step is cut at its kernel: **before** (from the aligned start to the later rank's kernel
start: the optimizer's and the compiled step's Python, the agreement round, the one-pass unit's
opening), **kernel** (each rank's; their difference is time the faster rank then waits),
**after** (from the later kernel's end to the later rank's return: the gather's close, the
commit vote, the commit). ``total`` = the later rank's return minus the start.

Two regimes:

- ``warm``: steps back to back (what a small model's loop sees): the interpreter's working set
  stays in cache;
- ``cold``: before each step, a pass over twice the last-level cache and the gradient written
  into the bucket (as ``backward()`` leaves it), then a gloo barrier and an aligned start
  (``data_parallel_adam.AlignedStart``): what ``data_parallel_adam.py`` times.

    python benchmarks/optim_step_timeline.py --params 4096,4194304 --steps 40 --json out.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import AlignedStart  # noqa: E402

STORAGES = ("per-rank", "host-shared")
PHASES = ("before", "kernel (faster rank)", "kernel (slower rank)", "after", "total")


def _steps(comm, n: int, storage: str, steps: int, cold: bool) -> list[dict[str, float]]:
    """Per step, this rank's timestamps (ns): start, kernel start and end, return."""
    import coconet.optim
    from coconet.tune.calibrate import last_level_cache_bytes

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n))
    opt = coconet.optim.Adam([p], lr=1e-3, weight_decay=1e-2, comm=comm, param_storage=storage)
    p.grad = torch.zeros(n)
    opt.step()  # compiles, and makes p.grad the bucket's view
    fn = opt.buckets[0].step_fn
    marks: list[int] = []
    for kernel in fn.kernels._kernels.values():
        inner = kernel.fn

        def timed(*a, _inner=inner):
            marks.append(time.perf_counter_ns())
            try:
                return _inner(*a)
            finally:
                marks.append(time.perf_counter_ns())

        kernel.fn = timed
    g = torch.randn(n, generator=torch.Generator().manual_seed(1 + comm.rank))
    junk = torch.zeros(2 * last_level_cache_bytes() // 4)
    start = AlignedStart(comm.rank, comm.world)
    out = []
    for k in range(steps + 5):
        if cold or k == 0:
            junk.add_(1.0)
            torch.mul(g, 2.0, out=p.grad)
            dist.barrier()
            start()
        marks.clear()
        t0 = time.perf_counter_ns()
        opt.step()
        t1 = time.perf_counter_ns()
        if k >= 5 and len(marks) == 2:
            out.append({"start": t0, "kernel_start": marks[0], "kernel_end": marks[1],
                        "end": t1})
    return out


def worker(comm, cfg: dict) -> dict:
    torch.set_num_threads(1)
    res = {}
    for n in cfg["params"]:
        for storage in STORAGES:
            for cold in (False, True):
                res[f"{n}|{storage}|{'cold' if cold else 'warm'}"] = _steps(
                    comm, n, storage, cfg["steps"], cold)
    return res


def who(ranks: list[list[dict[str, float]]]) -> dict[str, float]:
    """Which rank's kernel is the slower, step by step: the share of steps where it is rank 0's,
    where it is the kernel that started later, and the median time both kernels ran at once
    as a share of the slower kernel (the rest of it ran alone, with the memory to itself)."""
    slower0 = later = 0
    overlap = []
    steps = min(len(r) for r in ranks)
    for k in range(steps):
        a, b = ranks[0][k], ranks[1][k]
        da, db = a["kernel_end"] - a["kernel_start"], b["kernel_end"] - b["kernel_start"]
        slow, fast = (a, b) if da >= db else (b, a)
        slower0 += da >= db
        later += slow["kernel_start"] >= fast["kernel_start"]
        both = min(a["kernel_end"], b["kernel_end"]) - max(a["kernel_start"], b["kernel_start"])
        overlap.append(max(0, both) / max(da, db))
    return {"slower is rank 0": slower0 / steps, "slower started later": later / steps,
            "kernels overlap": statistics.median(overlap)}


def phases(ranks: list[list[dict[str, float]]], warm: bool) -> dict[str, float]:
    """Median phases (us) over the steps, from every rank's timestamps."""
    rows: dict[str, list[float]] = {ph: [] for ph in PHASES}
    for k in range(min(len(r) for r in ranks)):
        ts = [r[k] for r in ranks]
        # warm: back to back, each rank starts when its last step returned (the later start)
        start = max(t["start"] for t in ts) if warm else min(t["start"] for t in ts)
        kernels = sorted(t["kernel_end"] - t["kernel_start"] for t in ts)
        rows["before"].append(max(t["kernel_start"] for t in ts) - start)
        rows["kernel (faster rank)"].append(kernels[0])
        rows["kernel (slower rank)"].append(kernels[-1])
        rows["after"].append(max(t["end"] for t in ts) - max(t["kernel_end"] for t in ts))
        rows["total"].append(max(t["end"] for t in ts) - start)
    return {ph: statistics.median(v) / 1e3 for ph, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="4096,4194304",
                    help="comma-separated float32 parameter counts")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.params.split(",")]

    from coconet.runtime import spawn

    os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    res = spawn(worker, 2, {"params": sizes, "steps": args.steps}, timeout=3600)
    table, whose = {}, {}
    for key in res[0]:
        table[key] = phases([res[r][key] for r in range(2)], key.endswith("warm"))
        whose[key] = who([res[r][key] for r in range(2)])
    head = (f"optim_step_timeline: coconet.optim.Adam, 2 ranks x 1 thread over shared memory, "
            f"median of {args.steps} steps, us (load average {os.getloadavg()[0]:.2f}; "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__})")
    lines = [head, "", f"{'params':>10} {'parameters':<12} {'regime':<6} "
             + " ".join(f"{ph:>21}" for ph in PHASES)]
    for key, row in table.items():
        n, storage, regime = key.split("|")
        lines.append(f"{int(n):>10,} {storage:<12} {regime:<6} "
                     + " ".join(f"{row[ph]:>21.0f}" for ph in PHASES))
    lines += ["", "the slower kernel, step by step (shares of the steps; overlap: the median "
              "time both kernels ran at once over the slower kernel's time):",
              f"{'params':>10} {'parameters':<12} {'regime':<6} "
              + " ".join(f"{w:>21}" for w in next(iter(whose.values())))]
    for key, row in whose.items():
        n, storage, regime = key.split("|")
        lines.append(f"{int(n):>10,} {storage:<12} {regime:<6} "
                     + " ".join(f"{v:>21.2f}" for v in row.values()))
    lines += ["", "before: aligned start -> the later rank's kernel start; after: the later "
              "kernel's end -> the later rank's return; warm: back to back (from the later "
              "rank's start); cold: caches flushed and the gradient written before each step",
              f"(wall time {time.monotonic() - t0:.0f} s)"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"params": sizes, "steps": args.steps, "phases_us": table, "slower_kernel": whose,
             "text": lines},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
