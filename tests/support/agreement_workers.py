"""Rank functions for test_dist_agreement.py: the per-step agreement when it costs no round of
its own (``coconet.runtime.handshake``). A step whose first communication is a small all_reduce
over the world carries its agreement in that all_reduce's round; a step that communicates
nothing is agreed at the communicator's next round. Each check records, per rank, what happened;
the parent asserts that every rank saw the same thing and that nothing was lost.
"""

from __future__ import annotations

import time

import torch

import coconet as cc
from coconet.errors import RuntimeFault
from coconet.runtime import Communicator
from support.safety_workers import _attempt

N = 64


def _kind(e: BaseException) -> str:
    """An exception's kind as the tests compare it: every RuntimeFault (a CallRefused too:
    the typed refusal the agreement raises) as "RuntimeFault"."""
    return "RuntimeFault" if isinstance(e, RuntimeFault) else type(e).__name__


def reduced() -> cc.Program:
    """A row-parallel layer's shape of step: local work, then a small all_reduce (the step's
    first communication), then work on its result with a Replicated bias and scalar."""
    n = cc.Dim("N")
    x = cc.Tensor("x", cc.float32, [n], cc.Local)
    b = cc.Tensor("b", cc.float32, [n], cc.Replicated)
    c = cc.Scalar("c")
    s = cc.all_reduce((x * 3.0 - 1.0).named("partial"), name="s")
    return cc.Program("reduced", [x, b, c], {"y": ((s + b) * c).named("y")})


def local(name: str = "local") -> cc.Program:
    """A step that communicates nothing and updates nothing (a column-parallel forward)."""
    n = cc.Dim("N")
    x = cc.Tensor("x", cc.float32, [n], cc.Replicated)
    c = cc.Scalar("c")
    return cc.Program(name, [x, c], {"y": (x * c + 1.0).named("y")})


def reduced_inputs(rank: int, seed: int, n: int = N) -> dict:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return {"x": torch.randn(n, generator=gen), "b": b, "c": 0.5}


def _want(world: int, seed: int, n: int = N) -> torch.Tensor:
    ins = [reduced_inputs(r, seed, n) for r in range(world)]
    sim = cc.simulate(reduced(), {"x": [i["x"] for i in ins], "b": ins[0]["b"], "c": 0.5}, world)
    return sim.output("y")


def _count_replays(step) -> list[bool]:
    """Whether each call of ``step`` past its second was replayed (``_replay_local``)."""
    seen: list[bool] = []
    replay = step._replay_local

    def counted(inputs):
        outputs = replay(inputs)
        seen.append(outputs is not None)
        return outputs

    step._replay_local = counted
    return seen


def _replays_match_full_calls(comm, x: torch.Tensor) -> dict:
    """A local step that replays calls like its last one against a twin that never does, over
    the same calls on every rank (the same tensor, a new one, one that needs grad, another
    number, another length, the same again), with the reduced step's round after each pair (it
    compares both steps' calls): the same outputs, and no round refused."""
    fast = cc.compile(local("replayed"), comm=comm, fused_kernels=False)
    slow = cc.compile(local("full"), comm=comm, fused_kernels=False)
    slow._replay_local = lambda inputs: None
    replayed = _count_replays(fast)
    step = cc.compile(reduced(), comm=comm, fused_kernels=False)
    gen = torch.Generator().manual_seed(6)
    calls = [(x, 2.0), (x, 2.0), (x, 2.0), (torch.randn(N, generator=gen), 2.0),
             (x.clone().requires_grad_(), 2.0), (x, 0.5), (x[:N - 3], 0.5), (x[:N - 3], 0.5),
             (x, 0.5), (x, 0.5)]  # fmt: skip
    equal, rounds = [], []
    for i, (xi, c) in enumerate(calls):
        got = [s(x=xi, c=c)["y"] for s in (fast, slow)]
        equal.append(torch.equal(got[0], got[1]) and torch.equal(got[0], xi.detach() * c + 1.0))
        rounds.append(_call(step, reduced_inputs(comm.rank, 30 + i))["status"])
    return {"equal": all(equal), "rounds": sorted(set(rounds)), "replayed": replayed}


def _call(step, mine: dict) -> dict:
    """``_attempt`` with the output kept (the caller compares it)."""
    t0 = time.perf_counter()
    try:
        y = step(**mine)["y"]
        return {"status": "no error", "message": "", "y": y, "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"status": _kind(e), "message": str(e), "y": None,
                "seconds": time.perf_counter() - t0}  # fmt: skip


