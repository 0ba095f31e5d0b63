"""Calibrating the cost model on the machine at hand: short micro-benchmarks on the real ranks.

Collective (every rank calls ``calibrate`` with the same communicators). Each probe runs every
rank at once (``Communicator.aligned_start``: the ranks share the memory bus and the cores, as
in a step, and a rank woken late from a barrier must not put its lateness in a probe), its
time is the median of a few repetitions, and the medians are reduced with MAX over the world, so
every rank ends with the same model (and would choose the same schedule). What is measured:

- ``memory``: a fused kernel's kind of pass (``addcmul``: 3 streams read, 1 written) and
  ``eager``: unfused ops one after the other (``mul`` then ``add``), on 16K-16M float32, each
  repetition with its operands out of cache, as a step finds them;
- ``op_overhead``: an eager op on a tiny tensor (the dispatch cost);
- ``step_overhead``: a tiny compiled step (one all_reduce, one op), its caches flushed before
  each repetition, less what the model already counts for it: the fixed cost of a step call
  (Python: measured once, on shared memory where there is one, and used for every transport);
- ``flops``: a 384 x 384 matmul;
- every collective op the programs use (all_reduce, reduce_scatter, all_gather) on each
  transport given, each algorithm torch.distributed has for it, at 64 KiB - 64 MiB; on shared
  memory also the all_reduce of a donated buffer in symmetric memory (it reduces in place); a
  point that jumps past its smaller neighbour's time per byte is timed again (``_retime_jumps``);
- ``control``: one round of the per-step agreement on each transport.

About 10-20 s on this kind of 2-core host; the result is cached per machine and world
(``coconet.tune.store``), so a program's second tune reuses it.

``extend`` measures the same probes at a larger size when a tune needs one: a curve is never
trusted more than 2x past the largest size it was measured at (what a pass over memory costs
changes with the size, past the caches and then with the page faults of fresh allocations, so
a line fitted at 64 MiB need not hold at 1 GiB).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from coconet.ir.ops import Op, ReduceOp
from coconet.ir.opspec import Arg, CurveBytes, spec
from coconet.options import TransportKind
from coconet.runtime.comm import Communicator
from coconet.tune.cost import Curve, MachineModel

__all__ = [
    "COLLECTIVE_BYTES",
    "MEMORY_ELEMENTS",
    "calibrate",
    "calibrated_bytes",
    "extend",
    "extension_sizes",
]

KiB, MiB = 1 << 10, 1 << 20
COLLECTIVE_BYTES: tuple[int, ...] = (64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB)
MEMORY_ELEMENTS: tuple[int, ...] = (16 * KiB, 256 * KiB, 2 * MiB, 16 * MiB)
_OPS = (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER)


def _reps(nbytes: int) -> int:
    return 9 if nbytes <= 1 * MiB else 5 if nbytes <= 16 * MiB else 3


def _timed(comm: Communicator, run: Callable[[], None], reps: int,
           before: Callable[[], None] | None = None) -> float:
    """The median seconds of ``run`` over ``reps`` repetitions (after one untimed), this
    rank's, each started at the same instant on every rank (``comm.aligned_start``: ``comm``
    is the communicator that aligns, not necessarily the one ``run`` uses); ``before`` runs
    (untimed) before each repetition."""
    run()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        comm.aligned_start("calibration")
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def last_level_cache_bytes() -> int:
    """The largest CPU cache of this host (Linux sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        scale = {"K": KiB, "M": MiB}.get(text[-1:], 1)
        digits = text.rstrip("KM")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=32 * MiB)


