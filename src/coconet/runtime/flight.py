"""The flight recorder: the last calls of each communicator on this rank, for when a job stops.

Every call a communicator's fault guard runs (each collective's start and wait, each
point-to-point message, each control round: ``FaultGuard``) is one entry of a bounded ring:
its sequence number on this communicator, op, the value's label, axis, its start (and, for a
failed call, its end: ``time.perf_counter_ns``) and state (started, completed, failed). Always
on: an entry is a few stores into preallocated arrays and one clock read (what that costs a
small step: ``benchmarks/observability.py``); ``CommOptions(flight_recorder=0)`` turns it off.

When a call fails (a peer died, stalled past the timeout, or aborted), the guard asks the
others where they are (``ControlChannel.positions``: each rank that fails posts its position in
the job's store and reads its peers'), puts the verdict in the error (which ranks had not reached
which call, and the user's line that made it), and **dumps** every ring of this process to
``<directory>/rank<r>.flight.json`` (``directory()``: ``$COCONET_FLIGHT_DIR``, else
``$COCONET_TRACE``, else a folder per job under the temporary directory). A rank that stalled
dumps when it next calls coconet and learns of the failure; a killed one leaves none.
``verdict`` reads a folder of dumps and says who stopped where: ``coconet trace why DIR``.

Sequence numbers agree across the ranks of a communicator because its ranks make the same calls
in the same order (what every collective already requires); where they do not, the entries'
op and label show it.
"""

from __future__ import annotations

import array
import enum
import json
import os
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from coconet import tracing

__all__ = ["CallState", "FlightRecorder", "directory", "dump", "verdict"]


class CallState(enum.Enum):
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"


# A slot's state as one byte (``FlightRecorder.states``): what the guard writes per call.
STARTED, COMPLETED, FAILED = 0, 1, 2
_STATES = {STARTED: CallState.STARTED, COMPLETED: CallState.COMPLETED, FAILED: CallState.FAILED}

# Every live recorder of this process, so that one failure dumps them all (a sub-communicator's
# calls are part of what the job did): like torch's flight recorder, a property of the process.
_live: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


class FlightRecorder:
    """The last ``capacity`` guarded calls of one communicator on this rank.

    A call's slot is its sequence number modulo ``capacity``; each field is an array of its
    own (``seqs``, ``starts``, ``ends`` as 64-bit integers, ``states`` as bytes; ``ops``,
    ``labels``, ``axes`` hold the caller's own strings), written in place by the guard
    (``FaultGuard._run``): a call allocates nothing. A completed call keeps its start time
    only: reading the clock costs ~0.3 us inside a step on this VM (47 ns in a tight loop), and
    a second read per call measured ~2.5% of an 8 KiB step (``benchmarks/observability.py``);
    a failed call's end time is kept (``end``). Durations are what a trace records
    (``coconet.tracing``)."""

    def __init__(self, name: str, rank: int, members: tuple[int, ...], capacity: int) -> None:
        self.name = name  # the communicator (its abort key: the same on each of its ranks)
        self.rank, self.members = rank, members  # this rank in it, and its ranks in the job
        self.capacity = capacity
        self.seq = 0  # calls begun
        self.seqs = array.array("q", bytes(8 * capacity))
        self.starts = array.array("q", bytes(8 * capacity))
        self.ends = array.array("q", bytes(8 * capacity))
        self.states = bytearray(capacity)
        self.ops: list[str | None] = [None] * capacity
        self.labels: list[str | None] = [None] * capacity
        self.axes: list[str | None] = [None] * capacity
        self.dumped: Path | None = None
        _live.add(self)

    def end(self, slot: int, state: int) -> None:
        """Call ``slot`` ended in ``state`` at this instant (a failed call: the guard keeps a
        completed call's start only)."""
        self.ends[slot] = time.perf_counter_ns()
        self.states[slot] = state

    def call(self, slot: int) -> tuple[int, str, str]:
        """The call in ``slot``: (sequence number, op, label)."""
        return self.seqs[slot], self.ops[slot], self.labels[slot]

    def entries(self) -> list[dict[str, Any]]:
        """The kept entries, oldest first."""
        kept = sorted((self.seqs[i], i) for i in range(self.capacity) if self.ops[i] is not None)
        out = []
        for seq, i in kept:
            state = _STATES[self.states[i]]
            out.append({"seq": seq, "op": self.ops[i], "label": self.labels[i],
                        "axis": self.axes[i], "start_ns": self.starts[i],
                        "end_ns": self.ends[i] if state is CallState.FAILED else None,
                        "state": state.value})  # fmt: skip
        return out

    def position(self) -> str:
        """This rank's last call in a line: what it tells its peers when a call fails."""
        if not self.seq:
            return "no call yet"
        slot = self.seq % self.capacity
        seq, op, label = self.call(slot)
        return f"#{seq} {op}: {label} ({_STATES[self.states[slot]].value})"