def checks(comm: Communicator) -> dict:
    """Every check that leaves the communicator usable, in one job."""
    rank, world = comm.rank, comm.world
    control = comm.control
    step = cc.compile(reduced(), comm=comm, fused_kernels=False)
    out: dict = {}

    # 1. good calls: every result bitwise the simulator's; after the first call the agreement
    # rides with the all_reduce (over shared memory: one round per call, carried)
    rounds0, carried0 = control.rounds, control.carried
    exact = []
    for seed in range(6):
        got = _call(step, reduced_inputs(rank, seed))
        exact.append(got["status"] == "no error" and torch.equal(got["y"], _want(world, seed)))
    out["good"] = {"exact": exact, "rounds": control.rounds - rounds0,
                   "carried": control.carried - carried0}  # fmt: skip

    def after(label: str, on_rank: int, **changes) -> None:
        mine = reduced_inputs(rank, 7)
        if rank == on_rank:
            mine.update(changes)
        out[label] = _attempt(step, mine)

    # 2. misuse on a call whose agreement rides with the all_reduce: refused on every rank alike
    after("scalar differs", 1, c=0.25)
    after("bad dtype", 1, x=torch.zeros(N, dtype=torch.float64))
    after("one rank's shape", 0, x=torch.zeros(N + 3))
    # both ranks' shapes change: agreed in full (the new sizes), then ride again
    bigger = _call(step, reduced_inputs(rank, 8, N + 5))
    out["new shapes"] = bigger["status"] == "no error" and torch.equal(bigger["y"],
                                                                       _want(world, 8, N + 5))
    again = _call(step, reduced_inputs(rank, 9, N + 5))
    out["new shapes again"] = again["status"] == "no error" and torch.equal(again["y"],
                                                                            _want(world, 9, N + 5))
    # two compiled steps of the program (two layers of one shape) called in another order
    other = cc.compile(reduced(), comm=comm, fused_kernels=False)
    other(**reduced_inputs(rank, 1))  # its first call: compiled step 2 of the program everywhere
    out["swapped steps"] = _attempt(step if rank == 0 else other, reduced_inputs(rank, 3))
    del other

    # 3. steps that communicate nothing: agreed at the next round. Each case diverges the ranks
    # for good (one ran a call the other did not), so each has a local step of its own
    def fresh(name: str):
        lstep = cc.compile(local(name), comm=comm, fused_kernels=False)
        lstep(x=x, c=2.0)  # its first call agrees in full
        return lstep

    x = torch.randn(N, generator=torch.Generator().manual_seed(5))
    lstep = fresh("local")
    replayed = _count_replays(lstep)
    rounds0 = control.rounds
    fine = all(torch.equal(lstep(x=x, c=2.0)["y"], x * 2.0 + 1.0) for _ in range(3))
    out["local calls"] = {"equal": fine, "rounds": control.rounds - rounds0,
                          "replayed": sum(replayed)}  # fmt: skip
    out["local replays"] = _replays_match_full_calls(comm, x)
    out["after local calls"] = _call(step, reduced_inputs(rank, 10))["status"]
    # one rank runs a local step once more than the other
    lstep = fresh("extra")
    lstep(x=x, c=2.0)
    if rank == 0:
        lstep(x=x, c=2.0)
    out["local extra call"] = _attempt(step, reduced_inputs(rank, 11))
    # a Replicated value that differs in a local step
    lstep = fresh("scalar")
    lstep(x=x, c=2.0 if rank == 0 else 3.0)
    out["local scalar differs"] = _attempt(step, reduced_inputs(rank, 12))
    # a bad input in a local step: refused on that rank alone, at once; the other ran the call
    # and learns at the next round
    lstep = fresh("bad")
    out["local bad input"] = _attempt(lstep, {"x": x.double() if rank == 1 else x, "c": 2.0})
    out["after local bad input"] = _attempt(step, reduced_inputs(rank, 13))
    # and the communicator is still usable: a good call is exact
    good = _call(step, reduced_inputs(rank, 14))
    out["usable"] = good["status"] == "no error" and torch.equal(good["y"], _want(world, 14))

    # 4. shapes this rank had before, or new ones the same on every rank: no exchange (the
    # verdict every rank proposes stands); ranks that propose different verdicts are refused
    exchanges0 = control.exchanges
    exact = []
    for seed, n in enumerate([N, N + 5, N, N + 5, N + 7, N + 7, N], start=15):
        got = _call(step, reduced_inputs(rank, seed, n))
        exact.append(got["status"] == "no error" and torch.equal(got["y"], _want(world, seed, n)))
    lstep = fresh("lengths")  # (a step that communicates nothing: a round, no exchange)
    exchanges1 = control.exchanges
    lengths = [N + 2, N, N + 2]
    fine = all(torch.equal(lstep(x=x[:n], c=2.0)["y"], x[:n] * 2.0 + 1.0) for n in lengths)
    out["shapes seen"] = {"exact": exact, "local": fine,
                          "exchanges": [exchanges1 - exchanges0 - 1,  # (fresh's first call)
                                        control.exchanges - exchanges1]}  # fmt: skip
    out["kept verdicts differ"] = _attempt(step, reduced_inputs(rank, 22, N + 5 * rank))
    out["new verdicts differ"] = _attempt(step, reduced_inputs(rank, 23, N + 9 + 2 * rank))
    again = _call(step, reduced_inputs(rank, 24, N + 5))
    out["usable after"] = again["status"] == "no error" and torch.equal(
        again["y"], _want(world, 24, N + 5))
    out["calls"] = step.calls
    return out


def out_of_step(comm: Communicator) -> dict:
    """Rank 0 runs a step (its agreement round) while rank 1 runs a control vote: the two
    reach different kinds of rounds at the same point; both are told at once."""
    step = cc.compile(reduced(), comm=comm, fused_kernels=False)
    step(**reduced_inputs(comm.rank, 0))
    t0 = time.perf_counter()
    try:
        if comm.rank == 0:
            step(**reduced_inputs(comm.rank, 1))
        else:
            comm.agree_max([1, 2, 3], "a vote")
        status, message = "no error", ""
    except Exception as e:  # noqa: BLE001 - reported to the test
        status, message = _kind(e), str(e)
    return {"status": status, "message": message, "seconds": time.perf_counter() - t0}


def aligned_starts(comm: Communicator, late: float) -> dict:
    """``Communicator.aligned_start`` with rank 1 ``late`` seconds late, then back to back: when
    each rank arrived and left (``time.monotonic``: one clock on the host), and what a
    dead-peer-free start costs in the communicator's shared-memory rounds."""
    spans = []
    for delay in (late, 0.0, 0.0):
        if comm.rank == 1:
            time.sleep(delay)
        arrived = time.monotonic()
        comm.aligned_start("test")
        spans.append((arrived, time.monotonic()))
    return {"spans": spans, "transport": comm.transport_of(None).value}
