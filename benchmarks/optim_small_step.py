"""The fixed cost of a small ``coconet.optim`` step: one process (a world of one), a model of
``--params`` float32 values (default 1,000) in ``--tensors`` parameter tensors, Adam.

Contenders, in alternation (A B C ... A B C ...), each stepping its own copy of the same
parameters on the same gradient (written into ``.grad`` untimed, as ``backward()`` would):

- ``torch.optim.Adam``: the default (foreach) implementation;
- ``torch.optim.Adam(foreach=False)``: the single-tensor loop;
- ``coconet.optim.Adam [eager]``: the drop-in optimizer, its step's arithmetic as eager torch ops
  (``CompileOptions(fused_kernels=False)``);
- ``coconet.optim.Adam [compiled]``: the default, its arithmetic one torch.compile'd kernel.

The median of ``--steps`` timed steps (after ``--warmup``), in microseconds, and the ratio to
``torch.optim.Adam``; after the timed steps every contender's parameters are compared with
``torch.optim.Adam``'s (the same number of steps on the same gradients).

    python benchmarks/optim_small_step.py --params 1000 --steps 2000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import coconet.optim
from coconet import runtime
from coconet.options import CompileOptions

HP = {"lr": 1e-3, "weight_decay": 1e-2}


def _params(n: int, tensors: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sizes = [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]
    return [torch.randn(s, generator=gen) for s in sizes]


def _contenders(values: list[torch.Tensor], comm) -> dict[str, tuple[list, object]]:
    out = {}
    makers = {
        "torch.optim.Adam": lambda ps: torch.optim.Adam(ps, **HP),
        "torch.optim.Adam(foreach=False)": lambda ps: torch.optim.Adam(ps, foreach=False, **HP),
        "coconet.optim.Adam [eager]": lambda ps: coconet.optim.Adam(
            ps, comm=comm, options=CompileOptions(fused_kernels=False), **HP),
        "coconet.optim.Adam [compiled]": lambda ps: coconet.optim.Adam(ps, comm=comm, **HP),
    }
    for name, make in makers.items():
        ps = [torch.nn.Parameter(v.clone()) for v in values]
        out[name] = (ps, make(ps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1000)
    parser.add_argument("--tensors", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    comm = runtime.init()
    values = _params(args.params, args.tensors)
    contenders = _contenders(values, comm)
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for k in range(args.warmup + args.steps):
        grads = [torch.randn(v.shape, generator=gen) for v in values]
        for name, (ps, opt) in contenders.items():
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()  # assigned, as torch users do; untimed
            t0 = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - t0
            if k >= args.warmup:
                times[name].append(elapsed)
    ref = torch.cat([p.detach().reshape(-1) for p in contenders["torch.optim.Adam"][0]])
    base = statistics.median(times["torch.optim.Adam"])
    rows = []
    for name, (ps, _) in contenders.items():
        got = torch.cat([p.detach().reshape(-1) for p in ps])
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        median = statistics.median(times[name])
        rows.append({
            "contender": name,
            "median_us": median * 1e6,
            "min_us": min(times[name]) * 1e6,
            "max_us": max(times[name]) * 1e6,
            "vs_torch": median / base,
            "rel_error": rel,
        })
    print(f"Adam step, one process, {args.params} float32 parameters in {args.tensors} "
          f"tensor(s), {args.threads} thread(s), median of {args.steps} steps "
          f"(torch {torch.__version__}, {platform.processor() or platform.machine()})")
    print(f"{'contender':<34} {'median us':>10} {'min us':>8} {'max us':>9} {'vs torch':>9} "
          f"{'rel err':>9}")
    for r in rows:
        print(f"{r['contender']:<34} {r['median_us']:>10.1f} {r['min_us']:>8.1f} "
              f"{r['max_us']:>9.1f} {r['vs_torch']:>8.2f}x {r['rel_error']:>9.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "torch": torch.__version__, "rows": rows}, f,
                      indent=2)
    runtime.shutdown(comm)


if __name__ == "__main__":
    main()