def _evictor(comm: Communicator) -> Callable[[], None]:
    """A pass over twice the last-level cache: run before each repetition of a memory probe, it
    leaves the probe's operands in memory, not in cache. A step's operands are there too: the
    parameters and the state were last touched a step ago, and the step itself moves more than
    the cache holds (probing warm operands predicted 1M-parameter steps at half their time)."""
    junk = torch.zeros(2 * last_level_cache_bytes() // 4, device=comm.device)
    return lambda: junk.add_(1.0)


def _memory(
    comm: Communicator, elements: Sequence[int] = MEMORY_ELEMENTS
) -> list[tuple[float, float]]:
    """(bytes moved, seconds) of a fused kernel's kind of work: one pass that reads three
    streams and writes a new tensor (``addcmul``), as a generated kernel reads the gradient and
    the state and writes the new values; the operands in memory, not in cache (``_evictor``)."""
    points = []
    cold = _evictor(comm)
    for n in elements:
        a, b, c = (torch.rand(n, device=comm.device) for _ in range(3))
        run = lambda a=a, b=b, c=c: torch.addcmul(a, b, c)  # noqa: E731
        points.append((16.0 * n, _timed(comm, run, _reps(16 * n), cold)))
    return points


def _eager(
    comm: Communicator, elements: Sequence[int] = MEMORY_ELEMENTS
) -> list[tuple[float, float]]:
    """(bytes moved, seconds) of eager ops as unfused generated code runs them: one op after
    the other, each allocating its result, with a 0-d scalar operand (``mul`` then ``add``;
    the temporary dies at once, as the step's do); the operands in memory, not in cache."""
    points = []
    cold = _evictor(comm)
    for n in elements:
        a, b = (torch.rand(n, device=comm.device) for _ in range(2))
        s = torch.tensor(0.5, device=comm.device)
        run = lambda a=a, b=b, s=s: torch.add(torch.mul(a, s), b)  # noqa: E731
        points.append((20.0 * n, _timed(comm, run, _reps(20 * n), cold)))
    return points


def _op_overhead(comm: Communicator) -> float:
    """Seconds per eager op on a tiny tensor: the dispatch cost every op pays."""
    a, s = torch.ones(4, device=comm.device), torch.tensor(0.5, device=comm.device)

    def hundred() -> None:
        for _ in range(100):
            torch.mul(a, s)

    return _timed(comm, hundred, 7) / 100


def _tiny_program():
    """One all_reduce, one op, one update: the least a step can be."""
    from coconet.dsl import Tensor, all_reduce, update
    from coconet.ir.program import Program
    from coconet.ir.types import Dim, DType, Local, Replicated

    n = Dim("N")
    g = Tensor("g", DType.float32, [n], Local)
    p = Tensor("p", DType.float32, [n], Replicated)
    return Program("calibration_step", [g, p], [update(p, p + all_reduce(g))])


def _step_seconds(comm: Communicator) -> float:
    """Seconds of one step of a tiny compiled program (one all_reduce, one op, one update): the
    fixed cost of a step call (binding and checking the inputs, the agreement, the generated
    code, the commit) with almost no data. Each repetition runs with the caches flushed, as a
    real step finds them (backward, or the step's own passes over memory, streamed more than
    the cache holds): the interpreter's working set is then read from memory, which made a
    step's fixed cost ~2-4x what back-to-back steps showed (``benchmarks/
    optim_step_timeline.py``: a 4M-parameter Adam step's Python before its kernel)."""
    from coconet.compiler import compile as coconet_compile

    fn = coconet_compile(_tiny_program(), comm=comm, fused_kernels=False)
    size = 4 * comm.world
    gt = fn.input_buffer("g", (size,))
    gt.fill_(1.0)
    pt = torch.zeros(size, device=comm.device)
    return _timed(comm, lambda: fn(g=gt, p=pt), 9, before=_evictor(comm))


_MM = 384  # the matmul probe's size: 2 * 384^3 flops


def _matmul_seconds(comm: Communicator) -> float:
    a, b = (torch.ones(_MM, _MM, device=comm.device) for _ in range(2))
    return _timed(comm, lambda: torch.mm(a, b), 5)


def _collective_run(comm: Communicator, op: Op, numel: int, in_place: bool, buffers: dict):
    """One ``op`` of ``numel`` float32 elements over the world through the communicator (its
    routing, staging and algorithm choice included: what generated code calls). ``buffers``:
    the symmetric tensors made so far, by size (a group keeps each for its lifetime: one per
    size serves every op)."""
    n = comm.world
    part = numel // n
    form = spec(op)
    if form.comm_cost.curve_bytes is CurveBytes.OUTPUT:
        x = torch.ones(part, device=comm.device)  # one rank's slice of the numel it gathers
    else:
        # In symmetric memory, as the tuner measures and coconet.optim runs a gradient: the
        # staging copy of an ordinary tensor is the cost model's own term.
        if numel not in buffers:
            buffers[numel] = comm.symmetric_tensor((numel,), torch.float32)
        x = buffers[numel]
        x.fill_(1.0)
    # the op spec's arguments, with the probe's values (dim 0, equal parts, the first root)
    probe = {
        Arg.REDUCE_OP: {"reduce_op": ReduceOp.SUM},
        Arg.DIM: {"dim": 0},
        Arg.GATHER_DIM: {"dim": 0, "parts": [part] * n},
        Arg.ROOT: {"root": 0},
        Arg.DONATE: {"donate": in_place},
        Arg.AXIS: {},
    }
    args = {k: v for a in form.arguments for k, v in probe[a].items()}

    def run() -> None:
        comm.wait(comm.start(op, x, label="calibration", axis=None, **dict(args)))

    return run


def _torch_collective_run(comm: Communicator, op: Op, algorithm, numel: int):
    group = comm.group(None)

    def run() -> None:
        comm.torch.run_for_measurement(op, algorithm, group, numel, comm.device)

    return run


def _collective_timer(c: Communicator, key, numel: int, buffers: dict) -> Callable[[], None]:
    """The run that times the collective curve ``key`` at ``numel`` elements."""
    transport, op, algorithm, in_place = key
    if transport is TransportKind.TORCH_DISTRIBUTED and algorithm is not None:
        return _torch_collective_run(c, op, algorithm, numel)
    return _collective_run(c, op, numel, in_place, buffers)


# A collective's point whose time per byte is this many times the next smaller size's is timed
# again (a larger message costs less per byte, or about the same, past its latency).
_JUMP = 2.5


def _retime_jumps(
    comm: Communicator,
    align: Communicator,
    comms: Mapping[TransportKind, Communicator],
    points: dict,
    buffers: Mapping[TransportKind, dict],
    first: Mapping | None = None,
) -> dict:
    """``points`` (each collective curve's agreed (bytes, seconds), by key) with every point that
    jumps (``_JUMP``) timed again, with twice the repetitions, and the smaller of its two times
    kept: a slow spell of this shared machine during one probe of 3-9 repetitions must not
    become the model's bandwidth (a calibration here once measured a 256 MiB all_gather at 7x
    its neighbours' time per byte, and the tuner would have believed it). A real knee measures
    the same again and stays. ``first``: per key, the first index that may be timed again (an
    extension re-times only what it measured). Decided on the agreed times, so every rank times
    the same points again. Collective."""
    suspects = []
    for key in sorted(points, key=_key_order):
        pts = points[key]
        for i in range(max(1, (first or {}).get(key, 1)), len(pts)):
            (b0, t0), (b1, t1) = pts[i - 1], pts[i]
            if b0 > 0 and b1 > 0 and t1 / b1 > _JUMP * t0 / b0:
                suspects.append((key, i))
    if not suspects:
        return points
    again = []
    for key, i in suspects:
        nbytes = int(points[key][i][0])
        run = _collective_timer(comms[key[0]], key, nbytes // 4, buffers[key[0]])
        again.append(_timed(align, run, 2 * _reps(nbytes)))
    agreed = comm.max_over_world(again, "cost model calibration, timed again")
    out = {k: list(v) for k, v in points.items()}
    for (key, i), t in zip(suspects, agreed, strict=True):
        b, before = out[key][i]
        out[key][i] = (b, min(before, t))
    return out


def _aligner(comms: Mapping[TransportKind, Communicator]) -> tuple[TransportKind, Communicator]:
    """The transport and communicator whose ``aligned_start`` starts the probes: one whose whole
    world runs on shared memory if any (its start releases the ranks within microseconds; the
    probes of every transport use it), else the first."""
    for t, c in comms.items():
        if c.transport_of(None) is TransportKind.SHARED_MEMORY:
            return t, c
    return next(iter(comms.items()))


def calibrate(
    comms: Mapping[TransportKind, Communicator],
    progress: Callable[[str], None] | None = None,
) -> MachineModel:
    """Measure the machine through ``comms`` (one communicator per transport to calibrate, over
    the same ranks) and return its ``MachineModel``. Collective."""
    say = progress or (lambda _msg: None)
    comm = next(iter(comms.values()))
    aligned_on, align = _aligner(comms)
    say("memory bandwidth")
    memory_points = _memory(align)
    eager_points = _eager(align)
    op_s = _op_overhead(align)
    matmul_s = _matmul_seconds(align)
    collectives: dict = {}
    control: dict[TransportKind, float] = {}
    buffers: dict[TransportKind, dict[int, torch.Tensor]] = {}
    for transport, c in comms.items():
        buffers[transport] = {}
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
                    key = (transport, op, algorithm, in_place)
                    run = _collective_timer(c, key, numel, buffers[transport])
                    points.append((float(numel * 4), _timed(align, run, _reps(nbytes))))
                collectives[(transport, op, algorithm, in_place)] = points
        say(f"{transport.value} agreement")
        control[transport] = _timed(align, lambda c=c: c.agree_max([0], "calibration"), 9)
    say("a step's fixed cost")
    step_s = _step_seconds(align)
    # One model on every rank: each time is the slowest rank's.
    flat: list[float] = [t for _, t in memory_points] + [t for _, t in eager_points]
    flat += [op_s, matmul_s]
    for points in collectives.values():
        flat += [t for _, t in points]
    flat += [*control.values(), step_s]
    agreed = iter(comm.max_over_world(flat, "cost model calibration"))
    memory_points = [(b, next(agreed)) for b, _ in memory_points]
    eager_points = [(b, next(agreed)) for b, _ in eager_points]
    op_s = next(agreed)
    flops = 2.0 * _MM**3 / next(agreed)
    measured = {k: [(b, next(agreed)) for b, _ in pts] for k, pts in collectives.items()}
    control = {t: next(agreed) for t in control}
    step_s = next(agreed)
    measured = _retime_jumps(comm, align, comms, measured, buffers)
    curves = {k: Curve.fit(pts) for k, pts in measured.items()}
    cpus = torch.get_num_threads()
    model = MachineModel(
        description=f"calibrated on this host: {comm.world} ranks x {cpus} thread(s), "
        f"{comm.backend}, transports {', '.join(t.value for t in comms)}",
        world=comm.world,
        collectives=curves,
        memory=Curve.fit(memory_points),
        eager=Curve.fit(eager_points),
        flops=flops,
        control=control,
        op_overhead=op_s,
        overlap=0.0,
    )
    # The step's fixed cost: what the tiny step took beyond its agreement (handshake and vote),
    # its all_reduce of a few bytes (about one more such round) and its op. That is Python
    # (binding and checking, the generated code, the commit), the same whatever carries the
    # rounds, which the model counts apart (``control``); so it is measured once, where rounds
    # are cheapest (the aligner's transport). A gloo round on this VM takes 0.4-0.7 ms or
    # 2.3-5 ms (a halted vCPU woken late), and the same subtraction on gloo gave anything from
    # 2.7 to 8.2 ms in two calibrations, where the real gloo steps showed no such cost.
    fixed = max(0.0, step_s - 3 * control[aligned_on] - op_s)
    model.step_overhead = {t: fixed for t in comms}
    return model


def calibrated_bytes(model: MachineModel) -> float:
    """The largest message every collective curve of ``model`` was measured at (inf for a
    cluster description's formulas, which hold at any size)."""
    if model.formula is not None or not model.collectives:
        return float("inf")
    return min((c.points[-1][0] if c.points else 0.0) for c in model.collectives.values())


def extension_sizes(measured: float, needed: float) -> list[int]:
    """The message sizes to measure so that nothing up to ``needed`` bytes lies more than 2x
    past a measured size: 4x steps up from ``measured``, the last one ``needed`` itself."""
    if not measured * 2 < needed:
        return []
    sizes: list[int] = []
    size = float(measured)
    while size * 4 < needed:
        size *= 4
        sizes.append(int(size))
    return [*sizes, int(needed)]


def extend(
    model: MachineModel,
    comms: Mapping[TransportKind, Communicator],
    needed: int,
    progress: Callable[[str], None] | None = None,
) -> MachineModel:
    """``model`` with every collective curve, and the memory and eager curves, also measured
    up to ``needed`` bytes (a tune's largest tensor; see ``extension_sizes``), each time the
    slowest rank's. Collective: every rank calls it with the same model (rank 0's cached copy,
    or the same calibration) and communicators."""
    say = progress or (lambda _msg: None)
    sizes = extension_sizes(calibrated_bytes(model), needed)
    if not sizes:
        return model
    comm = next(iter(comms.values()))
    _, align = _aligner(comms)
    world = comm.world
    elements = [max(world, b // 4 - (b // 4) % world) for b in sizes]
    say(f"memory bandwidth up to {sizes[-1] / MiB:.0f} MiB")
    memory_new = _memory(align, elements)
    eager_new = _eager(align, elements)
    measured: dict = {}
    buffers: dict[TransportKind, dict[int, torch.Tensor]] = {t: {} for t in comms}
    for key in sorted(model.collectives, key=_key_order):
        transport, op, algorithm, in_place = key
        c = comms.get(transport)
        if c is None:
            continue  # a transport this tune does not use: its curve stays as it was
        say(f"{transport.value} {op.value}" + (f" ({algorithm.value})" if algorithm else "")
            + (" in place" if in_place else "") + f" up to {sizes[-1] / MiB:.0f} MiB")
        points = []
        for numel in elements:
            run = _collective_timer(c, key, numel, buffers[transport])
            points.append((float(numel * 4), _timed(align, run, 3)))
        measured[key] = points
    flat = [t for _, t in memory_new] + [t for _, t in eager_new]
    for points in measured.values():
        flat += [t for _, t in points]
    agreed = iter(comm.max_over_world(flat, "cost model extension"))
    memory_new = [(b, next(agreed)) for b, _ in memory_new]
    eager_new = [(b, next(agreed)) for b, _ in eager_new]
    grown = {key: list(model.collectives[key].points) + [(b, next(agreed)) for b, _ in points]
             for key, points in measured.items()}
    first = {key: len(model.collectives[key].points) for key in grown}
    grown = _retime_jumps(comm, align, comms, grown, buffers, first)
    curves = dict(model.collectives)
    for key, points in grown.items():
        curves[key] = Curve.fit(points)
    return dataclasses.replace(
        model,
        collectives=curves,
        memory=Curve.fit(list(model.memory.points) + memory_new),
        eager=Curve.fit(list(model.eager.points) + eager_new) if model.eager is not None
        else None,
    )


def _key_order(key) -> tuple:
    """Every rank measures the curves in the same order."""
    transport, op, algorithm, in_place = key
    return (transport.value, op.value, algorithm.value if algorithm else "", in_place)
