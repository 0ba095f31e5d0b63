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

import bisect
import contextlib
import itertools
import json
import math
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
    "late_ranks",
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
    _mark_late(events)
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
    (inclusive: a collective inside a step counts in both); the longest waits, with the rank
    each waited on (a merged trace); and the ranks the others waited on most (``late_ranks``)."""
    check(trace)
    totals: dict[tuple[int, str], list[float]] = {}
    waits: list[tuple[float, int, str, tuple[int, float] | None]] = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "?")
        entry = totals.setdefault((e["pid"], cat), [0, 0.0])
        entry[0] += 1
        entry[1] += e["dur"] / 1e3
        a = e.get("args") or {}
        on = (a["waited_on"], a["peer_late_ms"]) if "waited_on" in a else None
        if cat == tracing.Category.WAIT.value or on is not None:
            waits.append((e["dur"] / 1e3, e["pid"], e["name"], on))
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
    for ms, r, name, on in sorted(waits, key=lambda w: -w[0])[:3]:
        lines.append(f"longest wait: rank {r}, {name}: {ms:.3f} ms" + (
            f", {on[1]:.3f} ms of it on rank {on[0]}, which had not started the call"
            if on else ""))
    for row in late_ranks(trace)[:3]:
        lines.append(f"waited on: rank {row['rank']}, {row['waits']} time(s), "
                     f"{row['peers_waited_ms']:.3f} ms of its peers' time (it started those "
                     f"calls last)")
    return "\n".join(lines)


def overlap(trace: dict[str, Any], per_step: bool = False) -> list[dict[str, Any]]:
    """Each collective's time in flight, exposed and hidden, per rank and label, summed over the
    trace (``per_step``: per step too): a collective is in flight from its start's beginning to
    its wait's end (or its start's end, where it completed inside the start: shared memory's);
    it is **exposed** while the rank is inside its start or its wait (nothing else of the
    rank's ran), **hidden** for the rest of its flight (the rank computed meanwhile). One dict
    per (rank, collective): ``rank``, ``collective``, ``calls``, ``in_flight_ms``,
    ``exposed_ms``, ``hidden_ms``; ``per_step`` adds ``step`` (the rank's n-th outermost span:
    a compiled step's call, an optimizer step, a layer call, a pipeline action, numbered from
    0, the same calls on every rank) and ``step_name``, and makes a row per step."""
    check(trace)
    events = trace["traceEvents"]
    steps = _outermost(events) if per_step else {}
    begins = {pid: [t0 for t0, _, _ in spans] for pid, spans in steps.items()}
    rows: dict[tuple, dict[str, Any]] = {}
    for start, wait in _pairs(events):
        pid = start["pid"]
        key: tuple = (pid, start["name"])
        extra: dict[str, Any] = {}
        if per_step:
            spans = steps.get(pid, [])
            i = bisect.bisect_right(begins.get(pid, []), start["ts"]) - 1
            inside = i >= 0 and start["ts"] < spans[i][1]
            extra = {"step": i if inside else None,
                     "step_name": spans[i][2] if inside else "(outside any step)"}
            key = (pid, -1 if extra["step"] is None else extra["step"], start["name"])
        end = start["ts"] + start["dur"] if wait is None else wait["ts"] + wait["dur"]
        flight = (end - start["ts"]) / 1e3
        exposed = (start["dur"] + (0.0 if wait is None else wait["dur"])) / 1e3
        row = rows.setdefault(key, {"rank": pid, **extra, "collective": start["name"],
                                    "calls": 0, "in_flight_ms": 0.0, "exposed_ms": 0.0,
                                    "hidden_ms": 0.0})  # fmt: skip
        row["calls"] += 1
        row["in_flight_ms"] += flight
        row["exposed_ms"] += exposed
        row["hidden_ms"] += max(flight - exposed, 0.0)
    return [rows[k] for k in sorted(rows)]


def _pairs(events: list[dict]) -> Iterator[tuple[dict, dict | None]]:
    """Each collective's start with its wait (None: it completed inside its start), per rank in
    time order: a rank waits for its started collectives of one label in the order it started
    them (the generated code's start/wait pairs)."""
    spans = sorted((e for e in events if e.get("ph") == "X"
                    and e.get("cat") in ("collective", "wait")),
                   key=lambda e: (e["pid"], e["ts"]))  # fmt: skip
    open_: dict[tuple[int, str], dict] = {}  # started, not yet waited for
    for e in spans:
        if e["cat"] == "collective":
            key = (e["pid"], e["name"])
            if key in open_:  # started again without a wait: the last one completed at start
                yield open_.pop(key), None
            open_[key] = e
        else:
            start = open_.pop((e["pid"], e["name"].removeprefix("wait ")), None)
            if start is not None:
                yield start, e
    yield from ((start, None) for start in open_.values())


def _outermost(events: list[dict]) -> dict[int, list[tuple[float, float, str]]]:
    """Per rank, its outermost spans on its main thread (the steps): (start, end, name). A
    control round on its own (a barrier, ``record``'s clock marks) is not a step."""
    main = _main_threads(events)
    out: dict[int, list[tuple[float, float, str]]] = {}
    end: dict[int, float] = {}
    for e in sorted((e for e in events if e.get("ph") == "X"
                     and e["tid"] == main.get(e["pid"], e["tid"])),
                    key=lambda e: (e["pid"], e["ts"], -e["dur"])):  # fmt: skip
        pid = e["pid"]
        if e["ts"] >= end.get(pid, -math.inf):
            end[pid] = e["ts"] + e["dur"]
            if e.get("cat") != "control":
                out.setdefault(pid, []).append((e["ts"], end[pid], e["name"]))
    return out


def _mark_late(events: list[dict]) -> None:
    """On whom each wait waited (in place): the ranks of one collective call or control round
    (the same communicator, call number and group: ``FaultGuard``'s span arguments) are lined
    up, and each rank's span that blocked for the call (its wait, or its start where the call
    completed inside it) inside which the last rank started it gets ``waited_on`` (that rank)
    and ``peer_late_ms`` (how long of this span went by before it started). A span that
    began after every rank had started waited for the transfer alone: it gets nothing."""
    calls: dict[tuple, dict[int, tuple[dict, dict | None]]] = {}
    rounds = ((e, None) for e in events if e.get("ph") == "X" and e.get("cat") == "control")
    for start, wait in itertools.chain(_pairs(events), rounds):
        a = start.get("args") or {}
        if "call" in a:
            key = (a.get("comm"), a["call"], tuple(a.get("group") or ()))
            calls.setdefault(key, {})[start["pid"]] = (start, wait)
    for by_rank in calls.values():
        if len(by_rank) < 2 or len({s["name"] for s, _ in by_rank.values()}) > 1:
            continue  # one rank's record, or ranks that made different calls: nothing to line up
        last, (latest, _) = max(by_rank.items(), key=lambda kv: kv[1][0]["ts"])
        for pid, (start, wait) in by_rank.items():
            blocked = wait if wait is not None else start
            late_us = latest["ts"] - blocked["ts"]
            if pid == last or not 0 < late_us < blocked["dur"]:
                continue  # (ended before the last rank started: the clocks' skew, no wait)
            blocked["args"] = {**(blocked.get("args") or {}), "waited_on": last,
                               "peer_late_ms": round(late_us / 1e3, 3)}  # fmt: skip


def late_ranks(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Who the others waited on (a merged trace: ``merge`` marks it): per rank, how many times
    a peer was blocked in a collective call this rank had not started yet (``waits``), and the
    peers' time blocked so (``peers_waited_ms``), most first."""
    check(trace)
    out: dict[int, dict[str, Any]] = {}
    for e in trace["traceEvents"]:
        a = e.get("args") or {}
        if e.get("ph") != "X" or "waited_on" not in a:
            continue
        row = out.setdefault(a["waited_on"], {"rank": a["waited_on"], "waits": 0,
                                               "peers_waited_ms": 0.0})  # fmt: skip
        row["waits"] += 1
        row["peers_waited_ms"] += a["peer_late_ms"]
    return sorted(out.values(), key=lambda r: -r["peers_waited_ms"])


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
    stepped = "step" in rows[0]
    steps = [_step_cell(r) for r in rows] if stepped else []
    swidth = max(map(len, steps), default=0)
    head = (f"{'rank':>4}  " + (f"{'step':<{swidth}}  " if stepped else "")
            + f"{'collective':<{width}}  {'calls':>5}  {'in flight':>10}  "
            f"{'exposed':>10}  {'hidden':>10}  hidden share")  # fmt: skip
    if predicted:
        head += "  in flight/call  predicted/call"
    lines = [head]
    for i, r in enumerate(rows):
        share = r["hidden_ms"] / r["in_flight_ms"] if r["in_flight_ms"] > 0 else 0.0
        line = (f"{r['rank']:>4}  " + (f"{steps[i]:<{swidth}}  " if stepped else "")
                + f"{r['collective']:<{width}}  {r['calls']:>5}  "
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


def _step_cell(row: dict[str, Any]) -> str:
    return (row["step_name"] if row["step"] is None
            else f"#{row['step']} {row['step_name']}"[:48])  # fmt: skip


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
    main = _main_threads(events)
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


def _main_threads(events: list[dict]) -> dict[int, int]:
    """Each rank's main thread (its tid), as its recorder named it."""
    return {e["pid"]: e["tid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e.get("args", {}).get("name") == "main"}  # fmt: skip
