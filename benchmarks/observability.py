"""What seeing a step costs (issue 48): tracing on against off, the flight recorder on against
off, the spans' cost when nothing records, and whether a failed job's errors name the rank and
the call.

Two local ranks (one torch thread each: they fill this 2-core machine; other jobs share it, so
quote ratios from one run):

1. **tracing**: a 16M-parameter ``coconet.optim.Adam`` step (8 tensors of 2M, fused kernels)
   with no recorder, and with ``coconet.tracing`` recording every span (each block's file
   written after its timing);
2. **flight recorder**: a compiled step that is one all_reduce of 8 KiB (every default
   guarantee: the agreement, the commit vote) on a communicator with the flight recorder on
   (the default) and on one with ``CommOptions(flight_recorder=0)``;

   each of the two timed in ``--rounds`` rounds, a round four blocks in the order off, on, on,
   off (on, off, off, on in odd rounds: a drift within the round falls on both alike, and
   neither always holds the outer places), each block a barrier then
   ``--adam-steps`` or ``--iters`` calls; per round the slowest rank's time per call of each,
   and their ratio; the targets read the median of the rounds' ratios;
3. **spans with nothing recording**: how many spans one such 8 KiB step opens (counted by a
   recorder) times what the dearest form of an instrumentation point costs when nothing records
   (timed in this process, less the bare call it wraps), over the step's time: the bound on what
   the instrumentation costs a user who never traces;
4. **named**: the fault trials of ``tests/support/fault_trial_workers.py`` (a rank killed, or
   stalled past the 4 s timeout, at each point of a tensor-parallel layer's forward and backward,
   a pipeline step's forward, backward and boundary, and an optimizer step on ``dp=2,tp=2``),
   counting the trials whose every surviving rank's error names the victim and the call it had
   not reached (``--no-trials`` skips them: ~5 minutes).

    python benchmarks/observability.py --json benchmarks/results/observability.json \\
        --png benchmarks/results/observability_trace.png | tee benchmarks/results/observability.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch
import torch.distributed as dist

import coconet as cc
from coconet import tracing
from coconet.runtime import CommOptions, Communicator, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from small_steps import program  # noqa: E402

ADAM_NUMEL = 16 << 20
SMALL_BYTES = 8 * 1024


def _slowest(comm, seconds: float) -> float:
    return comm.max_over_world([seconds], "observability: slowest rank")[0]


# each round times its two variants in the order A B B A, or B A A B in odd rounds (a drift
# within the round falls on both alike, and neither always holds the outer places); a round's
# ratio is B's blocks over A's, and a target reads the median of the ratios
ORDERS = ((0, 1, 1, 0), (1, 0, 0, 1))


def _rounds(comm, cfg: dict, variants: dict, calls: int) -> dict[str, list[float]]:
    """Per round and variant, the slowest rank's seconds per call (two blocks of ``calls``
    each, in the ``ORDERS`` above); ``variants``: name -> (before, call, after), where ``before``
    and ``after`` run around each block, untimed."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(cfg["rounds"]):
        spent = dict.fromkeys(names, 0.0)
        for i in ORDERS[r % 2]:
            before, call, after = variants[names[i]]
            before(r)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            spent[names[i]] += time.perf_counter() - t0
            after(r)
        for name in names:
            times[name].append(_slowest(comm, spent[name] / (2 * calls)))
    return times


