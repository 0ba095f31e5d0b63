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
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coconet.errors import ConfigError
from coconet.ir.program import Program
from coconet.options import Algorithm, CompileOptions, TransportKind
from coconet.runtime.comm import Communicator
from coconet.tune import store
from coconet.tune.calibrate import calibrate, calibrated_bytes, extend, extension_sizes
from coconet.tune.candidates import CHUNKS, Candidate, Enumeration, enumerate_candidates
from coconet.tune.cost import MachineModel, Part, predict
from coconet.tune.measure import (
    Communicators,
    Measurement,
    Rematch,
    communicator_options,
    measure,
    rematch,
)

__all__ = ["Row", "TuneResult", "candidate_rows", "tune"]


@dataclass
class Row:
    """One candidate: its prediction and, if it was measured, its measurement."""

    candidate: Candidate
    predicted_ms: float
    parts: list[Part]
    measured: Measurement | None = None

    @property
    def measured_ms(self) -> float | None:
        return self.measured.ms if self.measured is not None else None

    @property
    def score(self) -> float:
        return self.measured.score if self.measured is not None else math.inf


@dataclass
class TuneResult:
    """What a tune found (see ``explain``)."""

    program: Program
    sizes: dict[str, int]
    world: int
    rows: list[Row]
    enumeration: Enumeration
    machine: str
    options: dict[str, Any] = field(default_factory=dict)
    cached: bool = False
    seconds: float = 0.0
    rematch: Rematch | None = None  # the deciding round between the two best, if they were close

    @property
    def measured(self) -> list[Row]:
        return sorted((r for r in self.rows if r.measured is not None), key=lambda r: r.score)

    @property
    def winner_row(self) -> Row:
        done = [r for r in self.measured if r.measured_ms is not None]
        if not done:
            raise ConfigError(
                f"no candidate of {self.program.name} ran: every measured one failed",
                op="tune",
                details=[f"{r.candidate.label}: {r.measured.error}" for r in self.measured][:8],
                hint="look at the errors above; coconet.compile the program itself to debug",
            )
        if self.rematch is not None:
            for r in done:
                if r.candidate is self.rematch.winner:
                    return r
        return done[0]

    @property
    def winner(self) -> Candidate:
        return self.winner_row.candidate

    def communicator(self, comm: Communicator) -> Communicator:
        """A communicator over ``comm``'s ranks that runs the winner as it was measured (its
        transport and algorithms). Collective. ``comm`` itself when it already does."""
        w = self.winner
        options = communicator_options(w.transport, w.algorithms, comm.options)
        if options == comm.options or (comm.transport_of(None) is w.transport and not w.algorithms):
            return comm
        return comm.variant(options)

    # -- explain ---------------------------------------------------------------------------------

    def explain(self) -> str:
        """The candidates with predicted and measured times, the winner and its margin, what
        each rewrite was predicted to save and did save, and why each other one lost."""
        from coconet.tune.explain import explain

        return explain(self)

    def to_json(self) -> dict[str, Any]:
        """``{"program", "world_size", "candidates": [{"schedule", "predicted_ms",
        "measured_ms"}], "winner"}`` plus the details (``coconet tune --json``)."""
        return {
            "program": self.program.name,
            "world_size": self.world,
            "sizes": self.sizes,
            "machine": self.machine,
            "options": self.options,
            "candidates": [
                {
                    "schedule": str(r.candidate),
                    "name": r.candidate.name,
                    "transport": r.candidate.transport.value,
                    "predicted_ms": r.predicted_ms,
                    "measured_ms": r.measured_ms,
                    "error": r.measured.error if r.measured is not None else None,
                    "predicted_parts": [[p.what, p.kind, 1e3 * p.seconds] for p in r.parts],
                    "candidate": r.candidate.to_dict(),
                    "steps_ms": r.measured.steps_ms if r.measured is not None else [],
                    "timed_out": r.measured.timed_out if r.measured is not None else False,
                }
                for r in self.rows
            ],
            "rejected": [
                {"recipe": j.recipe, "error": j.error.message} for j in self.enumeration.rejected
            ],
            "duplicates": self.enumeration.duplicates,
            "winner": str(self.winner) if any(r.measured_ms is not None for r in self.rows)
            else None,
            "rematch": None if self.rematch is None else {
                "first": self._index(self.rematch.first),
                "second": self._index(self.rematch.second),
                **self.rematch.to_json(),
            },
            "seconds": self.seconds,
        }

    def _index(self, candidate: Candidate) -> int:
        return next(i for i, r in enumerate(self.rows) if r.candidate is candidate)

    @classmethod
    def from_json(cls, program: Program, doc: Mapping[str, Any], enumeration: Enumeration):
        rows = []
        for c in doc["candidates"]:
            cand = Candidate.from_dict(program, c["candidate"])
            parts = [Part(w, k, ms / 1e3) for w, k, ms in c.get("predicted_parts", [])]
            m = None
            if c["measured_ms"] is not None or c.get("error"):
                m = Measurement(
                    cand,
                    c["measured_ms"],
                    list(c.get("steps_ms", [])),
                    c.get("error"),
                    bool(c.get("timed_out", False)),
                )
            rows.append(Row(cand, float(c["predicted_ms"]), parts, m))
        rm = doc.get("rematch")
        again = None
        if rm is not None:
            again = Rematch(
                rows[int(rm["first"])].candidate,
                rows[int(rm["second"])].candidate,
                [float(x) for x in rm["first_ms"]],
                [float(x) for x in rm["second_ms"]],
            )
        return cls(
            program,
            dict(doc["sizes"]),
            int(doc["world_size"]),
            rows,
            enumeration,
            str(doc["machine"]),
            dict(doc.get("options", {})),
            cached=True,
            seconds=float(doc.get("seconds", 0.0)),
            rematch=again,
        )


