"""``coconet.tune.tune``: enumerate, predict, measure the most promising, choose, explain.

::

    comm = coconet.runtime.init()
    result = coconet.tune.tune(program, comm, sizes={"N": 1 << 24})   # collective
    print(result.explain())
    step = coconet.compile(result.winner.target, comm=result.communicator(comm))

Every rank calls ``tune`` with the same arguments. The candidates are every legal schedule of
the program on every transport the ranks can use (``coconet.tune.candidates``). The cost model
(calibrated once per machine, ``coconet.tune.calibrate``) predicts each; the ``top`` best
predicted, and always the unscheduled program (the baseline a rewrite has to beat, visibly), are
measured on the real ranks (``coconet.tune.measure``). The winner is the fastest measured; every
rank gets the same, since each measured time is the slowest rank's. When the runner-up is
within ``rematch_within`` of it, the two are timed again with their steps interleaved (a
``Rematch``), and the faster there wins. On a shared host the first round, one candidate after
the other, can rank two candidates by when each ran (``benchmarks/tune_rematch.py`` compares
the two ways). The result is cached
(``coconet.tune.store``): a second tune of the same case is read back, ``retune=True`` measures
again.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coconet.errors import CoconetError, ConfigError
from coconet.ir.program import Program
from coconet.options import Algorithm, CompileOptions, TransportKind
from coconet.progress import phase
from coconet.runtime.comm import Communicator
from coconet.tune import store
from coconet.tune.calibrate import calibrate, calibrated_bytes, extend, extension_sizes
from coconet.tune.candidates import CHUNKS, Candidate, enumerate_candidates
from coconet.tune.cost import MachineModel, predict
from coconet.tune.measure import (
    Communicators,
    Measurement,
    Rematch,
    measure,
    rematch,
)
from coconet.tune.results import Row, TuneResult

__all__ = ["Row", "TuneResult", "candidate_rows", "tune"]  # (Row, TuneResult: tune.results)


def tune(
    program: Program,
    comm: Communicator,
    sizes: Mapping[str, int],
    *,
    options: CompileOptions | None = None,
    scalars: Mapping[str, float] | None = None,
    state: Sequence[str] = (),
    top: int = 4,
    measure_all: bool = False,
    transports: Sequence[TransportKind] | None = None,
    chunks: Sequence[int] = CHUNKS,
    reps: int = 7,
    budget_s: float = 60.0,
    rematch_within: float = 0.5,
    retune: bool = False,
    recalibrate: bool | None = None,
    only: Sequence[str] | None = None,
    progress: bool | Callable[[str], None] = False,
    fix_algorithms: bool = True,
    replicas: Sequence[str] = (),
) -> TuneResult:
    """Choose the schedule and transport of ``program`` with ``sizes`` bound, on ``comm``'s
    ranks (see the module's docstring). Collective.

    ``options``: the compile options every candidate is measured with (``donate=("g",)``,
    ``commit="swap"``, ...). ``scalars``: values of the program's scalars while measuring
    (0.5 for any not given). ``state``: the inputs the schedules may store sliced (the
    optimizer's state: Adam's ``("m", "v")``; never the parameters). ``top``: how many of the
    best predicted to measure (``measure_all``: every one; ``only``: exactly the candidates with
    these labels, for a benchmark that measures each in processes of its own). ``retune``:
    ignore a cached result; ``recalibrate`` (default: as ``retune``): calibrate the machine
    again. ``transports``: restrict them
    (default: shared memory and torch.distributed on one host, torch.distributed across
    hosts). ``budget_s``: a candidate
    whose warm-up takes longer scores as timed out. ``rematch_within``: when the runner-up
    measured within this fraction of the winner, time the two again, interleaved, and keep the
    faster there (0: never). ``fix_algorithms``: on torch.distributed,
    measure each candidate with the collective algorithms the model chose (False: with the
    communicator's own choice, for a caller that runs the winner on its communicator as it is).
    ``replicas``: the inputs the caller passes as host replicas (``CompiledStep.host_replica``,
    ``coconet.optim``'s ``param_storage="host-shared"``): predicted and measured so.
    """
    _check_arguments(program, comm, sizes, top, rematch_within)
    options = options or CompileOptions()
    began = time.perf_counter()
    say = _say(progress, comm.rank)
    comms = Communicators(comm)
    chosen = _transports(comms, transports)
    candidates, enumeration = enumerate_candidates(program, chosen, chunks, state)
    settings = {
        "top": top,
        "measure_all": measure_all,
        "chunks": list(chunks),
        "state": list(state),
        "fix_algorithms": fix_algorithms,
        "reps": reps,
        "budget_s": budget_s,
        "rematch_within": rematch_within,
        "scalars": dict(scalars or {}),
        "replicas": sorted(replicas),
        "compile options": {k: str(v) for k, v in sorted(vars(options).items())},
    }
    # 1. a result cached for the same program, sizes, ranks and settings
    key = store.result_key(program, sizes, comm, chosen, settings)
    if not retune:
        doc = store.load_result(comm, key)
        if doc is not None:
            say(
                "tuning result read from the cache (tune(..., retune=True), or coconet tune "
                "--retune, measures again)"
            )
            cached = TuneResult.from_json(program, doc, enumeration)
            # what the user waited for now (the tuning it replays took doc["seconds"])
            return dataclasses.replace(cached, seconds=time.perf_counter() - began)
    # 2. the machine's model (calibrated once per machine), and every candidate predicted
    model, earlier = _machine(
        comms,
        chosen,
        retune if recalibrate is None else recalibrate,
        say,
        _largest_tensor(program, comm.mesh, sizes),
    )

    def predicted(c: Candidate, by: MachineModel = model):
        kw = {"donate": options.donate, "commit": options.commit,
              "commit_vote": options.commit_vote, "replicas": tuple(replicas)}
        return predict(c, sizes, by, comm.mesh, **kw)

    rows = candidate_rows(candidates, predicted, fix_algorithms)
    # the drift: each row as the machine's earlier calibrations would have predicted it
    for r in rows:
        r.earlier_ms = [_or_none(predicted, r.candidate, m) for m in earlier]
    # 3. the ones to measure: the best predicted, and always the baseline
    picked = _pick(rows, top, measure_all, only, comm.transport_of(None))
    # 4. measured on the ranks (every rank gets the slowest rank's times)
    _measure_rows(
        rows, picked, comms, sizes, options, scalars, reps, budget_s,
        progress is True and comm.rank == 0, tuple(replicas),
    )
    # 5. a deciding round when the two best measured close together
    again = None
    if only is None:
        again = _deciding_round(rows, picked, rematch_within, comms, sizes, options, scalars,
                                reps, say, tuple(replicas))
    result = TuneResult(
        program,
        dict(sizes),
        comm.world,
        rows,
        enumeration,
        model.description,
        settings,
        cached=False,
        seconds=time.perf_counter() - began,
        rematch=again,
    )
    if only is not None:  # a partial measurement is not a tuning result
        return result
    # 6. cached for the next tune of the same program
    store.save_result(
        comm, key, result.to_json() if any(r.measured_ms is not None for r in rows) else None
    )
    return result


def _check_arguments(
    program: Program, comm: Communicator, sizes: Mapping[str, int], top: int,
    rematch_within: float,
) -> None:
    if not isinstance(program, Program):
        raise ConfigError(
            f"tune takes a Program, got {type(program).__name__}",
            op="tune",
            hint="tune(program, comm, sizes={'N': 1 << 24})",
        )
    if (
        isinstance(rematch_within, bool)
        or not isinstance(rematch_within, (int, float))
        or not 0 <= rematch_within < math.inf
    ):
        raise ConfigError(
            f"rematch_within must be a fraction >= 0, got {rematch_within!r}",
            op="tune",
            hint="tune(..., rematch_within=0.5): a runner-up within 50% is timed again",
        )
    if not isinstance(comm, Communicator):
        raise ConfigError(
            f"tune needs the communicator, got {comm!r}",
            op="tune",
            hint="comm = coconet.runtime.init(); tune(program, comm, sizes=...)",
        )
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ConfigError(
            f"top must be an int >= 1, got {top!r}",
            op="tune",
            hint="tune(..., top=4): measure the 4 best predicted",
        )
    _check_sizes(program, sizes)


def _transports(
    comms: Communicators, transports: Sequence[TransportKind] | None
) -> list[TransportKind]:
    """The transports to tune over: those asked for, each one the ranks can use."""
    usable = comms.transports()
    chosen = list(transports) if transports is not None else usable
    bad = [t for t in chosen if t not in usable]
    if bad:
        raise ConfigError(
            f"transport(s) {[t.value for t in bad]} not available to these ranks",
            op="tune",
            hint=f"they can use {[t.value for t in usable]}",
        )
    return chosen


def _pick(
    rows: list[Row],
    top: int,
    measure_all: bool,
    only: Sequence[str] | None,
    own: TransportKind,
) -> list[int]:
    """The rows to measure: the ``top`` best predicted (every one with ``measure_all``;
    exactly the labels in ``only``), and the baseline, unscheduled on the transport the ranks
    use (its first row: on torch.distributed, with the model's algorithms)."""
    ranked = sorted(range(len(rows)), key=lambda i: rows[i].predicted_ms)
    picked = ranked if measure_all else ranked[:top]
    if only is not None:
        wanted = set(only)
        return [i for i in ranked if rows[i].candidate.label in wanted]
    baselines = [
        i
        for i, r in enumerate(rows)
        if r.candidate.schedule is None and r.candidate.transport is own
    ]
    if baselines and baselines[0] not in picked:
        picked.append(baselines[0])
    return picked


def _measure_rows(
    rows: list[Row],
    picked: list[int],
    comms: Communicators,
    sizes: Mapping[str, int],
    options: CompileOptions,
    scalars: Mapping[str, float] | None,
    reps: int,
    budget_s: float,
    show_bar: bool,
    replicas: tuple[str, ...] = (),
) -> None:
    """Measure the picked rows on the ranks; rank 0 says so when asked (``show_bar``): a line per
    candidate measured, and while one is measured a line every few seconds (on a terminal, one
    line redrawn; in a log, plain lines: ``coconet.progress.phase``)."""
    count = [0]

    def done(c: Candidate, m: Measurement) -> None:
        count[0] += 1
        if show_bar:
            what = f"{c.name}: " + (f"{m.ms:.2f} ms" if m.ms else "failed")
            print(f"coconet tune:   measured {count[0]}/{len(picked)}: {what}", file=sys.stderr,
                  flush=True)  # fmt: skip

    with phase(f"coconet tune: measuring {len(picked)} candidates on the ranks (each compiles, "
               "warms up, then is timed)", enabled=show_bar, file=sys.stderr):  # fmt: skip
        results = measure(
            [rows[i].candidate for i in picked],
            comms,
            sizes,
            options=options,
            scalars=scalars,
            reps=reps,
            budget_s=budget_s,
            progress=done,
            replicas=replicas,
        )
    for i, m in zip(picked, results, strict=True):
        rows[i].measured = m


def _deciding_round(
    rows: list[Row],
    picked: list[int],
    rematch_within: float,
    comms: Communicators,
    sizes: Mapping[str, int],
    options: CompileOptions,
    scalars: Mapping[str, float] | None,
    reps: int,
    say: Callable[[str], None],
    replicas: tuple[str, ...] = (),
) -> Rematch | None:
    """The two best measured, timed again interleaved, when the runner-up is within
    ``rematch_within`` of the winner (every rank has the same times: every rank decides
    alike)."""
    ok = sorted(
        (rows[i] for i in picked if rows[i].measured_ms is not None),
        key=lambda r: r.measured_ms,
    )
    close = len(ok) >= 2 and ok[1].measured_ms <= ok[0].measured_ms * (1 + rematch_within)
    if rematch_within <= 0 or not close:
        return None
    a, b = ok[0].candidate, ok[1].candidate
    say(f"rematch: {a.label} and {b.label} are within {rematch_within:.0%}: timed again")
    return rematch(a, b, comms, sizes, options=options, scalars=scalars, steps=reps,
                   replicas=replicas)


def candidate_rows(
    candidates: Sequence[Candidate],
    predicted: Callable[[Candidate], Any],
    fix_algorithms: bool = True,
) -> list[Row]:
    """A predicted row per candidate and, on torch.distributed (``fix_algorithms``), per choice
    of collective algorithms: the model's fastest for each op, and the library's own (native)
    for every op when that differs, so that measurement can overrule the model's choice as it
    overrules its ranking of schedules. Without ``fix_algorithms`` a candidate leaves the
    algorithms to the communicator (one row)."""
    rows = []
    for c in candidates:
        p = predicted(c)
        if not (fix_algorithms and c.transport is TransportKind.TORCH_DISTRIBUTED and p.algorithms):
            rows.append(Row(c, p.ms, p.parts))
            continue
        chosen = dict(p.algorithms)
        native = {op: Algorithm.NATIVE for op in chosen}
        for algorithms in [chosen] + ([native] if native != chosen else []):
            v = c.with_algorithms(algorithms)
            pv = predicted(v)  # with these algorithms fixed
            rows.append(Row(v, pv.ms, pv.parts))
    return rows


def tuning_bucket(nbytes: int) -> str:
    """Buckets this close in size (a factor of 4 apart at most) share one tuning."""
    if nbytes <= 0:
        return "empty"
    k = max(0, (nbytes.bit_length() - 1) // 2)
    return f"<{4 ** (k + 1)} B"


def _check_sizes(program: Program, sizes: Mapping[str, int]) -> None:
    from coconet.ir.types import Dim

    dims = sorted({s.name for n in program.nodes for s in n.type.shape if isinstance(s, Dim)})
    missing = [d for d in dims if d not in sizes]
    if missing or not all(isinstance(v, int) and v > 0 for v in sizes.values()):
        raise ConfigError(
            f"sizes {dict(sizes)} must bind every Dim of {program.name} ({dims}) to a positive int",
            op="tune",
            hint="tune(program, comm, sizes={" + ", ".join(f"'{d}': 4096" for d in dims) + "})",
        )


def _say(progress, rank: int) -> Callable[[str], None]:
    if callable(progress) and not isinstance(progress, bool):
        return progress
    if progress and rank == 0:
        return lambda msg: print(f"coconet tune: {msg}", file=sys.stderr, flush=True)
    return lambda msg: None


def _machine(
    comms: Communicators,
    transports: Sequence[TransportKind],
    retune: bool,
    say,
    needed: int = 0,
) -> tuple[MachineModel, list[MachineModel]]:
    """The calibrated model of this machine: from the cache, else measured now; measured up to
    ``needed`` bytes (the tune's largest tensor) if it was not yet. Collective. With it, the
    machine's earlier calibrations (``EARLIER_KEPT`` at most, newest first), whose predictions
    of the same candidates are the calibration's drift (``explain``): a recalibration keeps
    the one it replaces among them."""
    base = comms.base
    progress = lambda what: say(f"  calibrating {what}")  # noqa: E731
    model = None
    conditions = None
    doc = store.load_machine(base, transports)
    kept = earlier_calibrations(doc)
    if not retune and doc is not None:
        model = MachineModel.from_json(doc)
        conditions = doc.get("conditions")
        say(_cached_calibration(conditions))
    elif doc is not None:  # replaced: kept among the earlier ones
        kept = [{k: v for k, v in doc.items() if k != "earlier"}, *kept][:EARLIER_KEPT]
    measured = model is None
    if model is None:
        conditions = _conditions()
        say("calibrating the cost model on these ranks (once per machine; about 15 s)")
        if _busy(conditions):
            say(f"note: the machine is busy while calibrating ({_load_text(conditions)}): "
                "predictions may be off when it is quieter; coconet tune --recalibrate (or "
                "tune(..., recalibrate=True)) measures it again")
        model = calibrate({t: comms.get(t) for t in transports}, progress=progress)
    if extension_sizes(calibrated_bytes(model), needed):
        say(f"calibrating the cost model up to {needed / (1 << 20):.0f} MiB (once per machine)")
        by_transport = {t: comms.get(t) for t in transports}
        model = extend(model, by_transport, needed, progress)
        measured = True
    if measured:
        store.save_machine(base, transports,
                           dict(model.to_json(), conditions=conditions, earlier=kept))  # fmt: skip
    return model, [MachineModel.from_json(d) for d in kept]


def _or_none(predicted: Callable, candidate: Candidate, model: MachineModel) -> float | None:
    """``candidate``'s predicted ms under an earlier calibration; None where that one cannot
    predict it (an op or transport it did not measure)."""
    try:
        return predicted(candidate, model).ms
    except CoconetError:
        return None


# The earlier calibrations a machine's cached model keeps (``_machine``): enough to see whether
# predictions move between calibrations (the memory probe's 32 MiB point moved 1.2-2.9 ms
# between calibrations of one VM), few enough that the cache stays small.
EARLIER_KEPT = 3


def earlier_calibrations(doc: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The earlier calibrations a cached machine document keeps, newest first (those a file
    written before they were kept, or a damaged entry, leave out)."""
    out = []
    for d in (doc or {}).get("earlier") or []:
        try:
            MachineModel.from_json(d)
        except (KeyError, TypeError, ValueError):
            continue
        out.append(d)
    return out[:EARLIER_KEPT]


def _conditions() -> dict:
    """When and under what load a calibration is taken (kept with it, said when it is reused)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        load = None
    return {"at": time.time(), "load1": load, "cpus": os.cpu_count() or 1}


def _busy(conditions: Mapping[str, Any] | None) -> bool:
    """Other work was running: a 1-minute load average of at least half the cores (and 1)."""
    if not conditions or conditions.get("load1") is None:
        return False
    return float(conditions["load1"]) >= max(1.0, 0.5 * int(conditions.get("cpus") or 1))


def _load_text(conditions: Mapping[str, Any]) -> str:
    return f"load average {float(conditions['load1']):.1f} on {conditions.get('cpus')} cores"


def _cached_calibration(conditions: Mapping[str, Any] | None) -> str:
    """What a tune that reuses the cached calibration says about it."""
    if not conditions:
        return ("cost model: the calibration cached on this machine (when and under what load "
                "it was taken was not recorded; --recalibrate measures it again)")  # fmt: skip
    age = max(0.0, time.time() - float(conditions.get("at", time.time())))
    ago = (f"{age / 86400:.1f} days" if age >= 86400 else f"{age / 3600:.1f} hours"
           if age >= 3600 else f"{age / 60:.0f} minutes")  # fmt: skip
    text = f"cost model: the calibration cached {ago} ago"
    if _busy(conditions):
        now = _conditions()
        return (f"{text}, taken on a busy machine ({_load_text(conditions)}; now "
                f"{_load_text(now)}): its predictions may be off; coconet tune --recalibrate "
                "measures it again")  # fmt: skip
    return f"{text} ({_load_text(conditions)}); --recalibrate measures it again"


def _largest_tensor(program: Program, mesh, sizes: Mapping[str, int]) -> int:
    """Bytes of the program's largest tensor with ``sizes`` bound (whole, not a rank's slice):
    the largest message any of its collectives can move."""
    from coconet.accounting import Counter

    counter = Counter(mesh, sizes)
    return max((counter.full_bytes(n.type) for n in program.nodes if n.type.rank), default=0)


def _terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
