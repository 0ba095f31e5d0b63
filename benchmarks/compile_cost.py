"""What torch.compile costs coconet's fused Adam kernel, and what it buys per step.

For each repeat, two fresh processes share a new temporary directory:

- ``cold``: an EMPTY Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` = a new directory) and an empty
  coconet ``cache_dir``: the first step compiles the fused kernel from scratch;
- ``warm``: a second fresh process with the SAME directories: Inductor's on-disk caches hit.

Each child runs ``examples/adam.py``'s program under a schedule (default ``AR_C``: all_reduce,
then the whole update as one fused kernel) in a world of one rank (``coconet.runtime.init()``
without torchrun's environment; ``coconet.compile(..., world=1)`` only generates code, a step
needs a communicator). It times ``import torch`` + coconet, ``init()``, ``coconet.compile`` (code
generation) and the first step (torch.compile happens inside it). After the repeats, one more
warm process (kept out of the cold/warm figures) times steps, in alternation: the compiled step,
the same schedule with ``fused_kernels=False`` (eager, op by op), ``torch.optim.Adam(fused=True)``
(for scale) and a copy loop (for the lower bound).

    python benchmarks/compile_cost.py --params 4194304 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-5


# -- the child: one fresh process ---------------------------------------------------------------


def child(args) -> dict:
    t0 = time.perf_counter()
    import torch

    import coconet
    from coconet.runtime import init

    t_import = time.perf_counter() - t0
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from data_parallel_adam import compare, f32, gradient, initial_param, load_adam

    adam = load_adam()
    n = args.params
    t = time.perf_counter()
    comm = init()
    t_init = time.perf_counter() - t
    target = adam.SCHEDULES[args.schedule](adam.program())
    t = time.perf_counter()
    compiled = coconet.compile(target, comm=comm, cache_dir=args.cache_dir)
    t_codegen = time.perf_counter() - t

    scalars = {
        "lr": f32(adam.LR),
        "beta1": f32(adam.BETAS[0]),
        "beta2": f32(adam.BETAS[1]),
        "eps": f32(adam.EPS),
        "weight_decay": f32(adam.WEIGHT_DECAY),
    }
    p0 = initial_param(args.seed, n)
    grads = [gradient(args.seed, 0, k, n) for k in range(2)]

    def state():
        return {"p": p0.clone(), "m": torch.zeros(n), "v": torch.zeros(n)}

    comp = state()
    t = time.perf_counter()
    compiled(g=grads[0], step=1.0, **comp, **scalars)
    t_first = time.perf_counter() - t
    out = {
        "import_s": t_import,
        "init_s": t_init,
        "codegen_s": t_codegen,
        "first_call_s": t_first,
        "kernel_first_call_s": dict(compiled.kernels.first_call_seconds),
        "threads": torch.get_num_threads(),
    }
    if not args.time_steps:
        return out

    # The compiled step timed alone first (the same steps, on its own copy of the state): in the
    # alternation below, the eager step's many temporaries make the allocator return memory to the
    # OS and fault it in again, which the compiled step then pays for too.
    alone = state()
    compiled(g=grads[0], step=1.0, **alone, **scalars)
    alone_ms = []
    for k in range(2, 2 + args.warmup + args.steps):
        t = time.perf_counter()
        compiled(g=grads[k % 2], step=float(k), **alone, **scalars)
        if k >= 2 + args.warmup:
            alone_ms.append((time.perf_counter() - t) * 1e3)

    # Per-step times, in alternation, every contender doing the same steps from the same state.
    eager = coconet.compile(target, comm=comm, cache_dir=args.cache_dir, fused_kernels=False)
    eag = state()
    eager(g=grads[0], step=1.0, **eag, **scalars)
    param = torch.nn.Parameter(p0.clone())
    param.grad = torch.empty(n)
    betas = (scalars["beta1"], scalars["beta2"])
    opt = torch.optim.Adam(
        [param],
        lr=scalars["lr"],
        betas=betas,
        eps=scalars["eps"],
        weight_decay=scalars["weight_decay"],
        fused=True,
    )
    param.grad.copy_(grads[0])
    opt.step()
    src, dst = torch.randn(n), torch.empty(n)

    def torch_step(k, g):
        param.grad.copy_(g)  # (the gradient's arrival, as in the distributed benchmark: untimed)
        t = time.perf_counter()
        opt.step()
        return time.perf_counter() - t

    def timed(fn):
        def run(k, g):
            t = time.perf_counter()
            fn(k, g)
            return time.perf_counter() - t

        return run

    contenders = {
        "coconet compiled": timed(lambda k, g: compiled(g=g, step=float(k), **comp, **scalars)),
        "coconet eager": timed(lambda k, g: eager(g=g, step=float(k), **eag, **scalars)),
        "torch Adam(fused=True)": torch_step,
        "probe:copy": timed(lambda k, g: dst.copy_(src)),
    }
    times = {name: [] for name in contenders}
    for k in range(2, 2 + args.warmup + args.steps):
        g = grads[k % 2]
        for name, run in contenders.items():
            dt = run(k, g) * 1e3
            if k >= 2 + args.warmup:
                times[name].append(dt)
    ref = param.detach()
    out["steps_ms"] = {"coconet compiled, timed alone": alone_ms, **times}
    out["errors"] = {
        "coconet compiled, timed alone": compare(alone["p"], ref),
        "coconet compiled": compare(comp["p"], ref),
        "coconet eager": compare(eag["p"], ref),
    }
    out["lr"] = scalars["lr"]
    return out


# -- the parent ---------------------------------------------------------------------------------


def run_child(args, cache: Path, time_steps: bool) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--params",
        str(args.params),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--schedule",
        args.schedule,
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--cache-dir",
        str(cache / "coconet"),
    ] + (["--time-steps"] if time_steps else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child failed with exit code {proc.returncode}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = wall
    return result


def stats(values: list[float]) -> dict:
    return {
        "median_ms": round(statistics.median(values), 3),
        "min_ms": round(min(values), 3),
        "max_ms": round(max(values), 3),
    }


def build_doc(args, cold: list[dict], warm: list[dict], timed: dict, before, after) -> dict:
    from data_parallel_adam import machine

    results = []
    for label, runs in (("cold", cold), ("warm", warm)):
        for key, what in (
            ("process_wall_s", "whole process (python start to exit)"),
            ("import_s", "import torch + coconet"),
            ("first_call_s", "first step (torch.compile of the fused kernel inside)"),
        ):
            row = {"name": f"{label}: {key[:-2]}", "kind": "compile", "what": what}
            row.update(stats([r[key] * 1e3 for r in runs]))
            results.append(row)
    steps = timed["steps_ms"]
    from data_parallel_adam import is_correct

    errs = timed["errors"]
    for name, ts in steps.items():
        row = {"name": name, "kind": "probe" if name.startswith("probe") else "step"}
        row.update(stats(ts))
        if name in errs:
            row.update(errs[name])
            row["correct"] = is_correct(errs[name], args.params, timed["lr"])
        elif row["kind"] == "step":
            row["correct"] = True  # the reference
        results.append(row)
    copy_ms = statistics.median(steps["probe:copy"])
    copy_gbs = 2 * 4 * args.params / copy_ms / 1e6
    mem_bytes = 7 * 4 * args.params  # read g, p, m, v; write p, m, v (world of one)
    return {
        "benchmark": "compile_cost",
        "machine": machine(before, after),
        "world_size": 1,
        "config": {
            "params": args.params,
            "dtype": "float32",
            "schedule": args.schedule,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "threads": args.threads,
            "rtol": RTOL,
            "correct_if": "as data_parallel_adam.py's is_correct, against torch Adam(fused=True)",
        },
        "lower_bound_ms": round(mem_bytes / copy_gbs / 1e6, 3),
        "lower_bound": {"memory_bytes": mem_bytes, "copy_GBps": round(copy_gbs, 3)},
        "runs": {"cold": cold, "warm": warm, "steps": timed},
        "results": results,
    }


def table(doc: dict) -> str:
    cfg = doc["config"]
    m = doc["machine"]
    runs = doc["runs"]
    lines = [
        f"compile_cost: coconet's fused Adam kernel (schedule {cfg['schedule']}), "
        f"{cfg['params']:,} float32 params, world of one, {cfg['threads']} torch thread(s), "
        f"{cfg['repeats']} repeat(s)",
        f"machine: {m['cpus']} cpus ({m['cpu_model']}), torch {m['torch']}, load average "
        f"{m['loadavg_before']} before / {m['loadavg_after']} after",
        f"coconet source digest {m['coconet_source_digest']}; environment {m['env']}",
        "",
        f"{'fresh process, seconds: median [each repeat]':<55} {'cold cache':<24}warm cache",
    ]

    def cell(label, get):
        c, w = [get(r) for r in runs["cold"]], [get(r) for r in runs["warm"]]
        cs = ", ".join(f"{x:.1f}" for x in c)
        ws = ", ".join(f"{x:.1f}" for x in w)
        lines.append(
            f"  {label:<53} {statistics.median(c):>6.2f} [{cs}]".ljust(81)
            + f"{statistics.median(w):>6.2f} [{ws}]"
        )

    cell("whole process (python start to exit)", lambda r: r["process_wall_s"])
    cell("import torch + coconet", lambda r: r["import_s"])
    cell("coconet.runtime.init() (world of one)", lambda r: r["init_s"])
    cell("coconet.compile (generate + load the module)", lambda r: r["codegen_s"])
    cell("first step (torch.compile inside)", lambda r: r["first_call_s"])
    kernel = next(iter(runs["cold"][0]["kernel_first_call_s"]), None)
    if kernel:
        cell(
            f"  of which kernel {kernel}'s first call",
            lambda r: r["kernel_first_call_s"][kernel],
        )
        cell(
            "  the rest (mostly importing torch.compile's stack)",
            lambda r: r["first_call_s"] - r["kernel_first_call_s"][kernel],
        )
    lines += [
        "",
        f"per step, one more warm process: {cfg['steps']} steps after {cfg['warmup']} warm-up of "
        "the compiled step alone, then of all in alternation (ms)",
        f"  {'name':<30} {'median':>8} {'min':>8} {'max':>8}  {'correct':<8} {'norm err':>9} "
        f"{'max err':>9} {'outliers':>8}",
    ]
    for r in doc["results"]:
        if r["kind"] not in ("step", "probe"):
            continue
        ok = "" if "correct" not in r else ("yes" if r["correct"] else "NO !!!")
        err = ""
        if "max_rel_err" in r:
            err = f"{r['norm_rel_err']:>9.1e} {r['max_rel_err']:>9.1e} {int(r['outliers']):>8}"
        lines.append(
            f"  {r['name']:<30} {r['median_ms']:>8.2f} {r['min_ms']:>8.2f} {r['max_ms']:>8.2f}  "
            f"{ok:<8} {err}".rstrip()
        )
    by = {r["name"]: r for r in doc["results"]}
    c, e = by["coconet compiled"]["median_ms"], by["coconet eager"]["median_ms"]
    # (both in the alternation: the same conditions)
    first_cold = by["cold: first_call"]["median_ms"]
    first_warm = by["warm: first_call"]["median_ms"]
    saved = e - c
    lines += [
        "",
        f"compiled is {e / c:.1f}x faster than eager per step ({saved:.1f} ms saved); the cold "
        f"first call pays for itself after {first_cold / saved:.0f} steps, the warm one after "
        f"{first_warm / saved:.0f}"
        if saved > 0
        else "compiled is not faster than eager here",
        f"lower bound per step {doc['lower_bound_ms']:.2f} ms: "
        f"{doc['lower_bound']['memory_bytes'] / 2**20:.0f} MiB (read g, p, m, v; write p, m, v) "
        f"at the copy probe's {doc['lower_bound']['copy_GBps']:.2f} GB/s",
        "correct: parameters after all steps vs torch.optim.Adam(fused=True)'s, as in "
        "data_parallel_adam.py: norm err <= 1e-6,",
        f"  at most 1 element per million (min 1) beyond {RTOL:g} max|ref| (outliers: where "
        "g + weight_decay*p cancels to ~eps), each within lr",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=4 * 1024 * 1024, help="float32 parameters")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per contender (>= 10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="cold/warm process pairs")
    ap.add_argument("--schedule", default="AR_C", help="a key of examples/adam.py's SCHEDULES")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a rank)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-steps", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.steps < 10:
        ap.error("--steps must be at least 10")

    before = [round(x, 2) for x in os.getloadavg()]
    cold, warm = [], []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="coconet-compile-cost-") as tmp:
            for label, runs in (("cold", cold), ("warm", warm)):
                print(f"repeat {rep + 1}/{args.repeats}: {label} process ...", file=sys.stderr)
                runs.append(run_child(args, Path(tmp), time_steps=False))
            if rep == args.repeats - 1:  # per-step times: one more warm process, kept apart
                print("per-step times (another warm process) ...", file=sys.stderr)
                steps = run_child(args, Path(tmp), time_steps=True)
    after = [round(x, 2) for x in os.getloadavg()]
    doc = build_doc(args, cold, warm, steps, before, after)
    print(table(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"JSON written to {args.json}")
    return 0 if all(r.get("correct", True) for r in doc["results"]) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