def _bar(total: int, enabled: bool):
    """A progress bar on stderr (tqdm), or None."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(
        total=total, desc="measuring candidates", unit="candidate", file=sys.stderr, leave=False
    )


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
    model = _machine(
        comms,
        chosen,
        retune if recalibrate is None else recalibrate,
        say,
        _largest_tensor(program, comm.mesh, sizes),
    )

    def predicted(c: Candidate):
        kw = {"donate": options.donate, "commit": options.commit,
              "commit_vote": options.commit_vote, "replicas": tuple(replicas)}
        return predict(c, sizes, model, comm.mesh, **kw)

    rows = candidate_rows(candidates, predicted, fix_algorithms)
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
    """Measure the picked rows on the ranks, with a progress bar on rank 0 when asked."""
    bar = _bar(len(picked), show_bar)

    def done(c: Candidate, m: Measurement) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{c.name}: " + (f"{m.ms:.2f} ms" if m.ms else "failed"))
            bar.update()

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
    if bar is not None:
        bar.close()
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
) -> MachineModel:
    """The calibrated model of this machine: from the cache, else measured now; measured up to
    ``needed`` bytes (the tune's largest tensor) if it was not yet. Collective."""
    base = comms.base
    progress = lambda what: say(f"  calibrating {what}")  # noqa: E731
    model = None
    if not retune:
        doc = store.load_machine(base, transports)
        if doc is not None:
            model = MachineModel.from_json(doc)
    measured = model is None
    if model is None:
        say("calibrating the cost model on these ranks (once per machine)")
        model = calibrate({t: comms.get(t) for t in transports}, progress=progress)
    if extension_sizes(calibrated_bytes(model), needed):
        say(f"calibrating the cost model up to {needed / (1 << 20):.0f} MiB (once per machine)")
        by_transport = {t: comms.get(t) for t in transports}
        model = extend(model, by_transport, needed, progress)
        measured = True
    if measured:
        store.save_machine(base, transports, model.to_json())
    return model


def _largest_tensor(program: Program, mesh, sizes: Mapping[str, int]) -> int:
    """Bytes of the program's largest tensor with ``sizes`` bound (whole, not a rank's slice):
    the largest message any of its collectives can move."""
    from coconet.accounting import Counter

    counter = Counter(mesh, sizes)
    return max((counter.full_bytes(n.type) for n in program.nodes if n.type.rank), default=0)