def directory() -> Path:
    """Where dumps go: ``$COCONET_FLIGHT_DIR``, else ``$COCONET_TRACE``, else a folder of this
    job under the temporary directory (its ranks share the rendezvous port, so the folder)."""
    chosen = os.environ.get("COCONET_FLIGHT_DIR") or os.environ.get("COCONET_TRACE")
    if chosen:
        return Path(chosen)
    job = os.environ.get("MASTER_PORT", "local")
    return Path(tempfile.gettempdir()) / f"coconet-flight-{job}"


def dump(rank: int, world: int, fault: str, where: Path | None = None) -> Path:
    """Write every live recorder of this process (the failing call's first) as
    ``rank<r>.flight.json``; returns its path."""
    where = where or directory()
    where.mkdir(parents=True, exist_ok=True)
    recorders = sorted(_live, key=lambda r: r.name)
    document = {
        "rank": rank,
        "world": world,
        "pid": os.getpid(),
        "time": time.time(),
        "perf_ns": time.perf_counter_ns(),
        "clock": tracing.clock_domain(),
        "fault": fault,
        "communicators": [
            {"name": r.name, "rank": r.rank, "members": list(r.members), "calls": r.seq,
             "entries": r.entries()} for r in recorders
        ],
    }  # fmt: skip
    path = where / f"rank{rank}.flight.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)
    for r in recorders:
        r.dumped = path
    return path


def verdict(folder: str | os.PathLike) -> str:
    """Who stopped where, from the dumps in ``folder``: per communicator, each rank's last call
    and its state, and the ranks behind the others (their last call completed, a lower sequence
    number than where the others wait) or without a dump (killed, or never told)."""
    from coconet.errors import ConfigError

    folder = Path(folder)
    dumps = {}
    for p in sorted(folder.glob("rank*.flight.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {p}: {exc}", op="coconet trace why",
                              hint="a rank<r>.flight.json a failing rank wrote") from None
        dumps[int(d["rank"])] = d
    if not dumps:
        raise ConfigError(f"no flight recorder dumps in {folder}", op="coconet trace why",
                          details=["looked for rank<r>.flight.json"],
                          hint="a failing rank names the folder in its error (flight "
                          "recorder: ...); $COCONET_FLIGHT_DIR sets it")  # fmt: skip
    world = max(int(d["world"]) for d in dumps.values())
    lines = [f"{len(dumps)} of {world} ranks left a dump in {folder}"]
    missing = [r for r in range(world) if r not in dumps]
    if missing:
        lines.append(f"no dump from rank(s) {missing}: killed, or never learned of the failure")
    comms: dict[str, dict[int, dict]] = {}
    members: dict[str, list[int]] = {}
    for rank, d in dumps.items():
        for c in d["communicators"]:
            comms.setdefault(c["name"], {})[rank] = c
            members[c["name"]] = c["members"]
    for name in sorted(comms):
        by_rank = comms[name]
        lines.append(f"\ncommunicator {name} (ranks {members[name]}):")
        last: dict[int, dict | None] = {}
        for rank in members[name]:
            c = by_rank.get(rank)
            if c is None:
                lines.append(f"  rank {rank}: no dump")
                continue
            e = c["entries"][-1] if c["entries"] else None
            last[rank] = e
            where = "no call" if e is None else (
                f"#{e['seq']} {e['op']}: {e['label']} ({e['state']})")
            lines.append(f"  rank {rank}: {c['calls']} calls; last {where}")
        waiting = {r: e for r, e in last.items() if e is not None and e["state"] != "completed"}
        if not waiting:
            continue
        front = max(e["seq"] for e in waiting.values())
        stuck = next(e for e in waiting.values() if e["seq"] == front)
        behind = sorted(r for r, e in last.items() if e is None or e["seq"] < front)
        absent = sorted(r for r in members[name] if r not in by_rank)
        who = sorted(waiting)
        call = f"call #{front} ({stuck['op']}: {stuck['label']})"
        if behind:
            lines.append(f"  verdict: rank(s) {behind} had not reached {call}, where rank(s) "
                         f"{who} stopped")  # fmt: skip
        if absent:
            lines.append(f"  verdict: rank(s) {absent} left no dump while rank(s) {who} "
                         f"stopped in {call}: look at their output (killed or stalled)")
        if not behind and not absent:
            lines.append(f"  verdict: every rank reached {call}; it failed on rank(s) {who}")
            late = _late(front, by_rank, dumps)
            if late:
                lines.append(f"  {late}")
    return "\n".join(lines)


def _late(seq: int, by_rank: dict[int, dict], dumps: dict[int, dict]) -> str | None:
    """Which rank came last to call ``seq`` and how late, where the ranks share a clock."""
    starts = {}
    for rank, c in by_rank.items():
        entry = next((e for e in c["entries"] if e["seq"] == seq), None)
        if entry is not None:
            starts[rank] = (dumps[rank].get("clock"), entry["start_ns"])
    if len(starts) < 2 or len({clock for clock, _ in starts.values()}) != 1:
        return None
    first = min(starts, key=lambda r: starts[r][1])
    last = max(starts, key=lambda r: starts[r][1])
    gap = (starts[last][1] - starts[first][1]) / 1e9
    return f"rank {last} reached it last, {gap:.3f} s after rank {first}"
