"""See what a step did: record a per-rank timeline, merge the ranks into one, plot it.

Record (every rank), either around the steps to look at::

    with coconet.trace.record("traces", comm=comm):
        for batch in batches:
            ...
            opt.step()

or for a whole job, with no change to the script: ``COCONET_TRACE=traces coconet run --nproc 2
train.py`` (``coconet.runtime.init`` opens the recorder, ``shutdown`` or the exit writes it).
Each rank writes ``traces/rank<r>.trace.json`` (Chrome/Perfetto trace-event JSON): every compiled
step with its agreement, rehearsal, body, vote and commit; each collective with its label,
bytes and axis; each wait; each fused kernel call; each optimizer step, layer call and pipeline
action (``coconet.tracing``). The same phases show in ``torch.profiler``'s traces as
``coconet: ...`` ranges whenever torch's profiler runs, with no recorder at all.

Then ``coconet trace merge traces -o step.json [--png step.png]`` (``merge``): one file with a
track per rank, on one clock, which https://ui.perfetto.dev opens as one timeline; ``plot``
draws it as a PNG.

One clock: ranks of one kernel boot (one machine, any containers or namespaces on it) share
CLOCK_MONOTONIC, which the events are stamped with: they need no shifting. Ranks on other
machines are shifted onto the lowest rank's clock at the clock marks they share (the instant each
left one ``aligned_start``: when a communicator was built while recording, and at ``record``'s
entry and exit when given ``comm``), else by their wall clocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coconet import tracing
from coconet.errors import ConfigError

__all__ = [
    "check",
    "format_overlap",
    "load",
    "merge",
    "overlap",
    "plot",
    "predictions",
    "record",
    "summary",
]

_PHASES = frozenset("BEXIiMCbenstfPNOD")  # the trace-event format's "ph" values


@contextlib.contextmanager
def record(directory: str | os.PathLike = "traces", *, comm: Any = None,
           limit: int = 1_000_000) -> Iterator[tracing.Recorder]:  # fmt: skip
    """Record this process's spans into ``directory`` while the block runs; its file is written
    when the block ends (also when it raises). ``comm``: a communicator whose ranks all enter
    and leave the block together (a collective: every rank of it must call ``record``); its
    ``aligned_start`` marks the clocks at entry and exit, which is what lines up ranks on
    different machines in ``merge``. ``limit``: the most events kept (later ones are counted
    as dropped)."""
    recorder = tracing.start(directory, limit)
    marks = 0
    try:
        if comm is not None:
            comm.aligned_start("coconet trace: clock")
            recorder.mark("record: entry")
            marks += 1
        yield recorder
        if comm is not None:
            comm.aligned_start("coconet trace: clock")
            recorder.mark("record: exit")
    finally:
        tracing.stop()


def load(path: str | os.PathLike) -> dict[str, Any]:
    """A trace file (one rank's or a merged one), checked (``check``)."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the trace {path}: {exc}", op="coconet.trace.load",
                          hint="a file that coconet.trace.record or COCONET_TRACE wrote, or "
                          "coconet trace merge") from None  # fmt: skip
    check(document, str(path))
    return document


def check(document: Any, where: str = "the trace") -> None:
    """A ``ConfigError`` unless ``document`` is trace-event JSON (the object form): a
    ``traceEvents`` list whose events each have a name, a known phase, integer pid and tid,
    and, for complete events, a timestamp and a non-negative duration."""
    problems: list[str] = []
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list):
        problems.append("no traceEvents list")
        events = []
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            problems.append(f"event {i} is not an object")
            continue
        if not isinstance(e.get("name"), str) or e.get("ph") not in _PHASES:
            problems.append(f"event {i}: needs a name and a known ph, got {e!r:.120}")
        if not all(isinstance(e.get(k), int) for k in ("pid", "tid")):
            problems.append(f"event {i}: pid and tid must be integers, got {e!r:.120}")
        if e.get("ph") == "X" and not (
            isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("dur"), (int, float))
            and e["dur"] >= 0
        ):
            problems.append(f"event {i}: a complete event needs ts and dur >= 0, got {e!r:.120}")
        if len(problems) >= 5:
            break
    if problems:
        raise ConfigError(f"{where} is not a valid trace-event file", op="coconet.trace.check",
                          details=problems, hint="open it as JSON and look at the events "
                          "named; a file being written is complete only once its rank wrote "
                          "it (at the end of record(), or at shutdown)")  # fmt: skip


