"""Collectives: coconet's shared-memory transport against gloo, side by side in one process group.

    python benchmarks/collectives.py [--sizes-mib 1,4,16,64] [--worlds 2,4] [--json out.json]

For each world size (local ranks; with more ranks than cores, 4 ranks share 2 cores) and each
tensor size, all_reduce, reduce_scatter and all_gather of float32 run on gloo (torch's own
collective) and on coconet's shared memory (input already in symmetric memory, as a gradient
bucket is; and an ordinary tensor, copied in), in alternation after a warm-up, with a barrier
before each timed call; the slowest rank's median over the steps is reported, with min and max.
Every result is checked against the expected sum before its time counts.

The bound next to each row is the contender's own: the bytes each rank must read and write for
the collective over shared memory (its slice of every peer's input, its reduced slice, every
peer's slice of the result; the all_reduce is donated, so a buffer in symmetric memory receives
the result in place), at the copy bandwidth measured in the same run (a copy loop on every rank at
once). gloo is not bounded by that: it moves the data over loopback sockets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from coconet.ir.ops import ReduceOp
from coconet.ir.types import slice_bounds
from coconet.runtime import CommOptions, Communicator, spawn

OPS = ("all_reduce", "reduce_scatter", "all_gather")
MiB = 1 << 20


def _gloo(op: str, x: torch.Tensor, out: torch.Tensor, world: int):
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, x)
    else:
        dist.all_gather_into_tensor(out, x[: out.numel() // world])


def _shm(op: str, comm: Communicator, x: torch.Tensor, parts):
    if op == "all_reduce":
        # in place, as gloo's all_reduce is (a DDP gradient bucket is reduced in place too)
        return comm.wait(comm.all_reduce_start(x, ReduceOp.SUM, axis=None, donate=True, label=op))
    if op == "reduce_scatter":
        return comm.wait(
            comm.reduce_scatter_start(x, ReduceOp.SUM, dim=0, axis=None, donate=False, label=op)
        )
    mine = x[: parts[comm.rank]]
    return comm.wait(comm.all_gather_start(mine, dim=0, parts=parts, axis=None, label=op))


def _bound_bytes(op: str, n: int, world: int) -> int:
    """Bytes one rank reads and writes for ``op`` of n float32 over shared memory (input in
    symmetric memory)."""
    s = 4 * n
    slice_ = s / world
    if op == "all_reduce":
        # donated, in place: read my slice of every peer and write it into my own input, then
        # copy every other rank's reduced slice out of its input into mine
        return int(world * slice_ + slice_ + 2 * (s - slice_))
    if op == "reduce_scatter":  # read my slice of every peer, write it
        return int(world * slice_ + slice_)
    return int(slice_ + s + s)  # all_gather: write my slice in, read every slice, write result


def worker(comm: Communicator, sizes_mib, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    world, rank = comm.world, comm.rank
    rows = []
    for mib in sizes_mib:
        n = mib * MiB // 4
        n -= n % world
        parts = [hi - lo for lo, hi in (slice_bounds(n, world, r) for r in range(world))]
        # coconet's buffers in symmetric memory, as a gradient bucket would be
        sym = comm.symmetric_tensor((n,), torch.float32)
        plain = torch.empty(n)
        gloo_buf = torch.empty(n)
        gloo_out = {
            "all_reduce": None,
            "reduce_scatter": torch.empty(n // world),
            "all_gather": torch.empty(n),
        }
        src, dst = torch.randn(n), torch.empty(n)
        timings: dict[tuple[str, str], list[float]] = {}
        ok: dict[tuple[str, str], bool] = {}
        for step in range(warmup + steps):
            value = float(rank + 1 + step % 3)
            total = sum(float(r + 1 + step % 3) for r in range(world))
            for op in OPS:
                for name in ("gloo", "shm", "shm (copied in)"):
                    x = {"gloo": gloo_buf, "shm": sym, "shm (copied in)": plain}[name]
                    x.fill_(value)
                    dist.barrier()
                    t = time.perf_counter()
                    if name == "gloo":
                        _gloo(op, x, gloo_out[op], world)
                        got = {"all_reduce": x}.get(op, gloo_out[op])
                    else:
                        got = _shm(op, comm, x, parts)
                    dt = time.perf_counter() - t
                    want = value if op == "all_gather" else total
                    if op == "all_gather":  # rank r's slice holds rank r's value
                        good = all(
                            bool(
                                (
                                    got[sum(parts[:r]) : sum(parts[: r + 1])] == r + 1 + step % 3
                                ).all()
                            )
                            for r in range(world)
                        )
                    else:
                        good = bool((got == want).all())
                    key = (op, name)
                    ok[key] = ok.get(key, True) and good
                    if step >= warmup:
                        timings.setdefault(key, []).append(dt * 1e3)
            dist.barrier()
            t = time.perf_counter()
            dst.copy_(src)
            if step >= warmup:
                timings.setdefault(("copy", "probe"), []).append((time.perf_counter() - t) * 1e3)
        keys = sorted(timings)
        med = torch.tensor([statistics.median(timings[k]) for k in keys], dtype=torch.float64)
        lo = torch.tensor([min(timings[k]) for k in keys], dtype=torch.float64)
        hi = torch.tensor([max(timings[k]) for k in keys], dtype=torch.float64)
        for t in (med, lo, hi):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank
        good = torch.tensor([int(ok.get(k, True)) for k in keys])
        dist.all_reduce(good, op=dist.ReduceOp.MIN)
        copy_ms = float(med[keys.index(("copy", "probe"))])
        copy_gbs = 2 * 4 * n / copy_ms / 1e6
        for i, (op, name) in enumerate(keys):
            if op == "copy":
                continue
            rows.append(
                {
                    "op": op,
                    "transport": name,
                    "MiB": mib,
                    "world": world,
                    "median_ms": round(float(med[i]), 3),
                    "min_ms": round(float(lo[i]), 3),
                    "max_ms": round(float(hi[i]), 3),
                    "correct": bool(good[i]),
                    "bound_ms": round(_bound_bytes(op, n, world) / copy_gbs / 1e6, 3),
                }
            )
        rows.append(
            {
                "op": "copy",
                "transport": "probe",
                "MiB": mib,
                "world": world,
                "median_ms": round(copy_ms, 3),
                "copy_GBps": round(copy_gbs, 2),
            }
        )
    return {"rows": rows}


def table(rows: list[dict]) -> str:
    lines = [
        f"{'world':>5} {'MiB':>4} {'op':<15} {'gloo ms':>9} {'shm ms':>8} {'shm/gloo':>9} "
        f"{'copied-in ms':>13} {'bound ms':>9}  correct"
    ]
    by = {(r["world"], r["MiB"], r["op"], r["transport"]): r for r in rows}
    for world in sorted({r["world"] for r in rows}):
        for mib in sorted({r["MiB"] for r in rows}):
            for op in OPS:
                g = by.get((world, mib, op, "gloo"))
                s = by.get((world, mib, op, "shm"))
                c = by.get((world, mib, op, "shm (copied in)"))
                if not (g and s and c):
                    continue
                speed = g["median_ms"] / s["median_ms"]
                correct = "yes" if g["correct"] and s["correct"] and c["correct"] else "NO !!!"
                lines.append(
                    f"{world:>5} {mib:>4} {op:<15} {g['median_ms']:>9.2f} {s['median_ms']:>8.2f} "
                    f"{speed:>8.1f}x {c['median_ms']:>13.2f} {s['bound_ms']:>9.2f}  {correct}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64", help="tensor sizes in MiB")
    ap.add_argument("--worlds", default="2,4", help="local ranks (more than cores: shared)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (>= 5)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    t0 = time.perf_counter()
    for world in worlds:
        print(
            f"{world} ranks: {len(sizes)} sizes x {len(OPS)} ops x 3 contenders ...",
            file=sys.stderr,
            flush=True,
        )
        out = spawn(
            worker,
            world,
            sizes,
            args.steps,
            args.warmup,
            options=CommOptions(timeout=120),
            timeout=1200,
        )
        rows += out[0]["rows"]
    doc = {
        "benchmark": "collectives",
        "command": "python benchmarks/collectives.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "config": {"sizes_mib": sizes, "worlds": worlds, "steps": args.steps, "dtype": "float32"},
        "results": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(table(rows))
    print(
        f"(median of {args.steps} steps, slowest rank; shm = input already in symmetric memory, "
        "copied-in = an ordinary tensor; bound = the bytes a rank reads and writes over shared "
        f"memory at the copy bandwidth measured in the same run; wall {doc['wall_s']} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"JSON written to {args.json}")
    return 0 if all(r.get("correct", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
