"""What a tune found: each candidate's prediction and measurement (``Row``), the result
(``TuneResult``: the winner, its JSON form for the cache and ``coconet tune --json``), and
``explain``: the tuner's choice in words and a table.

The rows and their explanation live together: the explanation reads nothing but a result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coconet.errors import ConfigError
from coconet.ir.program import Program
from coconet.options import TransportKind
from coconet.runtime.comm import Communicator
from coconet.tune.candidates import Candidate, Enumeration
from coconet.tune.cost import Part
from coconet.tune.measure import Measurement, Rematch, communicator_options

__all__ = ["Row", "TuneResult", "explain"]


@dataclass
class Row:
    """One candidate: its prediction and, if it was measured, its measurement."""

    candidate: Candidate
    predicted_ms: float
    parts: list[Part]
    measured: Measurement | None = None
    # as each earlier calibration of the machine predicts it, newest first (None: it cannot):
    # the calibration's drift (``explain``)
    earlier_ms: list[float | None] = field(default_factory=list)

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
                    "earlier_predicted_ms": r.earlier_ms,
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
            earlier = [None if x is None else float(x) for x in c.get("earlier_predicted_ms", [])]
            rows.append(Row(cand, float(c["predicted_ms"]), parts, m, earlier))
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

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _sizes(sizes) -> str:
    return ", ".join(f"{k}={v:,}" for k, v in sizes.items())


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 1 else str(c).rjust(w) if i > 1 else str(c).ljust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def explain(result: TuneResult) -> str:
    rows = result.rows
    measured = [r for r in result.measured if r.measured_ms is not None]
    winner = result.winner_row
    extra = len(rows) - len(result.enumeration.schedules) * len(
        {r.candidate.transport for r in rows}
    )
    out = [
        f"coconet tune: {result.program.name} with {_sizes(result.sizes)} on {result.world} "
        f"rank(s)"
        + (f" (from the cache, read in {result.seconds:.1f} s)" if result.cached
           else f" ({result.seconds:.1f} s)"),
        f"cost model: {result.machine}",
        f"{len(rows)} candidates ({len(result.enumeration.schedules)} schedules x "
        f"{len({r.candidate.transport for r in rows})} transport(s)"
        + (f", and {extra} with torch.distributed's native algorithms" if extra else "")
        + f"), {sum(r.measured is not None for r in rows)} measured",
        "",
    ]
    order = sorted(rows, key=lambda r: (r is not winner, r.score, r.predicted_ms))
    table = []
    for i, r in enumerate(order, 1):
        m = r.measured
        if m is None:
            status, behind = "not measured", ""
        elif m.ms is None:
            status, behind = ("timed out" if m.timed_out else "failed"), ""
        else:
            err = (r.predicted_ms - m.ms) / m.ms
            status = f"{err:+.0%}"
            behind = "winner" if r is winner else f"{(m.ms / winner.measured_ms - 1):+.0%}"
        table.append(
            [str(i), r.candidate.label, _ms(r.predicted_ms), _ms(r.measured_ms), status, behind]
        )
    out += _table(
        ["#", "candidate", "predicted ms", "measured ms", "pred. err", "vs winner"], table
    )
    out.append("")
    steps = "; ".join(winner.candidate.steps) or "(no transformation)"
    out.append(f"winner: {winner.candidate.label}: {steps}")
    others = [r for r in measured if r is not winner]
    again = result.rematch
    if others:
        second = others[0]
        margin = second.measured_ms - winner.measured_ms
        out.append(
            f"  {winner.measured_ms:.2f} ms measured ({winner.predicted_ms:.2f} predicted), "
            + (
                f"{margin:.2f} ms ({margin / second.measured_ms:.0%}) faster than the runner-up "
                if margin >= 0
                else f"{-margin:.2f} ms ({-margin / second.measured_ms:.0%}) slower than "
            )
            + f"{second.candidate.label} ({second.measured_ms:.2f} ms)"
            + (" in the first round" if again is not None else "")
        )
    if again is not None:
        a, b = again.medians
        fast, slow = (b, a) if again.overturned else (a, b)
        loser = again.first if again.overturned else again.second
        out.append(
            f"  deciding round, their steps interleaved ({len(again.first_ms)} each): "
            f"{fast:.2f} ms against {slow:.2f} ms for {loser.label} "
            f"({(slow - fast) / slow:.0%} faster)"
            + ("; it overturned the first round" if again.overturned else "")
        )
    if not others:
        out.append(f"  {winner.measured_ms:.2f} ms measured; no other candidate ran")
    out.append(
        "  where its time goes (predicted): "
        + ", ".join(f"{k} {1e3 * s:.2f} ms" for k, s in _kinds(winner).items())
    )
    out += ["", "what each rewrite was predicted to save, and what it saved (measured):"]
    out += _rewrites(result)
    out += ["", "why the others were not chosen:"]
    for j in result.enumeration.rejected:
        out.append(f"  {j.recipe}: illegal: {j.error.message}")
    for recipe, same in result.enumeration.duplicates.items():
        out.append(f"  {recipe}: the same program as {same}")
    for r in order:
        if r is winner:
            continue
        m = r.measured
        lost_rematch = again is not None and r.candidate in (again.first, again.second)
        if m is not None and m.ms is None:
            out.append(f"  {r.candidate.label}: {m.error}")
        elif lost_rematch:
            a, b = again.medians
            mine, theirs = (a, b) if r.candidate is again.first else (b, a)
            out.append(
                f"  {r.candidate.label}: legal, lost the deciding round: {mine:.2f} ms against "
                f"{theirs:.2f} ({(mine - theirs) / theirs:.0%} slower, steps interleaved)"
            )
        elif m is not None:
            d = m.ms - winner.measured_ms
            out.append(
                f"  {r.candidate.label}: legal, slower by {d:.2f} ms measured "
                f"({d / winner.measured_ms:.0%})"
            )
        else:
            d = r.predicted_ms - winner.predicted_ms
            rel = abs(d) / max(winner.predicted_ms, 1e-9)
            if d >= 0:
                out.append(f"  {r.candidate.label}: legal, predicted slower by {d:.2f} ms "
                           f"({rel:.0%}): not measured")
            else:
                out.append(f"  {r.candidate.label}: legal, predicted faster than the winner by "
                           f"{-d:.2f} ms ({rel:.0%}), but not among the best predicted that "
                           "were measured")
    if measured:
        errs = [abs(r.predicted_ms - r.measured_ms) / r.measured_ms for r in measured]
        within = sum(e <= 0.25 for e in errs)
        out += [
            "",
            f"prediction: mean error {sum(errs) / len(errs):.0%} over the "
            f"{len(errs)} measured; {within} of {len(errs)} within 25%",
        ]
        out += _drift(winner, measured)
    return "\n".join(out)


def _drift(winner: Row, measured: list[Row]) -> list[str]:
    """The calibration's drift, as an uncertainty: how the winner's prediction and the mean
    error over the measured candidates move under the machine's earlier calibrations."""
    n = len(winner.earlier_ms)
    if not n:
        return ["calibration drift: unknown: this machine has one calibration kept "
                "(coconet tune --recalibrate keeps it and takes another; their predictions "
                "side by side are the drift)"]  # fmt: skip
    mine = [winner.predicted_ms, *(x for x in winner.earlier_ms if x is not None)]
    lo, hi = min(mine), max(mine)
    half = (hi - lo) / 2 / ((hi + lo) / 2) if hi + lo > 0 else 0.0
    lines = [f"calibration drift: {n} earlier calibration(s) kept: the winner's prediction "
             f"spans {lo:.2f}-{hi:.2f} ms across them and this one (+/-{half:.0%}: the "
             "uncertainty of a prediction on this machine)"]  # fmt: skip
    for i in range(n):
        pairs = [(r.earlier_ms[i], r.measured_ms) for r in measured
                 if len(r.earlier_ms) > i and r.earlier_ms[i] is not None]  # fmt: skip
        if pairs:
            err = sum(abs(p - m) / m for p, m in pairs) / len(pairs)
            lines.append(f"  with the earlier calibration #{i + 1} (newest first): mean error "
                         f"{err:.0%} over the {len(pairs)} measured")  # fmt: skip
    return lines