def _rank_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("rank*.trace.json"),
                   key=lambda p: int(p.name[4:].split(".")[0]))  # fmt: skip
    if not files:
        raise ConfigError(f"no rank traces in {directory}", op="coconet trace merge",
                          details=["looked for rank<r>.trace.json"],
                          hint="record first: COCONET_TRACE=DIR, or coconet.trace.record(DIR) "
                          "on every rank")  # fmt: skip
    return files


def merge(directory: str | os.PathLike, out: str | os.PathLike | None = None) -> dict[str, Any]:
    """The ranks' traces in ``directory`` as one trace on the lowest rank's clock, starting at
    0, with a track (a "process") per rank; written to ``out`` when given. Its
    ``otherData.coconet`` says how each rank was aligned (``one clock``, ``clock marks`` or
    ``wall clock``) and by how much it was shifted."""
    directory = Path(directory)
    docs = [load(p) for p in _rank_files(directory)]
    infos = []
    for p, d in zip(_rank_files(directory), docs, strict=True):
        info = d.get("otherData", {}).get("coconet")
        if not isinstance(info, dict) or "perf0_ns" not in info:
            raise ConfigError(f"{p} was not written by a coconet recorder",
                              op="coconet trace merge",
                              hint="merge the rank<r>.trace.json files coconet wrote")  # fmt: skip
        infos.append(info)
    ref = infos[0]
    shifts_ns, how = _shifts(infos, ref)
    events: list[dict[str, Any]] = []
    for d, info in zip(docs, infos, strict=True):
        shift_us = shifts_ns[info["rank"]] / 1e3
        for e in d["traceEvents"]:
            e = dict(e)
            if "ts" in e:
                e["ts"] = e["ts"] + shift_us
            events.append(e)
    timed = [e["ts"] for e in events if "ts" in e]
    zero = min(timed) if timed else 0.0
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - zero, 3)
    merged = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"coconet": {
            "ranks": [i["rank"] for i in infos],
            "aligned": {str(i["rank"]): how[i["rank"]] for i in infos},
            "shift_us": {str(i["rank"]): round(shifts_ns[i["rank"]] / 1e3, 3) for i in infos},
            "dropped": {str(i["rank"]): i.get("dropped", 0) for i in infos},
            "hosts": {str(i["rank"]): i.get("host") for i in infos},
        }},
    }  # fmt: skip
    if out is not None:
        Path(out).write_text(json.dumps(merged))
    return merged


def _shifts(infos: list[dict], ref: dict) -> tuple[dict[int, int], dict[int, str]]:
    """Per rank, the nanoseconds to add to its timestamps to put them on ``ref``'s clock, and
    how that was found. Ranks of one clock domain get one shift (the median of their own
    estimates: their true offsets are equal, the marks' release skew is not)."""
    ref_marks = dict(ref.get("marks", []))
    estimates: dict[str, list[int]] = {}
    ways: dict[str, str] = {}
    for info in infos:
        domain = info.get("clock")
        if domain == ref.get("clock"):
            estimates.setdefault(domain, []).append(0)
            ways[domain] = "one clock"
            continue
        marks = dict(info.get("marks", []))
        common = [label for label in ref_marks if label in marks]
        if common:
            estimates.setdefault(domain, []).append(
                int(statistics.median(ref_marks[c] - marks[c] for c in common)))
            ways.setdefault(domain, "clock marks")
        else:
            # both clocks' wall-clock readings at their recorder's start
            estimates.setdefault(domain, []).append(
                (info["wall0_ns"] - info["perf0_ns"]) - (ref["wall0_ns"] - ref["perf0_ns"]))
            ways[domain] = "wall clock"
    per_domain = {d: int(statistics.median(v)) for d, v in estimates.items()}
    shifts = {i["rank"]: per_domain[i.get("clock")] for i in infos}
    how = {i["rank"]: ways[i.get("clock")] for i in infos}
    return shifts, how


def summary(trace: dict[str, Any]) -> str:
    """Where each rank's time went: per rank and category, how many spans and their total
    (inclusive: a collective inside a step counts in both), and the longest waits."""
    check(trace)
    totals: dict[tuple[int, str], list[float]] = {}
    waits: list[tuple[float, int, str]] = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "?")
        entry = totals.setdefault((e["pid"], cat), [0, 0.0])
        entry[0] += 1
        entry[1] += e["dur"] / 1e3
        if cat == tracing.Category.WAIT.value:
            waits.append((e["dur"] / 1e3, e["pid"], e["name"]))
    if not totals:
        return "no spans recorded"
    cats = [c.value for c in tracing.Category if any(k[1] == c.value for k in totals)]
    ranks = sorted({k[0] for k in totals})
    head = f"{'rank':>4}  " + "  ".join(f"{c:>18}" for c in cats)
    lines = [head, "-" * len(head)]
    for r in ranks:
        cells = []
        for c in cats:
            n, ms = totals.get((r, c), (0, 0.0))
            cells.append(f"{n:>6} {ms:>9.2f} ms" if n else f"{'':>18}")
        lines.append(f"{r:>4}  " + "  ".join(cells))
    lines.append("(each cell: spans, total; nested spans count in each category they are in)")
    for ms, r, name in sorted(waits, reverse=True)[:3]:
        lines.append(f"longest wait: rank {r}, {name}: {ms:.3f} ms")
    return "\n".join(lines)


