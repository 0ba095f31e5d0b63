"""What the per-step agreement costs: the one small all_reduce that, at every step, compares the
compiled step's identity (program, schedule, options), which compiled step it is, its call count
and the Replicated scalars across the ranks before any data moves. With
``check_every_step=False`` it used to be skipped; it no longer is (two programs called in
different orders on different ranks exchanged each other's data).

Two local ranks (1 torch thread each), on each transport: the median of ``--steps`` calls of

- ``agreement``: the agreement alone (``comm.agree_max`` of its 10 integers);
- ``step``: a whole small step (an SGD-like update of ``--params`` float32 values, one all_reduce,
  ``check_every_step=False, commit_vote=False``: the leanest step there is);

so ``agreement / step`` is what it adds to the cheapest step coconet runs.

    python benchmarks/step_agreement.py --params 4096 --steps 500
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import coconet as cc
from coconet.runtime import CommOptions, spawn


def _program() -> cc.Program:
    n = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [n], cc.Local)
    p = cc.Tensor("p", cc.float32, [n], cc.Replicated)
    lr = cc.Scalar("lr")
    return cc.Program("sgd", [g, p, lr], [cc.update(p, p - lr * cc.all_reduce(g))])


def _rank(comm, params: int, steps: int) -> dict:
    torch.set_num_threads(1)
    step = cc.compile(_program(), comm=comm, check_every_step=False, commit_vote=False)
    g, p = torch.ones(params), torch.zeros(params)
    agree, whole = [], []
    for _ in range(steps // 10):  # warm
        step(g=g, p=p, lr=0.1)
        comm.agree_max([0] * 10, "warm")
    for _ in range(steps):
        t0 = time.perf_counter()
        comm.agree_max([1, 2, 3, 4, 5, -1, -2, -3, -4, -5], "timing")
        agree.append(time.perf_counter() - t0)
    for _ in range(steps):
        t0 = time.perf_counter()
        step(g=g, p=p, lr=0.1)
        whole.append(time.perf_counter() - t0)
    return {"agreement": statistics.median(agree), "step": statistics.median(whole)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    print(f"{'transport':<20} {'agreement us':>13} {'step us':>10} {'share':>7}")
    for transport in ("shared memory", "torch.distributed"):
        options = CommOptions(timeout=60, transport=transport)
        results = spawn(_rank, 2, args.params, args.steps, options=options, timeout=600)
        agreement = max(r["agreement"] for r in results) * 1e6
        step = max(r["step"] for r in results) * 1e6
        print(f"{transport:<20} {agreement:>13.1f} {step:>10.1f} {agreement / step:>7.1%}")


if __name__ == "__main__":
    main()
