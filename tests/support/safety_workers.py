"""Rank functions for test_dist_safety.py: misuse of a compiled step that used to corrupt state
silently or fail on one rank only (issue 13). Each check runs on every rank at the same point
and records, per rank, what the step raised and whether the caller's tensors kept their values;
the parent asserts that every rank failed alike and nothing changed.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

import coconet as cc
from coconet.errors import RuntimeFault
from coconet.runtime import Communicator

N = 64


def _kind(e: BaseException) -> str:
    """An exception's kind as the tests compare it: every RuntimeFault (a CallRefused too:
    the typed refusal the agreement raises) as "RuntimeFault"."""
    return "RuntimeFault" if isinstance(e, RuntimeFault) else type(e).__name__


def program(name: str = "safety") -> cc.Program:
    """Momentum SGD with an int64 scalar: g Local; p, m Replicated; lr float, k int."""
    n = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [n], cc.Local)
    p = cc.Tensor("p", cc.float32, [n], cc.Replicated)
    m = cc.Tensor("m", cc.float32, [n], cc.Replicated)
    lr, k = cc.Scalar("lr"), cc.Scalar("k", cc.int64)
    g_sum = cc.all_reduce(g, name="g_sum")
    m_new = (0.5 * m + g_sum).named("m_new")
    p_new = (p - lr * cc.cast(k, cc.float32) * m_new).named("p_new")
    return cc.Program(name, [g, p, m, lr, k], [cc.update(p, p_new), cc.update(m, m_new)])


def inputs(rank: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    p, m = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    g = torch.randn(N, generator=torch.Generator().manual_seed(seed + 100 + rank))
    return {"g": g, "p": p, "m": m, "lr": 0.1, "k": 2}


def expected(world: int, seed: int = 0) -> dict:
    """p and m after one step (the simulator's)."""
    grads = [inputs(r, seed)["g"] for r in range(world)]
    result = cc.simulate(program(), {**inputs(0, seed), "g": grads}, world)
    return {k: result.updated(k) for k in ("p", "m")}


def assert_same_fault(results: list[dict], label: str, *fragments: str, within: float) -> None:
    """Every rank's ``results[rank][label]`` (an ``_attempt``) is the same ``RuntimeFault``, with
    each of ``fragments`` in its message, raised within ``within`` seconds, with the caller's
    tensors unchanged (the parent's check of a refusal on every rank)."""
    for rank, out in enumerate(results):
        got = out[label]
        assert got["status"] == "RuntimeFault", f"rank {rank}, {label}: {got}"
        for fragment in fragments:
            assert fragment in got["message"], f"rank {rank}, {label}: {got['message']}"
        assert got["unchanged"], f"rank {rank}, {label}: a refused step changed a tensor"
        assert got["seconds"] < within, f"rank {rank}, {label}: waited {got['seconds']} s"
    assert all(out[label]["message"] == results[0][label]["message"] for out in results), label


def _attempt(step, mine: dict) -> dict:
    """Run one step: what it raised (type, message), how long it took, whether every tensor of
    ``mine`` kept its values."""
    before = {k: v.clone() for k, v in mine.items() if isinstance(v, torch.Tensor)}
    t0 = time.perf_counter()
    try:
        step(**mine)
        status, message = "no error", ""
    except Exception as e:  # noqa: BLE001 - reported to the test
        status, message = _kind(e), str(e)
    unchanged = all(torch.equal(before[k], mine[k]) for k in before)
    return dict(status=status, message=message, seconds=time.perf_counter() - t0,
                unchanged=unchanged)


def misuse(comm: Communicator) -> dict:
    """Every misuse below fails on every rank before any data moves, naming the real reason,
    and leaves the communicator usable (the good step at the end commits)."""
    rank = comm.rank
    step = cc.compile(program(), comm=comm, fused_kernels=False)
    out = {}

    def bad(label: str, on_rank: int, **changes):
        mine = inputs(rank)
        if rank == on_rank:
            mine.update(changes)
        out[label] = _attempt(step, mine)

    # item 1: state the commit cannot write in place
    bad("expand", 1, m=torch.zeros(1).expand(N))
    with torch.inference_mode():
        frozen = torch.zeros(N)
    bad("inference", 0, p=frozen)
    # item 2: updated inputs that share memory
    shared = torch.randn(N)
    bad("same p and m", 1, p=shared, m=shared)
    buffer = torch.randn(N + 8)
    bad("overlapping views", 0, p=buffer[:N], m=buffer[8:])
    interleaved = torch.randn(2 * N)
    bad("interleaved views", 0, p=interleaved[0::2], m=interleaved[1::2])  # disjoint: fine
    # item 5: scalars that do not fit their dtype
    bad("int nan", 1, k=float("nan"))
    bad("int too big", 0, k=2**63)
    bad("int fraction", 1, k=1.5)
    bad("float too big", 1, lr=10**400)
    bad("float32 overflow", 0, lr=1e39)
    mine = inputs(rank)
    mine["lr"] = float("nan")  # NaN and inf pass through, as in torch.optim
    out["float nan passes"] = _attempt(step, mine)
    # item 3: a rank one step ahead (its step counter differs)
    bad("step ahead", 1, k=3)
    good = inputs(rank)
    out["good"] = _attempt(step, good)
    if rank == 0:
        # the same tensor objects as the good call, re-pointed to share memory: a step
        # remembers what it checked only by everything the checks read, so it checks again
        good["m"].set_(good["p"])
    out["re-pointed"] = _attempt(step, good)
    out["calls"] = step.calls
    return out


def sequence(comm: Communicator) -> dict:
    """Steps called in different orders on different ranks (item 3), with the shape check
    on and off: caught at once on every rank, instead of exchanging each other's data."""
    rank = comm.rank
    out = {}
    for check in (True, False):
        # two compiled steps of one program and shapes (two parameter groups)
        a = cc.compile(program(), comm=comm, fused_kernels=False, check_every_step=check)
        b = cc.compile(program(), comm=comm, fused_kernels=False, check_every_step=check)
        a(**inputs(rank))  # a is this program's first compiled step on both ranks
        b(**inputs(rank))
        first, second = (a, b) if rank == 0 else (b, a)
        out[f"swapped steps {check}"] = _attempt(first, inputs(rank))
        # two programs called in different orders
        x = cc.compile(program("x"), comm=comm, fused_kernels=False, check_every_step=check)
        y = cc.compile(program("y"), comm=comm, fused_kernels=False, check_every_step=check)
        out[f"swapped programs {check}"] = _attempt(x if rank == 0 else y, inputs(rank))
        del second
    # shapes that change under check_every_step=False fail every rank (not just one)
    fixed = cc.compile(program(), comm=comm, fused_kernels=False, check_every_step=False)
    fixed(**inputs(rank))
    mine = inputs(rank)
    if rank == 1:
        mine = {k: (v[:32].clone() if isinstance(v, torch.Tensor) else v) for k, v in mine.items()}
    out["shape change"] = _attempt(fixed, mine)
    return out


def option_mismatch(comm: Communicator, option: str, values: tuple) -> dict:
    """Rank r compiles with ``option=values[r]`` (item 4): every rank fails at the first step,
    naming the option and both values."""
    options = {"fused_kernels": False, option: values[comm.rank]}
    step = cc.compile(program(), comm=comm, **options)
    return _attempt(step, inputs(comm.rank))


def replicated_drift(comm: Communicator) -> dict:
    """Parameters that differ across ranks: not detected by default (documented), detected with
    check_replicated=True."""
    out = {}
    for check in (False, True):
        step = cc.compile(program(), comm=comm, fused_kernels=False, check_replicated=check)
        mine = inputs(comm.rank)
        if comm.rank == 1:
            mine["p"][5] += 1.0
        out[str(check)] = _attempt(step, mine)
    return out


def commit_interrupted(comm: Communicator, victim: int, kind: str) -> dict:
    """The commit of the second update fails on ``victim`` after every rank voted to commit:
    once with a RuntimeError (``kind="error"``) or with a KeyboardInterrupt (Ctrl-C, ``kind=
    "interrupt"``). Every rank must end wholly after the step (as the others, which committed),
    and the communicator stays usable."""
    step = cc.compile(program(), comm=comm, fused_kernels=False)
    mine = inputs(comm.rank)
    writes = []
    if comm.rank == victim:
        real = step._write

        def flaky(target, value, swap):
            writes.append(len(writes))
            if len(writes) == 2:  # the second update's first write
                raise KeyboardInterrupt() if kind == "interrupt" else RuntimeError("injected")
            real(target, value, swap)

        step._write = flaky
    status, notes = "no error", []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step(**mine)
        except KeyboardInterrupt as e:
            status, notes = "KeyboardInterrupt", list(getattr(e, "__notes__", []))
    want = expected(comm.world)
    after = all(torch.equal(mine[k], want[k]) for k in ("p", "m"))
    # the job goes on: the communicator is healthy on every rank
    again = _attempt(cc.compile(program(), comm=comm, fused_kernels=False), inputs(comm.rank))
    return dict(
        status=status,
        notes=notes,
        warnings=[str(w.message) for w in caught],
        wholly_after=after,
        broken=comm.broken,
        again=again["status"],
    )


def healthy(comm: Communicator) -> dict:
    """Every check above that leaves the communicator usable, in one job (spawning costs
    seconds): misuse, steps in other orders, options that differ, drifting parameters, and
    commits interrupted after the vote."""
    out = {"misuse": misuse(comm), "sequence": sequence(comm), "drift": replicated_drift(comm)}
    for option, values in OPTION_PAIRS:
        out[f"option {option}"] = option_mismatch(comm, option, values)
    for kind in ("error", "interrupt"):
        out[f"commit {kind}"] = commit_interrupted(comm, 1, kind)
    return out


# Options that differ between rank 0 and rank 1 (on gloo, check_every_step differing used to
# abort the process with SIGABRT; commit_vote differing made both ranks wait out the timeout;
# fused_kernels differing let "Replicated" parameters drift apart).
OPTION_PAIRS = (
    ("check_every_step", (True, False)),
    ("commit_vote", (True, False)),
    ("fused_kernels", (True, False)),
    ("commit", ("copy", "swap")),
    ("check_replicated", (False, True)),
)


def interrupted_mid_step(comm: Communicator, victim: int) -> dict:
    """Ctrl-C on ``victim`` mid-step (item 8): it marks its communicator broken and leaves; the
    peers learn at once (not at the timeout) and keep their tensors."""
    step = cc.compile(program(), comm=comm, fused_kernels=False)
    mine = inputs(comm.rank)
    before = {k: v.clone() for k, v in mine.items() if isinstance(v, torch.Tensor)}
    step(**mine)  # warm
    for k, v in before.items():
        mine[k].copy_(v)
    if comm.rank == victim:
        real = comm.wait

        def interrupted(work):
            raise KeyboardInterrupt()

        comm.wait = interrupted
        del real
    t0 = time.perf_counter()
    try:
        step(**mine)
        status, message = "no error", ""
    except KeyboardInterrupt:
        status, message = "KeyboardInterrupt", ""
    except RuntimeFault as e:
        status, message = "RuntimeFault", str(e)
    seconds = time.perf_counter() - t0
    unchanged = all(torch.equal(before[k], mine[k]) for k in before)
    if comm.rank == victim:
        time.sleep(3.0)  # alive after the interrupt (a handler writing a checkpoint): the peers
        # must have learned from the abort, not from this process's exit
    return dict(status=status, message=message, seconds=seconds, unchanged=unchanged,
                broken=comm.broken)


def slow_compile(comm: Communicator, victim: int, delay: float, dies: bool = False) -> dict:
    """``victim`` takes ``delay`` seconds to compile its fused kernel (a cold Inductor cache),
    far longer than the communicator's timeout (item 7): the first step still succeeds,
    because kernels compile outside the collectives and the ranks agree on readiness. With
    ``dies``, the victim is killed while compiling: the peers learn it at once."""
    import os
    import signal

    from support.dist_workers import _adam_case

    schedule, mine = _adam_case(comm, size=64)
    step = cc.compile(schedule, comm=comm, fused_kernels=True)
    for kernel in step.kernels._kernels.values():
        # Stand-ins for the built kernels (a build takes 10+ s here): the eager kernel, slow to
        # "compile" on the victim.
        def compiled(*args, eager=kernel.eager, first=[True]):  # noqa: B006 - per kernel
            if first[0] and comm.rank == victim:
                if dies:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(delay)
            first[0] = False
            return eager(*args)

        kernel.fn = compiled
    # Line the ranks up outside coconet (torch's own barrier, its long default timeout): what
    # is measured is the victim's slow compile, not how far apart two loaded ranks reach their
    # first step (that lag alone can exceed the 1.5 s timeout on 2 busy cores).
    dist.barrier()
    result = _attempt(step, mine)
    result["compile_seconds"] = dict(step.kernels.first_call_seconds)
    return result