def _kinds(row: Row) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in row.parts:
        out[p.kind] = out.get(p.kind, 0.0) + p.seconds
    return {k: v for k, v in out.items() if v > 0}


def _rewrites(result: TuneResult) -> list[str]:
    by: dict = {}
    for r in result.rows:  # on torch.distributed, the row with the model's algorithms
        by.setdefault((r.candidate.recipe, r.candidate.transport), r)
    lines = []
    for r in result.rows:
        parent = r.candidate.parent_recipe
        if parent is None:
            continue
        base = by.get((parent, r.candidate.transport))
        if base is None:
            continue
        lines.append(
            _saving(
                f"{r.candidate.last_rewrite} ({base.candidate.name} -> "
                f"{r.candidate.name}, {r.candidate.transport.value})",
                base,
                r,
            )
        )
    shm, td = TransportKind.SHARED_MEMORY, TransportKind.TORCH_DISTRIBUTED
    for r in result.rows:
        if r.candidate.transport is shm and (r.candidate.recipe, td) in by:
            base = by[(r.candidate.recipe, td)]
            lines.append(
                _saving(f"shared memory instead of torch.distributed ({r.candidate.name})", base, r)
            )
    for r in result.rows:
        first = by[(r.candidate.recipe, r.candidate.transport)]
        if r is not first and r.candidate.transport is td:
            chosen = ", ".join(f"{op.value}={a.value}" for op, a in first.candidate.algorithms)
            lines.append(
                _saving(
                    f"native algorithms instead of {chosen} ({r.candidate.name}, "
                    "torch.distributed)",
                    first,
                    r,
                )
            )
    return lines or ["  (no candidate is one rewrite away from another)"]


def _saving(what: str, before: Row, after: Row) -> str:
    def said(ms: float, past: bool) -> str:
        verb = ("saved" if ms >= 0 else "cost") if past else ("save" if ms >= 0 else "cost")
        return f"{verb} {abs(ms):.2f} ms"

    text = f"  {what}: predicted to {said(before.predicted_ms - after.predicted_ms, False)}"
    if before.measured_ms is not None and after.measured_ms is not None:
        text += f", {said(before.measured_ms - after.measured_ms, True)} (measured)"
    return text