def _adam(comm, cfg: dict, out_dir: str) -> dict:
    from coconet.optim import Adam

    init = torch.Generator().manual_seed(0)  # the same parameters on every rank
    params = [torch.nn.Parameter(torch.randn(ADAM_NUMEL // 8, generator=init)) for _ in range(8)]
    gen = torch.Generator().manual_seed(comm.rank)  # each rank's own gradients
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = Adam(params, lr=1e-4, comm=comm)
    for _ in range(3):
        opt.step()  # the first step's agreement and kernels, then warm
    events = [0]

    def nothing(r: int) -> None:
        pass

    def record(r: int) -> None:
        tracing.start(os.path.join(out_dir, f"adam{r}"))

    def write(r: int) -> None:
        events[0] = len(tracing.recording().events)
        tracing.stop()  # (the round's second "on" block overwrites its first's file)

    times = _rounds(comm, cfg, {"off": (nothing, opt.step, nothing),
                                "on": (record, opt.step, write)}, cfg["adam_steps"])
    return {**times, "spans per step": events[0] // cfg["adam_steps"]}


def _small(comm, cfg: dict) -> dict:
    # two fresh communicators alike but for the recorder (the job's own one carries the 16M
    # Adam's segments and plans)
    off = Communicator(comm.mesh, dataclasses.replace(comm.options, flight_recorder=0))
    on = Communicator(comm.mesh, dataclasses.replace(comm.options, flight_recorder=1024))
    steps = {"off": cc.compile(program(), comm=off), "on": cc.compile(program(), comm=on)}
    g = torch.zeros(SMALL_BYTES // 4)
    for step in steps.values():
        for _ in range(20):
            step(g=g)

    def nothing(r: int) -> None:
        pass

    times = _rounds(comm, cfg, {name: (nothing, lambda s=s: s(g=g), nothing)
                                for name, s in steps.items()}, cfg["iters"])  # fmt: skip
    # spans one step opens: counted by a recorder
    recorder = tracing.start(tempfile.mkdtemp(prefix="coconet-spans-"))
    steps["on"](g=g)
    spans = len(recorder.events)
    tracing.stop()
    before = on.guard.recorder.seq
    steps["on"](g=g)
    calls = on.guard.recorder.seq - before  # guarded calls a step makes
    off.close()
    on.close()
    return {**times, "spans per step": spans, "calls per step": calls}


def worker(comm, cfg: dict) -> dict:
    torch.set_num_threads(1)
    adam = _adam(comm, cfg, cfg["out_dir"])
    small = _small(comm, cfg)

    return {"adam": adam, "small": small, "null_span_s": _point_cost(),
            "recorder_call_s": _recorder_cost(), "calls_per_step": small["calls per step"]}


def _recorder_cost() -> float:
    """What the flight recorder adds to one guarded call, in seconds (one process: a fault
    guard running a no-op with a recorder, less the same without)."""
    from coconet.runtime.faults import FaultGuard
    from coconet.runtime.flight import FlightRecorder

    def cost(recorder) -> float:
        guard = FaultGuard(0, 2, "gloo", 60.0, lambda axis: (0, 1))
        guard.recorder = recorder
        return min(timeit.repeat(lambda: guard("all_reduce", "x", None, int), number=200_000,
                                 repeat=7)) / 200_000  # fmt: skip

    return cost(FlightRecorder("probe", 0, (0, 1), 1024)) - cost(None)


def _point_cost() -> float:
    """What one instrumentation point costs with nothing recording, in seconds: the dearest of
    the hot paths' forms (``FaultGuard``'s and a kernel's: read ``active()`` and call one level
    deeper; a step's phases: ``within(False, ...)``), each less the bare call it wraps."""

    def work():
        return None

    def guarded():  # FaultGuard.__call__ / _Kernel.__call__ when nothing records
        if tracing.active():
            raise AssertionError("nothing may record here")
        return work()

    def phase():
        return tracing.within(False, "x", tracing.Category.BODY, work)

    def cost(fn) -> float:
        return min(timeit.repeat(fn, number=200_000, repeat=7)) / 200_000

    bare = cost(work)
    return max(cost(guarded), cost(phase)) - bare


def _trials() -> dict:
    from support import fault_trial_workers as w

    verdicts = []
    for world, places in (("2", w.PLACES[:5]), ("dp=2,tp=2", w.PLACES[5:])):
        stalls = tuple((p, "stall", n) for p in places for n in w.CTRL_C_POINTS[p])
        plans = [stalls] + [((p, "kill", w.POINTS[p]),) for p in places]
        for plan in plans:
            results = w.run(world, list(plan))
            verdicts += [w.judge(t) for t in w.split_trials(results, list(plan))]
    return {
        "trials": len(verdicts),
        "named": sum(v["named"] for v in verdicts),
        "clear": sum(v["clear"] for v in verdicts),
        "table": w.table(verdicts),
        "unnamed": [(v["fault"], v["place"], v["point"], v["problems"]) for v in verdicts
                    if not v["named"]],  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--adam-steps", type=int, default=3, help="Adam steps per block")
    parser.add_argument("--iters", type=int, default=150, help="8 KiB steps per block")
    parser.add_argument("--trials", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--png", help="draw the last traced Adam round's timeline here")
    args = parser.parse_args()
    out_dir = tempfile.mkdtemp(prefix="coconet-observability-")  # the traced rounds' files
    cfg = {"rounds": args.rounds, "adam_steps": args.adam_steps, "iters": args.iters,
           "out_dir": out_dir}
    load0 = os.getloadavg()[0]
    result = spawn(worker, 2, cfg, options=CommOptions(timeout=120), timeout=1800)[0]
    load1 = os.getloadavg()[0]
    med = {k: {v: statistics.median(result[k][v]) for v in ("on", "off")}
           for k in ("adam", "small")}  # fmt: skip
    ratio = {k: statistics.median(on / off for on, off in zip(result[k]["on"], result[k]["off"],
                                                              strict=True))
             for k in ("adam", "small")}  # fmt: skip
    adam_ratio, small_ratio = ratio["adam"], ratio["small"]
    spans = result["small"]["spans per step"]
    null_share = spans * result["null_span_s"] / med["small"]["off"]
    print(f"observability: 2 ranks on {os.cpu_count()} cores ({platform.machine()}, torch "
          f"{torch.__version__}); load {load0:.2f} at the start, {load1:.2f} at the end; "
          f"slowest rank per round, median of {args.rounds} rounds")
    print(f"16M Adam step: tracing off {med['adam']['off'] * 1e3:.2f} ms, on "
          f"{med['adam']['on'] * 1e3:.2f} ms ({result['adam']['spans per step']} spans a step); "
          f"median of the rounds' ratios {adam_ratio:.3f}")
    print(f"8 KiB compiled all_reduce step: flight recorder off {med['small']['off'] * 1e6:.1f} "
          f"us, on {med['small']['on'] * 1e6:.1f} us; median of the rounds' ratios "
          f"{small_ratio:.3f}")
    own = result["calls_per_step"] * result["recorder_call_s"]
    print(f"the flight recorder's own cost: {result['calls_per_step']} calls a step x "
          f"{result['recorder_call_s'] * 1e9:.0f} ns = {own * 1e6:.2f} us, "
          f"{own / med['small']['off']:.1%} of the step")
    print(f"nothing recording: {spans} points a step x {result['null_span_s'] * 1e9:.0f} ns = "
          f"{spans * result['null_span_s'] * 1e6:.2f} us, {null_share:.1%} of the step")
    targets = [
        ["tracing on: 16M Adam step time over tracing off", adam_ratio, 1.02,
         adam_ratio <= 1.02],
        ["flight recorder always on: 8 KiB compiled step time over off", small_ratio, 1.05,
         small_ratio <= 1.05],
        ["tracing off: the spans' cost over the 8 KiB compiled step", null_share, 0.02,
         null_share <= 0.02],
    ]  # fmt: skip
    if args.png:
        from coconet import trace

        merged = trace.merge(os.path.join(out_dir, f"adam{args.rounds - 1}"))
        trace.plot(merged, args.png, title=f"coconet.optim.Adam, 16M parameters, 2 ranks: "
                   f"{args.adam_steps} steps of the last traced round")  # fmt: skip
        print(f"the last traced round's timeline: {args.png}")
    trials = None
    if args.trials:
        trials = _trials()
        print("\nfault trials (a rank killed or stalled past the 4 s timeout; 'named': every "
              "survivor's error names the victim and the call):")
        print(trials["table"])
        share = trials["named"] / trials["trials"]
        targets.append(["stalled rank: the error names the rank and the call", share, 1.0,
                        share >= 1.0])  # fmt: skip
        for u in trials["unnamed"]:
            print(f"not named: {u}")
    print("\ntargets (medians of the rounds' ratios, from this run):")
    for name, value, limit, met in targets:
        print(f"  {name:62} {value:6.3f} {'<=' if limit != 1.0 else '>='} {limit}  "
              f"{'met' if met else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {"cores": os.cpu_count(), "arch": platform.machine(),
                        "torch": torch.__version__, "load": [load0, load1]},
            "medians_s": med,
            "times_s": {k: {v: result[k][v] for v in ("on", "off")} for k in ("adam", "small")},
            "spans_per_step": {"adam": result["adam"]["spans per step"], "small": spans},
            "null_span_s": result["null_span_s"],
            "recorder_call_s": result["recorder_call_s"],
            "calls_per_step": result["calls_per_step"],
            "trials": None if trials is None else {k: trials[k] for k in
                                                   ("trials", "named", "clear", "unnamed")},
            "targets": [{"name": n, "measured": v, "threshold": t, "met": m}
                        for n, v, t, m in targets],
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
