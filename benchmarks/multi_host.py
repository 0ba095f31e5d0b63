"""Data-parallel Adam across two hosts: what a second machine costs today, against the link.

Two namespace hosts on this machine (``tests/support/hosts.py``: each its own network, UTS, PID
and mount namespaces and /dev/shm, a veth link to a bridge shaped with ``tc tbf`` to
``--rates``), 1 and 2 ranks per host (``--nproc``; ``2+1``: hosts of 2 and 1 ranks, which the
hierarchical transport runs through one leader per host) (torchrun agents with --nnodes 2), run
``benchmarks/data_parallel.py``'s contenders in one process group, in alternation, the slowest
rank's time of each step:

- ``ddp``: gloo all_reduce of the gradient + ``torch.optim.Adam(fused=True)``;
- ``zero``: ``ZeroRedundancyOptimizer`` over the same;
- ``coconet.optim.Adam[hierarchical]``: the default transport, **two levels**
  (``coconet.runtime.hierarchy``: shared memory inside each host and pipelined point-to-point
  exchanges between; with 1 rank per host, the exchanges alone);
- ``coconet.optim.Adam[gloo]``: torch.distributed forced (**flat**: gloo for everything);

and, at 2 ranks per host (``--no-bf16``: not), the gradients sent in bfloat16
(``data_parallel.py --bf16``):

- ``ddp[bf16_compress_hook]``: a real ``DistributedDataParallel`` with torch's
  ``default_hooks.bf16_compress_hook`` (the bucket cast to bfloat16, divided by the world size,
  gloo all_reduce in bfloat16, cast back; registered through a one-line wrapper: DDP refuses it
  by name without CUDA + NCCL) + ``torch.optim.Adam(fused=True)``, ``backward()`` + ``step()``
  timed (a backward that only hands the gradient over);
- ``coconet.optim.Adam[hierarchical][reduce bf16]``: ``reduce_dtype=torch.bfloat16`` (each rank's
  gradient cast to bfloat16, reduced with float32 accumulation, rounded once, widened,
  averaged; the parameters stay float32, and are gathered in float32);
- ``coconet.optim.Adam[hierarchical][bf16]``: bfloat16 parameters ``p0.to(bf16)`` (the
  gradient rounded to bfloat16 into their ``.grad``): the bfloat16 gradients reduced the same
  way, each rank's float32 master slice updated, rounded to bfloat16 and the bfloat16
  parameters all-gathered.

Their results are checked against ``torch.optim.Adam`` on the gradient with their own rounding
(coconet's: ``hierarchy.reduce_order``, each host's sum rounded to bfloat16, then the hosts'
sum rounded again; DDP's: its own reduced gradient, checked element by element to be gloo's
bfloat16 ring sum); the bfloat16 step's float32 master (``state_dict()``'s ``master_param``)
against a float32 master from ``p0.to(bf16).float()``, its parameters exactly the master's
rounding (elements whose first Adam update is ill-conditioned, ``|g + weight_decay * p| <
1e-6``, left out of the max error, each within ``lr``: their count is printed). The targets
``2 x 2, 1gbit: hierarchical bf16 reduce / ddp bf16_compress_hook`` and ``... hierarchical bf16
step / ddp bf16_compress_hook`` (each >= 1.5) are DDP's median over coconet's.

The link-rate bound is what any algorithm must move across the link per step: each host needs
the other host's half of the reduced gradient and sends its own (reduce_scatter at host level),
then the same for the parameters (all_gather): the gradient's bytes S each way, S / rate (the
update and the copies inside a host are not counted). Two levels reach it; a flat ring over
2 x 2 ranks sends 1.5 S across each direction of the link, so no flat contender (DDP's gloo
all_reduce included) can be faster than 1.5x the bound, and "hierarchical >= 2x DDP" would need
DDP at 2x the bound or more.

With bfloat16 on the link the bound is S / 2 / rate (``bf16 bound``; the ``x bound`` of the
three bfloat16 rows is over it): half the float32 step's bytes, e.g. the bfloat16 gradient's
reduce_scatter and the bfloat16 parameters' all_gather between the hosts. What each bfloat16
contender moves across each direction of the link per step:

- ``coconet.optim.Adam[hierarchical][bf16]``: bfloat16 gradients (S / 4) and bfloat16
  parameters (S / 4): 0.5 S, the bound itself;
- ``coconet.optim.Adam[hierarchical][reduce bf16]``: bfloat16 gradients (S / 4) and float32
  parameters (S / 2): 0.75 S (1.5x the bound: ``link_bound_bf16_sliced_ms``);
- ``ddp[bf16_compress_hook]``: a flat bfloat16 ring all_reduce over 2 x 2 ranks, 1.5 x S / 2:
  0.75 S, as much.

So only the bfloat16 step can reach 1.5x DDP's hook on bytes alone (0.75 / 0.5), and only at
the bound.

2 hosts x 2 ranks oversubscribe the 2 cores (4 ranks); the hosts share one kernel, the page cache
and the cores, and there is no added latency (``netem`` is not available here). Needs root
(namespaces); exits with a message where it cannot make them.

    python benchmarks/multi_host.py --json benchmarks/results/multi_host.json
    python benchmarks/multi_host.py --rates 1gbit --nproc 2 --params 4M --steps 5
    python benchmarks/multi_host.py --rates 1gbit --nproc 2+1    # hosts of 2 and 1: leaders
    python benchmarks/multi_host.py --rates 1gbit --nproc 2 --params 16M --steps 10 \
        --json out.json    # 2 x 2 with the bfloat16 rows and their targets
    python benchmarks/multi_host.py --local-sgd 8 --json benchmarks/results/local_sgd.json

``--local-sgd K`` runs ``benchmarks/local_sgd.py`` instead (2 x 2 ranks, the first of
``--rates``): Overlap Local-SGD and Local SGD with period K against a local step, torch's
post-local-SGD and the synchronous hierarchical step, with that issue's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from data_parallel import parse_size  # noqa: E402
from data_parallel_adam import cpu_model  # noqa: E402
from support.hosts import Hosts  # noqa: E402

RATE_BITS = {"gbit": 1e9, "mbit": 1e6}


def rate_bytes_per_s(rate: str) -> float:
    for unit, scale in RATE_BITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise SystemExit(f"multi_host: --rates takes e.g. 1gbit, 10gbit or 500mbit, got {rate!r}")


def parse_nproc(token: str) -> int | tuple[int, int]:
    """``"2"``: 2 ranks on each host; ``"2+1"``: 2 on the first host and 1 on the second (the
    hierarchical transport goes through one leader per host)."""
    try:
        counts = tuple(int(n) for n in token.split("+"))
    except ValueError:
        counts = ()
    if len(counts) not in (1, 2) or min(counts, default=0) < 1:
        raise SystemExit(f"multi_host: --nproc takes counts like 1, 2 or 2+1, got {token!r}")
    return counts[0] if len(counts) == 1 else counts


def measure(rate: str, nproc: int | tuple[int, int], cfg: dict) -> dict:
    with Hosts(2, rate=rate) as hosts:
        doc = hosts.run("data_parallel:worker", cfg, nproc=nproc, timeout=cfg["timeout"],
                        env={"COCONET_HOSTS_TIMEOUT": "600"}, path=(str(HERE),))[0]
    if isinstance(doc, BaseException):
        raise SystemExit(f"multi_host: {rate}, 2 x {nproc}: {type(doc).__name__}: {doc}")
    link_ms = 4 * cfg["params"] / rate_bytes_per_s(rate) * 1e3
    per_host = nproc if isinstance(nproc, int) else "+".join(map(str, nproc))
    # bfloat16 gradients and parameters: half the bytes (coconet's bfloat16 step)
    # (a sliced step that gathers float32 parameters, or DDP's flat bfloat16 ring: 0.75 S)
    bf16 = ({"link_bound_bf16_ms": round(link_ms / 2, 3),
             "link_bound_bf16_sliced_ms": round(link_ms * 0.75, 3)} if cfg.get("bf16") else {})
    return {"rate": rate, "hosts": 2, "ranks_per_host": per_host, "rows": doc["rows"],
            "link_bound_ms": round(link_ms, 3), "bf16": bool(cfg.get("bf16")), **bf16}


def sent_in_bf16(row: dict) -> bool:
    """A row of ``data_parallel.py --bf16`` (bfloat16 on the link): its ``x bound`` is over
    the bfloat16 bound S / 2 / rate."""
    return "bf16" in row["name"]


def master_note(row: dict) -> str:
    """The bfloat16 step's extra checks (its float32 master is what was compared)."""
    if "params_not_master_rounding" not in row:
        return ""
    note = (f"; its float32 master compared, its bfloat16 parameters "
            f"{row['params_not_master_rounding']} element(s) off the master's rounding")
    if "ill_conditioned" in row:
        note += (f"; {row['ill_conditioned']} ill-conditioned element(s) left out (max abs err "
                 f"{row['ill_conditioned_max_abs_err']:.1e}, every element: max rel err "
                 f"{row['max_rel_err_vs_reference_every_element']:.1e})")
    return note


