"""Rank bodies for test_dist_tune.py: coconet.tune on real ranks (2 processes, small sizes).

Every function runs on each rank (``coconet.runtime.spawn``) and returns something picklable:
the winner as text, the rows' measured times, ... so that the test can compare the ranks.
"""

from __future__ import annotations

import time

import torch

import coconet
from coconet.options import CompileOptions, TransportKind
from coconet.runtime import Communicator
from coconet.tune import tune
from coconet.tune.candidates import enumerate_candidates
from coconet.tune.measure import Communicators, measure
from support.examples_loader import load_example

EAGER = CompileOptions(fused_kernels=False)  # the same programs, without torch.compile's cost
STATE = ("m", "v")


def _adam():
    return load_example("adam").program()


def _rows(result) -> list[dict]:
    return [
        {
            "candidate": str(r.candidate),
            "label": r.candidate.label,
            "unscheduled": r.candidate.schedule is None,
            "transport": r.candidate.transport.value,
            "predicted_ms": r.predicted_ms,
            "measured_ms": r.measured_ms,
            "measured": r.measured is not None,
            "steps_ms": list(r.measured.steps_ms) if r.measured is not None else None,
        }
        for r in result.rows
    ]


def _summary(comm: Communicator, result, seconds: float) -> dict:
    return {
        "winner": str(result.winner),
        "winner_label": result.winner.label,
        "winner_ms": result.winner_row.measured_ms,
        "own_transport": comm.transport_of(None).value,
        "rows": _rows(result),
        "explain": result.explain(),
        "json_winner": result.to_json()["winner"],
        "cached": result.cached,
        "seconds": seconds,
        "rematch": None
        if result.rematch is None
        else {
            "first": result.rematch.first.label,
            "second": result.rematch.second.label,
            "first_ms": result.rematch.first_ms,
            "second_ms": result.rematch.second_ms,
            "winner": result.rematch.winner.label,
        },
    }


def tune_adam(comm: Communicator, n: int, top: int) -> dict:
    t0 = time.perf_counter()
    result = tune(_adam(), comm, {"N": n}, options=EAGER, state=STATE, top=top, reps=3)
    return _summary(comm, result, time.perf_counter() - t0)


def tune_rematch(comm: Communicator, n: int) -> dict:
    """A tune whose two best always meet in a rematch (``rematch_within`` huge), then the same
    read from the cache, then one that never rematches."""
    kwargs = {"options": EAGER, "state": STATE, "top": 3, "reps": 3}
    t0 = time.perf_counter()
    first = tune(_adam(), comm, {"N": n}, rematch_within=100.0, **kwargs)
    out = {"first": _summary(comm, first, time.perf_counter() - t0)}
    again = tune(_adam(), comm, {"N": n}, rematch_within=100.0, **kwargs)
    out["cached"] = _summary(comm, again, 0.0)
    never = tune(_adam(), comm, {"N": n}, rematch_within=0.0, **kwargs)
    out["never"] = _summary(comm, never, 0.0)
    return out


def tune_twice(comm: Communicator, n: int, top: int) -> dict:
    """A first tune (measured), the same again (cached), then three that must not hit the
    cache: another size, another state, retune=True. Each summary says how many times the
    tuner called ``measure`` (none for a result read from the cache)."""
    import coconet.tune.tuner as tuner

    real, calls = tuner.measure, []

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    tuner.measure = counting
    try:
        return _tune_twice(comm, n, top, calls)
    finally:
        tuner.measure = real


def _tune_twice(comm: Communicator, n: int, top: int, calls: list) -> dict:
    out = {"first": tune_adam(comm, n, top)}
    out["first"]["measure_calls"] = len(calls)
    out["second"] = tune_adam(comm, n, top)
    out["second"]["measure_calls"] = len(calls) - out["first"]["measure_calls"]
    prog = _adam()
    t0 = time.perf_counter()
    other_size = tune(prog, comm, {"N": 2 * n}, options=EAGER, state=STATE, top=1, reps=3)
    out["other_size"] = _summary(comm, other_size, time.perf_counter() - t0)
    t0 = time.perf_counter()
    other_state = tune(prog, comm, {"N": n}, options=EAGER, state=("m",), top=1, reps=3)
    out["other_state"] = _summary(comm, other_state, time.perf_counter() - t0)
    t0 = time.perf_counter()
    again = tune(prog, comm, {"N": n}, options=EAGER, state=STATE, top=top, reps=3, retune=True)
    out["retune"] = _summary(comm, again, time.perf_counter() - t0)
    out["measure_calls"] = len(calls)
    return out


def tune_torch_only(comm: Communicator, n: int) -> dict:
    result = tune(
        _adam(),
        comm,
        {"N": n},
        options=EAGER,
        state=STATE,
        top=1,
        reps=3,
        transports=[TransportKind.TORCH_DISTRIBUTED],
    )
    return _summary(comm, result, 0.0)


def _adam_step_works(comm: Communicator, n: int) -> bool:
    """A plain compiled Adam step on ``comm`` runs and gives finite values."""
    step = coconet.compile(_adam(), comm=comm, options=EAGER)
    g = torch.full((n,), float(comm.rank + 1))
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    scalars = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    step(g=g, p=p, m=m, v=v, weight_decay=0.0, step=1.0, **scalars)
    return bool(torch.isfinite(p).all()) and bool((p != 1.0).any())


def measure_with_a_broken_candidate(comm: Communicator, n: int) -> dict:
    """measure() three candidates; the first compiles on rank 0 but raises on rank 1 (a
    patched coconet.compile); the others must still be measured on both ranks."""
    import coconet.compiler as compiler

    prog = _adam()
    cands, _ = enumerate_candidates(prog, [comm.transport_of(None)], state=STATE)
    by_name = {c.name: c for c in cands}
    picked = [by_name["AR_C"], by_name["unscheduled"], by_name["fuse_RS_C_AG"]]
    broken = picked[0].target
    real = compiler.compile

    def patched(target, **kwargs):
        if comm.rank == 1 and target is broken:
            raise RuntimeError("deliberately broken on rank 1")
        return real(target, **kwargs)

    compiler.compile = patched
    try:
        got = measure(picked, Communicators(comm), {"N": n}, options=EAGER, reps=3)
    finally:
        compiler.compile = real
    return {
        "names": [m.candidate.name for m in got],
        "ms": [m.ms for m in got],
        "errors": [m.error for m in got],
        "comm_still_works": _adam_step_works(comm, n),
    }


def tune_layer(comm: Communicator, sizes: dict, scalars: dict | None) -> dict:
    """The tensor-parallel layer (int64 scalars seed and step), the 2 best predicted."""
    prog = load_example("tensor_parallel").program()
    result = tune(prog, comm, sizes, options=EAGER, scalars=scalars, top=2, reps=3)
    return {
        "rows": _rows(result),
        "errors": [r.measured.error for r in result.rows if r.measured is not None],
        "winner": str(result.winner) if any(r.measured_ms for r in result.rows) else None,
    }


def tune_only(comm: Communicator, n: int, label: str) -> dict:
    """``only=[label]``: exactly that candidate measured, and nothing cached (a later full tune
    measures)."""
    kwargs = {"options": EAGER, "state": STATE, "reps": 3}
    part = tune(_adam(), comm, {"N": n}, only=[label], **kwargs)
    full = tune(_adam(), comm, {"N": n}, top=1, **kwargs)
    return {
        "measured": [r.candidate.label for r in part.rows if r.measured is not None],
        "full_cached": full.cached,
    }
