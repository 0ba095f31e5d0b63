"""Do the tuner's two ways of timing two candidates agree with themselves, run after run?

The tuner's first round times one candidate after the other (warm-up, then the median of its
steps); its deciding round (``coconet.tune.measure.rematch``) times the two best again with
their steps interleaved (A B B A ...). On a shared host a slow spell during one candidate's turn
lands on that candidate only in the first way, on both in the second. This benchmark runs both
ways ``--repeats`` times in one pair of processes (2 ranks x 1 torch thread) on data-parallel
Adam and reports, for each repeat, each way's two medians and which candidate it picks:

    python benchmarks/tune_rematch.py --size 16M --pair fuse_RS_C_AG,AR_C \\
        --json benchmarks/results/tune_rematch_16M.json

The first round alternates which candidate goes first, as the tuner's order (by prediction)
could be either.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
NOTE = (
    "NOTE: 2 ranks x 1 thread on a {cpus}-core machine: the ranks fill the cores; the point is "
    "how each way of timing agrees with itself across repeats, not the absolute times."
)
SIZES = {"1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}


def worker(comm, n: int, names: list[str], repeats: int, reps: int, commit: str) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.examples_loader import load_example

    from coconet.options import CompileOptions, TransportKind
    from coconet.tune.candidates import enumerate_candidates
    from coconet.tune.measure import Communicators, measure, rematch

    torch.set_num_threads(1)
    prog = load_example("adam").program()
    cands, _ = enumerate_candidates(prog, [TransportKind.SHARED_MEMORY], state=("m", "v"))
    by = {c.name: c for c in cands}
    a, b = by[names[0]], by[names[1]]
    comms = Communicators(comm)
    options = CompileOptions(commit=commit)
    rows = []
    for r in range(repeats):
        order = [a, b] if r % 2 == 0 else [b, a]
        first = {m.candidate.name: m.ms for m in measure(order, comms, {"N": n}, options=options,
                                                         reps=reps)}
        again = rematch(a, b, comms, {"N": n}, options=options, steps=reps)
        rows.append({
            "first_round_order": [c.name for c in order],
            "first_round_ms": [first[a.name], first[b.name]],
            "interleaved_ms": list(again.medians) if again is not None else None,
        })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="16M", choices=sorted(SIZES))
    ap.add_argument("--pair", default="fuse_RS_C_AG,AR_C", help="two candidates' names")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--reps", type=int, default=7, help="timed steps per candidate and way")
    ap.add_argument("--commit", choices=["copy", "swap"], default="swap")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    from coconet.runtime import CommOptions, spawn

    names = [s.strip() for s in args.pair.split(",")]
    if len(names) != 2:
        raise SystemExit("--pair takes two candidate names, e.g. fuse_RS_C_AG,AR_C")
    n = SIZES[args.size]
    t0 = time.perf_counter()
    rows = spawn(worker, 2, n, names, args.repeats, args.reps, args.commit,
                 options=CommOptions(timeout=300), timeout=3600)[0]
    print(NOTE.format(cpus=os.cpu_count()))
    print(f"== adam N={n:,}: {names[0]} (A) against {names[1]} (B), shared memory, "
          f"commit={args.commit}, {args.reps} steps per candidate per way\n")
    print(f"{'repeat':>6}  {'first round (A, B) ms':>24}  {'pick':>4}  "
          f"{'interleaved (A, B) ms':>24}  {'pick':>4}")

    def pick(pair):
        return "-" if pair is None or None in pair else ("A" if pair[0] <= pair[1] else "B")

    def ratio(pair):
        return None if pair is None or None in pair else pair[1] / pair[0]

    for i, r in enumerate(rows, 1):
        f, g = r["first_round_ms"], r["interleaved_ms"]
        fs = "failed" if None in f else f"{f[0]:.2f}, {f[1]:.2f}"
        gs = "failed" if g is None else f"{g[0]:.2f}, {g[1]:.2f}"
        print(f"{i:>6}  {fs:>24}  {pick(f):>4}  {gs:>24}  {pick(g):>4}")
    summary = {}
    for way, key in (("first round", "first_round_ms"), ("interleaved", "interleaved_ms")):
        picks = [pick(r[key]) for r in rows]
        ratios = [x for x in (ratio(r[key]) for r in rows) if x is not None]
        summary[way] = {
            "picks_A": picks.count("A"),
            "picks_B": picks.count("B"),
            "B_over_A": {"min": min(ratios), "median": statistics.median(ratios),
                         "max": max(ratios)} if ratios else None,
        }
        s = summary[way]["B_over_A"]
        spread = f"B/A {s['min']:.2f}-{s['max']:.2f} (median {s['median']:.2f})" if s else ""
        print(f"\n{way}: picks A {picks.count('A')} of {len(rows)}, B {picks.count('B')}; "
              f"{spread}")
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"size": n, "pair": names, "commit": args.commit, "reps": args.reps,
             "rows": rows, "summary": summary}, indent=1))
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