def targets(runs: list[dict]) -> list[dict]:
    """The multi-host issue's targets (2 x 2 ranks, 1 Gbit/s), from this run's medians (coconet
    flat: ``[gloo]``); a contender this run does not have is a target missed with no value."""
    out = []
    for run in runs:
        if run["ranks_per_host"] != 2 or run["rate"] != "1gbit":
            continue
        by = {r["name"]: r["median_ms"] for r in run["rows"]}
        hier = by.get("coconet.optim.Adam[hierarchical]")
        flat, ddp = by["coconet.optim.Adam[gloo]"], by["ddp"]
        hier16 = by.get("coconet.optim.Adam[hierarchical][reduce bf16]")
        half = by.get("coconet.optim.Adam[hierarchical][bf16]")
        hook = by.get("ddp[bf16_compress_hook]")
        no_hier, no_bf16 = "no hierarchical row", "no bf16 rows (--no-bf16)"
        for name, value, threshold, why in (
            ("hierarchical / coconet flat (speed-up)", hier and flat / hier, 1.5, no_hier),
            ("hierarchical / ddp (speed-up)", hier and ddp / hier, 2.0, no_hier),
            ("hierarchical / link bound (at most)", hier and hier / run["link_bound_ms"], 1.3,
             no_hier),
            ("hierarchical bf16 reduce / ddp bf16_compress_hook", hier16 and hook and hook / hier16,
             1.5, no_bf16 if hook is None else no_hier),
            ("hierarchical bf16 step / ddp bf16_compress_hook", half and hook and hook / half,
             1.5, no_bf16 if hook is None else no_hier),
        ):
            at_most = "at most" in name
            met = value is not None and (value <= threshold if at_most else value >= threshold)
            out.append({"name": f"2 x 2, 1gbit: {name}",
                        "value": None if value is None else round(value, 3),
                        "threshold": threshold, "met": met,
                        **({} if value is not None else {"why": why})})
    return out


