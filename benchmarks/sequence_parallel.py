"""Sequence-parallel layers: does overlapping the all_gather with the matmul it feeds (and the
matmul with its reduce_scatter) pay? (issue 20, deliverable 4).

The MLP of one GPT block with Megatron's sequence parallelism, TP=2, 2 ranks x 1 thread: the
input ``[T, B, d]`` split along the sequence (dim 0); ``c_fc = ColumnParallelLinear(d, 4d,
sequence_parallel=True)`` all_gathers the sequence and multiplies; ``c_proj =
RowParallelLinear(4d, d, sequence_parallel=True)`` multiplies and reduce_scatters along the
sequence, then adds its bias. Each layer, and the MLP's training step (forward + backward),
runs with ``schedule=None`` (the program as written: the collective, then the matmul) and with
the overlapped schedules (``"ol_AG_MM"``, ``"ol_MM_RS_C"``, ``"ol_sequence_parallel"``: 4 chunks
of rows, chunk c's collective in flight while chunk c - 1's rows are multiplied) and (the MLP)
``"auto"`` (``coconet.tune``'s pick for each program at its first call's shape), over gloo
(whose collectives progress on a thread of their own) and over shared memory (where a collective
completes where it starts, on the calling rank's core). Next to them, the parts run alone (the
collective alone, the matmul alone): a step at the parts' sum overlaps nothing, at the larger
part's time it hides the smaller wholly. Also Megatron-style by hand: ``torch.distributed``'s
all_gather (gloo) then ``F.linear``, what a user writes without coconet.

Timing: every contender in alternation within each round (a burst of load from another job falls
on one round of each), a barrier before each, the slowest rank's median over ``--rounds``. Every
contender's output (and in training every gradient) is checked against the unscheduled layer's in
the same run (rtol 1e-5: a matmul over a chunk of rows may round its last bit otherwise).

Two ranks fill this 2-core machine: gloo's thread competes with the other rank's compute for the
cores, so overlap here is bounded by what the cores can give. ``--json`` writes every median.

    python benchmarks/sequence_parallel.py --json benchmarks/results/sequence_parallel.json \
        | tee benchmarks/results/sequence_parallel.txt
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from coconet.runtime import CommOptions, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel_adam import cpu_model  # noqa: E402  (one definition for the benchmarks)


def _part(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.tensor_split(world, dim=0)[rank].contiguous()


def worker(comm, cfg: dict) -> dict:
    import coconet.nn as cnn

    torch.set_num_threads(1)
    rank, world = comm.rank, comm.world
    t, b, d = cfg["tokens"], cfg["batch"], cfg["d_model"]
    torch.manual_seed(0)
    fc, proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    x = torch.randn(t, b, d)
    d_out = torch.randn(t, b, d)
    mine, d_mine = _part(x, rank, world), _part(d_out, rank, world)
    gloo = comm.variant(CommOptions(transport="torch.distributed", timeout=120))
    comms = {"shm": comm, "gloo": gloo}

    layers: dict[str, Any] = {}
    for tname, c in comms.items():
        for sched in (None, "ol_AG_MM"):
            layers[("col", tname, sched)] = cnn.ColumnParallelLinear.from_linear(
                fc, comm=c, sequence_parallel=True, schedule=sched)
        for sched in (None, "ol_MM_RS_C"):
            layers[("row", tname, sched)] = cnn.RowParallelLinear.from_linear(
                proj, comm=c, sequence_parallel=True, schedule=sched)
        for sched in (None, "ol_sequence_parallel", "auto"):
            layers[("mlp", tname, sched)] = (
                cnn.ColumnParallelLinear.from_linear(fc, comm=c, sequence_parallel=True,
                                                     schedule=sched),
                cnn.RowParallelLinear.from_linear(proj, comm=c, sequence_parallel=True,
                                                  schedule=sched))  # fmt: skip

    hidden_mine = torch.randn(t, b, 4 * d // world).tensor_split(world, dim=0)[rank].contiguous()
    h_in = torch.randn(t, b, 4 * d // world)  # the row layer's input: this rank's features
    w_col = layers[("col", "shm", None)].weight.detach()
    w_row = layers[("row", "shm", None)].weight.detach()
    gathered = torch.empty(t, b, d)
    del hidden_mine

    def col_fn(layer):
        def run():
            with torch.no_grad():
                return layer(mine)
        return run

    def row_fn(layer):
        def run():
            with torch.no_grad():
                return layer(h_in)
        return run

    def mlp_fn(pair):
        col, row = pair

        def run():
            for p in (*col.parameters(), *row.parameters()):
                p.grad = None
            xa = mine.clone().requires_grad_(True)
            out = row(F.gelu(col(xa)))
            out.backward(d_mine)
            return torch.cat([out.detach().flatten(), xa.grad.flatten(),
                              col.weight.grad.flatten(), row.weight.grad.flatten()])
        return run

    def megatron_col():
        # what a user writes: torch.distributed's all_gather (gloo), then the matmul
        dist.all_gather_single(gathered, mine)
        return F.linear(gathered, w_col, layers[("col", "shm", None)].bias.detach())

    def ag_alone():
        w = gloo.all_gather_start(mine, dim=0, parts=[p.shape[0] for p in x.tensor_split(world)],
                                  axis=None, label="probe")
        return gloo.wait(w)

    def col_mm_alone():
        return F.linear(x, w_col)

    def row_mm_alone():
        return F.linear(h_in, w_row)

    def rs_alone():
        from coconet.ir.ops import ReduceOp

        part = torch.empty(t, b, d)  # what the row layer reduce_scatters
        return gloo.wait(gloo.reduce_scatter_start(part, ReduceOp.SUM, dim=0, axis=None,
                                                   donate=True, label="probe"))  # fmt: skip

    contenders: dict[str, tuple[str, Any]] = {}
    kinds = (("col", "column forward", col_fn, ("ol_AG_MM",)),
             ("row", "row forward", row_fn, ("ol_MM_RS_C",)),
             ("mlp", "MLP training", mlp_fn, ("ol_sequence_parallel", "auto")))  # fmt: skip
    for tname in comms:
        for kind, label, make, schedules in kinds:
            contenders[f"{label} [{tname}] as written"] = (kind, make(layers[(kind, tname, None)]))
            for sched in schedules:
                contenders[f"{label} [{tname}] {sched}"] = (kind,
                                                            make(layers[(kind, tname, sched)]))
    megatron = "column forward: Megatron-style (gloo all_gather, then F.linear)"
    contenders[megatron] = ("col", megatron_col)
    probes = {
        "part: all_gather alone [gloo]": ag_alone,
        "part: column matmul alone": col_mm_alone,
        "part: reduce_scatter alone [gloo]": rs_alone,
        "part: row matmul alone": row_mm_alone,
    }

    # correctness: every contender against its kind's unscheduled shm layer (first calls compile)
    reference = {kind: None for kind in ("col", "row", "mlp")}
    errors: dict[str, float] = {}
    for name, (kind, fn) in contenders.items():
        out = fn().detach()
        if reference[kind] is None:
            reference[kind] = out
        errors[name] = float(((out - reference[kind]).abs().max() /
                              reference[kind].abs().max()).item())  # fmt: skip

    timed = [(n, fn) for n, (_, fn) in contenders.items()] + list(probes.items())
    times: dict[str, list[float]] = {n: [] for n, _ in timed}
    for r in range(cfg["rounds"] + 1):
        for name, fn in timed:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r:  # round 0 warms up
                times[name].append(dt)
    # the slowest rank's time per round
    out: dict[str, list[float]] = {}
    for name, ts in times.items():
        v = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        out[name] = v.tolist()
    picks = {f"MLP training [{tname}] auto: {layer.__class__.__name__} "
             f"{r.program.name}": str(r.winner)
             for tname in comms for layer in layers[("mlp", tname, "auto")]
             for r in layer.tuning}  # fmt: skip
    return {"times": out, "errors": errors, "picks": picks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="sequence length T (default 512)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", help="write every median here")
    args = ap.parse_args()
    cfg = {"tokens": args.tokens, "batch": args.batch, "d_model": args.d_model,
           "rounds": args.rounds}  # fmt: skip
    load_before = os.getloadavg()
    t0 = time.time()
    results = spawn(worker, 2, cfg, options=CommOptions(timeout=120), timeout=1800)
    r0 = results[0]
    med = {n: 1e3 * statistics.median(v) for n, v in r0["times"].items()}
    lo = {n: 1e3 * min(v) for n, v in r0["times"].items()}
    hi = {n: 1e3 * max(v) for n, v in r0["times"].items()}
    d = args.d_model
    print(f"sequence_parallel: MLP of one GPT block (d_model {d}, hidden {4 * d}), float32, "
          f"x [{args.tokens}, {args.batch}, {d}] split along the sequence over TP=2, "
          f"2 ranks x 1 thread, {args.rounds} rounds (slowest rank, median)")
    print(f"machine: {os.cpu_count()} cpus ({cpu_model()}), "
          f"torch {torch.__version__}, load average {[round(v, 2) for v in load_before]} before"
          f" / {[round(v, 2) for v in os.getloadavg()]} after")
    print("NOTE: two ranks fill the 2 cores: gloo's thread competes with the ranks' compute.\n")
    print(f"{'contender':<66} {'median ms':>10} {'min':>8} {'max':>8} {'max rel err':>12}")
    errors = r0["errors"]
    for n in med:
        err = f"{errors[n]:.1e}" if n in errors else ""
        print(f"{n:<66} {med[n]:>10.3f} {lo[n]:>8.3f} {hi[n]:>8.3f} {err:>12}")
    summary: dict[str, Any] = {}
    print()
    for tname in ("gloo", "shm"):
        for kind, sched in (("column forward", "ol_AG_MM"), ("row forward", "ol_MM_RS_C"),
                            ("MLP training", "ol_sequence_parallel")):  # fmt: skip
            base, ol = med[f"{kind} [{tname}] as written"], med[f"{kind} [{tname}] {sched}"]
            summary[f"{kind} [{tname}]: as written / {sched}"] = round(base / ol, 3)
            print(f"{kind} [{tname}]: as written {base:.3f} ms, {sched} {ol:.3f} ms: "
                  f"{base / ol:.2f}x")
    for kind, coll, mm in (("column forward", "all_gather", "column"),
                           ("row forward", "reduce_scatter", "row")):  # fmt: skip
        c, m = med[f"part: {coll} alone [gloo]"], med[f"part: {mm} matmul alone"]
        step = med[f"{kind} [gloo] {'ol_AG_MM' if coll == 'all_gather' else 'ol_MM_RS_C'}"]
        hidden = (c + m - step) / c if c else float("nan")
        summary[f"{kind} [gloo]: share of the {coll} hidden"] = round(hidden, 3)
        said = (f"{100 * hidden:.0f}% of the {coll} hidden" if hidden >= 0 else
                f"nothing hidden: {step - c - m:.3f} ms more than the parts one after the other")
        print(f"{kind} [gloo], overlapped: {step:.3f} ms against its {coll} alone {c:.3f} + its "
              f"matmul alone {m:.3f} = {c + m:.3f} ms: {said}")
    meg = med["column forward: Megatron-style (gloo all_gather, then F.linear)"]
    best = min(med["column forward [gloo] ol_AG_MM"], med["column forward [shm] ol_AG_MM"],
               med["column forward [shm] as written"])
    summary["column forward: Megatron-style (gloo) / best coconet"] = round(meg / best, 3)
    print(f"column forward: Megatron-style by hand on gloo {meg:.3f} ms; best coconet "
          f"{best:.3f} ms: {meg / best:.2f}x")
    print("the tuner's picks (schedule=\"auto\", tuned at the first call's shape):")
    for k, v in r0["picks"].items():
        print(f"  {k}: {v}")
    bad = {n: e for n, e in errors.items() if not e <= 1e-5}
    print("correct: every contender within 1e-5 of the unscheduled layer" if not bad
          else f"MISMATCH: {bad}")
    print(f"(wall time {time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "medians_ms": med, "min_ms": lo, "max_ms": hi,
                       "errors": errors, "summary": summary, "picks": r0["picks"],
                       "meta": {"cpus": os.cpu_count(), "cpu_model": cpu_model(),
                                "torch": torch.__version__,
                                "loadavg_before": load_before}}, f, indent=1)  # fmt: skip
        print(f"JSON written to {args.json}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
