"""Calibrating the cost model on the machine at hand: short micro-benchmarks on the real ranks.

Collective (every rank calls ``calibrate`` with the same communicators). Each probe runs every
rank at once after a barrier (the ranks share the memory bus and the cores, as in a step), its
time is the median of a few repetitions, and the medians are reduced with MAX over the world, so
every rank ends with the same model (and would choose the same schedule). What is measured:

- ``memory``: a chain of elementwise ops on 16K-16M float32 (see ``_memory``);
- ``flops``: a 384 x 384 matmul;
- every collective op the programs use (all_reduce, reduce_scatter, all_gather) on each
  transport given, each algorithm torch.distributed has for it, at 64 KiB - 64 MiB; on shared
  memory also the all_reduce of a donated buffer in symmetric memory (it reduces in place);
- ``control``: one round of the per-step agreement on each transport.

About 10-20 s on this kind of 2-core host; the result is cached per machine and world
(``coconet.tune.store``), so a program's second tune reuses it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from coconet.ir.ops import Op, ReduceOp
from coconet.runtime.comm import Communicator
from coconet.runtime.transport import TransportKind
from coconet.tune.cost import Curve, MachineModel

__all__ = ["COLLECTIVE_BYTES", "MEMORY_ELEMENTS", "calibrate"]

KiB, MiB = 1 << 10, 1 << 20
COLLECTIVE_BYTES: tuple[int, ...] = (64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB)
MEMORY_ELEMENTS: tuple[int, ...] = (16 * KiB, 256 * KiB, 2 * MiB, 16 * MiB)
_OPS = (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER)


def _reps(nbytes: int) -> int:
    return 9 if nbytes <= 1 * MiB else 5 if nbytes <= 16 * MiB else 3


def _timed(comm: Communicator, run: Callable[[], None], reps: int) -> float:
    """The median seconds of ``run`` over ``reps`` barrier-aligned repetitions (after one
    untimed), the slowest rank's."""
    run()
    times = []
    for _ in range(reps):
        comm.barrier("calibration")
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _memory(comm: Communicator) -> list[tuple[float, float]]:
    """(bytes moved, seconds) of elementwise work as a step runs it: a chain of ops, each
    allocating its result while the earlier ones stay alive (a step's temporaries), with a 0-d
    scalar operand. A lone ``add(out=...)`` into a warm buffer is 20-35% faster per byte than
    that (measured here), and would under-predict every step."""
    points = []
    for n in MEMORY_ELEMENTS:
        a, b = (torch.rand(n, device=comm.device) for _ in range(2))
        s = torch.tensor(0.5, device=comm.device)

        def chain(a=a, b=b, s=s) -> list[torch.Tensor]:
            x, out = a, []
            for _ in range(3):
                x = torch.mul(x, s)  # reads n, writes n
                x = torch.add(x, b)  # reads 2n, writes n
                out.append(x)
            return out

        points.append((3 * 20.0 * n, _timed(comm, chain, _reps(60 * n))))
    return points


_MM = 384  # the matmul probe's size: 2 * 384^3 flops


def _matmul_seconds(comm: Communicator) -> float:
    a, b = (torch.ones(_MM, _MM, device=comm.device) for _ in range(2))
    return _timed(comm, lambda: torch.mm(a, b), 5)


def _collective_run(comm: Communicator, op: Op, numel: int, in_place: bool):
    """One ``op`` of ``numel`` float32 elements over the world through the communicator (its
    routing, staging and algorithm choice included: what generated code calls)."""
    n = comm.world
    part = numel // n
    if op is Op.ALL_GATHER:
        x = torch.ones(part, device=comm.device)
        args = {"dim": 0, "parts": [part] * n}
    else:
        if in_place:
            x = comm.symmetric_tensor((numel,), torch.float32)
            x.fill_(1.0)
        else:
            x = torch.ones(numel, device=comm.device)
        args = {"reduce_op": ReduceOp.SUM, "donate": in_place}
        if op is Op.REDUCE_SCATTER:
            args["dim"] = 0

    def run() -> None:
        comm.wait(comm.start(op, x, label="calibration", axis=None, **dict(args)))

    return run


def _torch_collective_run(comm: Communicator, op: Op, algorithm, numel: int):
    group = comm.group(None)

    def run() -> None:
        comm.torch.run_for_measurement(op, algorithm, group, numel, comm.device)

    return run


def calibrate(
    comms: Mapping[TransportKind, Communicator],
    progress: Callable[[str], None] | None = None,
) -> MachineModel:
    """Measure the machine through ``comms`` (one communicator per transport to calibrate, over
    the same ranks) and return its ``MachineModel``. Collective."""
    say = progress or (lambda _msg: None)
    comm = next(iter(comms.values()))
    say("memory bandwidth")
    memory_points = _memory(comm)
    matmul_s = _matmul_seconds(comm)
    collectives: dict = {}
    control: dict[TransportKind, float] = {}
    for transport, c in comms.items():
        for op in _OPS:
            variants: list[tuple] = []
            if transport is TransportKind.TORCH_DISTRIBUTED:
                variants = [(a, False) for a in c.torch.algorithms(op)] or [(None, False)]
            else:
                variants = [(None, False)] + ([(None, True)] if op is Op.ALL_REDUCE else [])
            for algorithm, in_place in variants:
                what = (
                    f"{transport.value} {op.value}"
                    + (f" ({algorithm.value})" if algorithm else "")
                    + (" in place" if in_place else "")
                )
                say(what)
                points = []
                for nbytes in COLLECTIVE_BYTES:
                    numel = nbytes // 4
                    numel -= numel % c.world
                    if transport is TransportKind.TORCH_DISTRIBUTED and algorithm is not None:
                        run = _torch_collective_run(c, op, algorithm, numel)
                    else:
                        run = _collective_run(c, op, numel, in_place)
                    points.append((float(numel * 4), _timed(c, run, _reps(nbytes))))
                collectives[(transport, op, algorithm, in_place)] = points
        say(f"{transport.value} agreement")
        control[transport] = _timed(c, lambda c=c: c.agree_max([0], "calibration"), 9)
    # One model on every rank: each time is the slowest rank's.
    flat: list[float] = [t for _, t in memory_points] + [matmul_s]
    for points in collectives.values():
        flat += [t for _, t in points]
    flat += list(control.values())
    agreed = iter(comm.max_over_world(flat, "cost model calibration"))
    memory_points = [(b, next(agreed)) for b, _ in memory_points]
    flops = 2.0 * _MM**3 / next(agreed)
    curves = {k: Curve.fit([(b, next(agreed)) for b, _ in pts]) for k, pts in collectives.items()}
    control = {t: next(agreed) for t in control}
    cpus = torch.get_num_threads()
    return MachineModel(
        description=f"calibrated on this host: {comm.world} ranks x {cpus} thread(s), "
        f"{comm.backend}, transports {', '.join(t.value for t in comms)}",
        world=comm.world,
        collectives=curves,
        memory=Curve.fit(memory_points),
        flops=flops,
        control=control,
        overlap=0.0,
    )