def table(doc: dict) -> str:
    cfg = doc["config"]
    lines = [f"multi_host: adam, {cfg['params']:,} float32 params, 2 namespace hosts, "
             f"{cfg['steps']} timed steps after {cfg['warmup']} warm-up; "
             f"{doc['machine']['cpu_model']}, {doc['machine']['cpus']} cpus", ""]
    for run in doc["runs"]:
        bf16 = (f"; bf16 bound {run['link_bound_bf16_ms']:.1f} ms (bf16 gradients and "
                f"parameters: the bf16 rows' x bound; float32 parameters gathered, or DDP's flat "
                f"bf16 ring: {run['link_bound_bf16_sliced_ms']:.1f})"
                if "link_bound_bf16_ms" in run else "")
        lines.append(f"link {run['rate']}, 2 hosts x {run['ranks_per_host']} rank(s); link-rate "
                     f"bound {run['link_bound_ms']:.1f} ms{bf16}")
        ddp = next(r for r in run["rows"] if r["kind"] != "probe")
        width = max(30, *(len(r["name"]) for r in run["rows"]))
        lines.append(f"  {'name':<{width}} {'median ms':>10} {'min':>8} {'max':>8} {'ddp/this':>9} "
                     f"{'x bound':>8} {'correct':>8}")
        for r in run["rows"]:
            if r["kind"] == "probe" and r["name"] != "probe:all_reduce":
                continue
            speed = f"{ddp['median_ms'] / r['median_ms']:.2f}x" if r["kind"] != "probe" else ""
            of = run["link_bound_bf16_ms"] if sent_in_bf16(r) else run["link_bound_ms"]
            bound = f"{r['median_ms'] / of:.2f}"
            ok = "" if "correct" not in r else ("yes" if r["correct"] else "NO !!!")
            ok += "*" if "reference" in r else ""
            lines.append(f"  {r['name']:<{width}} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f} "
                         f"{r['max_ms']:>8.1f} {speed:>9} {bound:>8} {ok:>8}".rstrip())
        lines += [f"  *: {r['name']}'s result checked against {r['reference']}: max rel err "
                  f"{r['max_rel_err_vs_reference']:.1e} (vs ddp's float32 step: "
                  f"{r['max_rel_err_vs_ddp']:.1e})"
                  + (f" ({r['reduced_grad_ring_sum_share']:.0%} of its elements such a sum)"
                     if "reduced_grad_ring_sum_share" in r else "") + master_note(r)
                  for r in run["rows"] if "reference" in r]
        lines.append("")
    lines.append("targets (ratios of medians from this run):")
    for t in doc["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        why = f" ({t['why']})" if "why" in t else ""
        lines.append(f"  {'met ' if t['met'] else 'MISSED'} {t['name']}: {value} vs "
                     f"{t['threshold']}{why}")
    return "\n".join(lines)


def measure_local_sgd(rate: str, cfg: dict) -> dict:
    """``local_sgd.worker`` on 2 hosts x 2 ranks over a ``rate`` link."""
    with Hosts(2, rate=rate) as hosts:
        doc = hosts.run("local_sgd:worker", cfg, nproc=2, timeout=cfg["timeout"],
                        env={"COCONET_HOSTS_TIMEOUT": "600"}, path=(str(HERE),))[0]
    if isinstance(doc, BaseException):
        raise SystemExit(f"multi_host --local-sgd: {rate}: {type(doc).__name__}: {doc}")
    return {"rate": rate, "period": cfg["period"], **doc,
            "link_ms": round(4 * cfg["params"] / rate_bytes_per_s(rate) * 1e3, 3)}


def main_local_sgd(args) -> int:
    import local_sgd

    rate = args.rates.split(",")[0]
    rate_bytes_per_s(rate)
    cfg = {"params": parse_size(args.params), "period": args.local_sgd, "seed": 0,
           "batch": args.batch,
           "periods": args.steps, "warmup": max(args.warmup, 1), "timeout": 1800}
    started = time.time()
    print(f"local sgd: link {rate}, 2 hosts x 2 ranks ...", file=sys.stderr, flush=True)
    run = measure_local_sgd(rate, cfg)
    doc = {"benchmark": "multi_host --local-sgd", "config": cfg, "run": run,
           "targets": local_sgd.targets(run),
           "machine": {"cpu_model": cpu_model(), "cpus": len(os.sched_getaffinity(0)),
                       "python": platform.python_version()},
           "wall_s": round(time.time() - started, 1)}
    print(local_sgd.table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        Path(args.json).with_suffix(".txt").write_text(local_sgd.table(doc) + "\n")
        print(f"JSON written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="16M")
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--nproc", default="1,2",
                    help="ranks per host, comma-separated; 2+1: 2 on one host, 1 on the other")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-bf16", action="store_true",
                    help="leave out the bfloat16 rows (ddp[bf16_compress_hook], coconet's "
                    "reduce_dtype=torch.bfloat16 and bfloat16 parameters), run by default at 2 "
                    "ranks per host")
    ap.add_argument("--local-sgd", type=int, default=0, metavar="K",
                    help="run benchmarks/local_sgd.py instead: Local SGD with period K on 2 x 2 "
                    "ranks (--steps: timed periods of K steps)")
    ap.add_argument("--batch", type=int, default=32,
                    help="with --local-sgd: rows of each local step's forward and backward "
                    "(0: the optimizer's update alone)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    why = Hosts.unavailable()
    if why:
        print(f"multi_host: {why}", file=sys.stderr)
        return 2
    if args.local_sgd:
        return main_local_sgd(args)
    cfg = {"optimizer": "adam", "params": parse_size(args.params), "steps": args.steps,
           "warmup": args.warmup, "seed": 0, "model": None, "clip": None, "timeout": 1800}
    started = time.time()
    runs = []
    for rate in args.rates.split(","):
        rate_bytes_per_s(rate)  # checked before anything starts
    layouts = [parse_nproc(n) for n in args.nproc.split(",")]
    for rate in args.rates.split(","):
        for nproc, token in zip(layouts, args.nproc.split(","), strict=True):
            print(f"link {rate}, 2 hosts x {token} ...", file=sys.stderr, flush=True)
            bf16 = nproc == 2 and not args.no_bf16
            runs.append(measure(rate, nproc, {**cfg, "bf16": bf16}))
    doc = {"benchmark": "multi_host", "config": cfg, "runs": runs, "targets": targets(runs),
           "machine": {"cpu_model": cpu_model(), "cpus": len(os.sched_getaffinity(0)),
                       "python": platform.python_version()},
           "wall_s": round(time.time() - started, 1)}
    print(table(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        Path(args.json).with_suffix(".txt").write_text(table(doc) + "\n")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