def overlap(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Each collective's time in flight, exposed and hidden, per rank and label, summed over the
    trace: a collective is in flight from its start's beginning to its wait's end (or its
    start's end, where it completed inside the start: shared memory's); it is **exposed** while
    the rank is inside its start or its wait (nothing else of the rank's ran), **hidden** for
    the rest of its flight (the rank computed meanwhile). One dict per (rank, collective):
    ``rank``, ``collective``, ``calls``, ``in_flight_ms``, ``exposed_ms``, ``hidden_ms``."""
    check(trace)
    spans = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"
                    and e.get("cat") in ("collective", "wait")),
                   key=lambda e: (e["pid"], e["ts"]))  # fmt: skip
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    open_: dict[tuple[int, str], dict] = {}  # started, not yet waited for
    for e in spans:
        if e["cat"] == "collective":
            key = (e["pid"], e["name"])
            if key in open_:  # started again without a wait: the last one completed at start
                _settle(rows, key, open_.pop(key), None)
            open_[key] = e
        else:
            key = (e["pid"], e["name"].removeprefix("wait "))
            start = open_.pop(key, None)
            if start is not None:
                _settle(rows, key, start, e)
    for key, start in open_.items():
        _settle(rows, key, start, None)
    return [rows[k] for k in sorted(rows)]


def _settle(rows: dict, key: tuple[int, str], start: dict, wait: dict | None) -> None:
    end = start["ts"] + start["dur"] if wait is None else wait["ts"] + wait["dur"]
    flight = (end - start["ts"]) / 1e3
    exposed = (start["dur"] + (0.0 if wait is None else wait["dur"])) / 1e3
    row = rows.setdefault(key, {"rank": key[0], "collective": key[1], "calls": 0,
                                "in_flight_ms": 0.0, "exposed_ms": 0.0, "hidden_ms": 0.0})
    row["calls"] += 1
    row["in_flight_ms"] += flight
    row["exposed_ms"] += exposed
    row["hidden_ms"] += max(flight - exposed, 0.0)


def predictions(tune_json: str | os.PathLike | dict[str, Any]) -> dict[str, float]:
    """The cost model's predicted milliseconds for each value the winner of a ``coconet tune
    --json`` file communicates (its predicted parts of kind communication), by the value's
    name: what ``format_overlap`` shows next to each collective whose label is that name. A
    part that names no single value (a fused one-pass form's synchronisation) is left out."""
    doc = tune_json if isinstance(tune_json, dict) else json.loads(Path(tune_json).read_text())
    try:
        winner = next(c for c in doc["candidates"] if c["schedule"] == doc["winner"])
    except (KeyError, StopIteration, TypeError):
        raise ConfigError("not a coconet tune --json file with a winner", op="coconet.trace",
                          hint="coconet tune FILE.py:NAME --json tune.json") from None
    out: dict[str, float] = {}
    for what, kind, ms in winner.get("predicted_parts", []):
        if kind != "communication":
            continue
        match = _VALUE_PART.fullmatch(what.split(": ")[-1])
        if match:
            name = next(g for g in match.groups() if g)
            out[name] = out.get(name, 0.0) + float(ms)
    return out


# The cost model's communication parts that name one value (``coconet.tune.cost``): a
# collective "g_sum (all_reduce)" (", read in place"), a fused form's "gather p_new", and an
# operand's staging "g copied into symmetric memory" (part of its collective's time).
_VALUE_PART = re.compile(r"(\w+) \([a-z_]+(?:, read in place)?\)|gather (\w+)|"
                         r"(\w+) copied into symmetric memory")


def format_overlap(rows: list[dict[str, Any]], predicted: dict[str, float] | None = None) -> str:
    """``overlap``'s rows as a table, with each collective's hidden share, and with
    ``predicted`` (``predictions``) the cost model's time per call of the collectives it names,
    next to the measured time in flight per call."""
    if not rows:
        return "no collectives recorded"
    predicted = predicted or {}
    width = max(len(r["collective"]) for r in rows)
    head = (f"{'rank':>4}  {'collective':<{width}}  {'calls':>5}  {'in flight':>10}  "
            f"{'exposed':>10}  {'hidden':>10}  hidden share")  # fmt: skip
    if predicted:
        head += "  in flight/call  predicted/call"
    lines = [head]
    for r in rows:
        share = r["hidden_ms"] / r["in_flight_ms"] if r["in_flight_ms"] > 0 else 0.0
        line = (f"{r['rank']:>4}  {r['collective']:<{width}}  {r['calls']:>5}  "
                f"{r['in_flight_ms']:>7.2f} ms  {r['exposed_ms']:>7.2f} ms  "
                f"{r['hidden_ms']:>7.2f} ms  {share:>11.0%}")  # fmt: skip
        if predicted:
            label = r["collective"].split(": ", 1)[-1]
            guess = predicted.get(label)
            per_call = r["in_flight_ms"] / r["calls"]
            line += f"  {per_call:>11.3f} ms  " + (
                f"{guess:>11.3f} ms" if guess is not None else f"{'-':>14}")
        lines.append(line)
    return "\n".join(lines)


# one colour per category (coconet.tracing.Category), the plot's legend in this order
_COLOURS = {
    "step": "#d9d9d9", "agreement": "#8da0cb", "rehearsal": "#b3b3b3", "body": "#e5c494",
    "collective": "#fc8d62", "wait": "#e41a1c", "control": "#7570b3", "kernel": "#66c2a5",
    "commit": "#a6d854", "optimizer": "#bcbcbc", "layer": "#ffd92f", "pipeline": "#80b1d3",
}  # fmt: skip


def plot(trace: dict[str, Any] | str | os.PathLike, out: str | os.PathLike,
         title: str | None = None) -> Path:  # fmt: skip
    """Draw a (merged) trace as a PNG: one band per rank, a nested span a row below the span
    holding it, coloured by its category. Needs matplotlib (``pip install coconet[trace]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting a trace needs matplotlib", op="coconet.trace.plot",
                          hint='pip install "coconet[trace]" (or matplotlib)') from None
    document = load(trace) if not isinstance(trace, dict) else trace
    check(document)
    rows = _rows(document["traceEvents"])
    if not rows:
        raise ConfigError("the trace has no spans to draw", op="coconet.trace.plot",
                          hint="record a step or more (coconet.trace.record, COCONET_TRACE)")
    ranks = sorted({pid for pid, _ in rows})
    depth = {pid: max(d for p, d in rows if p == pid) + 1 for pid in ranks}
    base, y = {}, 0.0
    for pid in ranks:  # rank 0 on top
        base[pid] = y
        y += depth[pid] + 0.6
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * y))
    seen: set[str] = set()
    for (pid, d), spans in rows.items():
        for cat, bars in spans.items():
            colour = _COLOURS.get(cat, "#999999")
            ax.broken_barh(bars, (y - base[pid] - d - 1, 0.9), facecolors=colour,
                           edgecolors="none", label=None if cat in seen else cat)  # fmt: skip
            seen.add(cat)
    ax.set_yticks([y - base[p] - depth[p] / 2 - 0.5 for p in ranks])
    ax.set_yticklabels([f"rank {p}" for p in ranks])
    ax.set_xlabel("ms")
    ax.set_ylim(0, y)
    handles, labels = ax.get_legend_handles_labels()
    order = [c for c in _COLOURS if c in labels] + [c for c in labels if c not in _COLOURS]
    ax.legend([handles[labels.index(c)] for c in order], order, loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)  # fmt: skip
    ax.set_title(title or "coconet trace")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _rows(events: list[dict]) -> dict[tuple[int, int], dict[str, list[tuple[float, float]]]]:
    """Complete events of the main threads by (rank, nesting depth), then by category, as
    (start ms, length ms) bars."""
    main = {e["pid"]: e["tid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e.get("args", {}).get("name") == "main"}  # fmt: skip
    spans = sorted(
        (e for e in events if e.get("ph") == "X" and e["tid"] == main.get(e["pid"], e["tid"])),
        key=lambda e: (e["pid"], e["ts"], -e["dur"]),
    )
    rows: dict[tuple[int, int], dict[str, list[tuple[float, float]]]] = {}
    stack: list[tuple[int, float]] = []  # (pid, end) of the spans holding the next one
    for e in spans:
        pid, t0, t1 = e["pid"], e["ts"], e["ts"] + e["dur"]
        while stack and (stack[-1][0] != pid or stack[-1][1] <= t0):
            stack.pop()
        d = len(stack)
        rows.setdefault((pid, d), {}).setdefault(e.get("cat", "?"), []).append(
            (t0 / 1e3, max(e["dur"], 0.001) / 1e3))
        stack.append((pid, t1))
    return rows
