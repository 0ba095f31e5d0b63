"""coconet.tracing and coconet.trace in one process: spans cost a shared null context when nothing
records; a recorder keeps nested spans (and what raised), bounds its events and writes a file
that validates; torch.profiler's own trace holds coconet's ranges with no recorder; the merge puts
ranks of one clock side by side unshifted and shifts a rank of another machine by the clock marks
it shares (or, with none, by the wall clock); bad files are refused with a clear error; the
summary and the plot read the merged file; COCONET_TRACE opens and writes a recorder."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet import runtime, trace, tracing
from coconet.errors import ConfigError
from coconet.options import CompileOptions
from coconet.runtime import CommOptions
from coconet.tracing import Category


@pytest.fixture
def recorder(tmp_path):
    r = tracing.start(tmp_path)
    yield r
    if tracing.recording() is r:
        tracing.stop()


def test_nothing_records_when_nothing_listens():
    assert tracing.recording() is None and not tracing.active()
    a = tracing.span("x", Category.STEP)
    b = tracing.span("y", Category.KERNEL, "detail", {"k": 1})
    assert a is b  # one shared null context: nothing is built per call


def test_a_recorder_keeps_nested_spans_and_what_raised(recorder, tmp_path):
    with tracing.span("outer", Category.STEP):
        with tracing.span("kernel", Category.KERNEL, "fused_1", {"bytes": 8}):
            pass
        with pytest.raises(ValueError), tracing.span("commit", Category.COMMIT):
            raise ValueError("bad")
    names = [(e[0], e[1]) for e in recorder.events]
    assert names == [("kernel: fused_1", Category.KERNEL), ("commit", Category.COMMIT),
                     ("outer", Category.STEP)]  # fmt: skip
    assert recorder.events[1][5] == {"raised": "ValueError"}
    outer, inner = recorder.events[2], recorder.events[0]
    assert outer[2] <= inner[2] and inner[3] <= outer[3]  # nested in time
    path = tracing.stop()
    assert path == tmp_path / "rank0.trace.json"
    doc = trace.load(path)  # validates
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["cat"] for e in x] == ["kernel", "commit", "step"]
    assert x[0]["args"] == {"bytes": 8}


def test_one_recorder_at_a_time_and_a_bounded_one(tmp_path):
    r = tracing.start(tmp_path, limit=3)
    try:
        with pytest.raises(RuntimeError, match="already"):
            tracing.start(tmp_path)
        for i in range(5):
            with tracing.span(f"s{i}", Category.BODY):
                pass
        assert len(r.events) == 3 and r.dropped == 2
    finally:
        tracing.stop()
    assert tracing.stop() is None  # nothing open


def test_torch_profiler_shows_coconet_ranges_without_a_recorder(tmp_path):
    with torch.profiler.profile() as prof:
        with tracing.span("adam", Category.STEP):
            with tracing.span("all_reduce", Category.COLLECTIVE, "g_sum"):
                torch.ones(4).sum()
    prof.export_chrome_trace(str(tmp_path / "p.json"))
    names = {e.get("name") for e in json.loads((tmp_path / "p.json").read_text())["traceEvents"]}
    assert {"coconet: adam", "coconet: all_reduce: g_sum"} <= names
    assert not tracing.active()


def test_a_world_of_one_optimizer_step_in_torch_profiler_and_in_a_recording(tmp_path):
    from coconet.optim import Adam

    comm = runtime.init(options=CommOptions(keep_buffers_mapped=False))
    try:
        model = torch.nn.Linear(8, 8)
        opt = Adam(model.parameters(), lr=1e-3, comm=comm,
                   options=CompileOptions(fused_kernels=False))
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # (the first step's agreement and builds, outside the traces)
        with torch.profiler.profile() as prof, trace.record(tmp_path, comm=comm):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        prof.export_chrome_trace(str(tmp_path / "p.json"))
    finally:
        runtime.shutdown(comm)
    names = {e.get("name") for e in json.loads((tmp_path / "p.json").read_text())["traceEvents"]}
    assert {"coconet: Adam: step", "coconet: agreement", "coconet: body"} <= names
    doc = trace.load(tmp_path / "rank0.trace.json")
    cats = {e["cat"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"optimizer", "step", "agreement", "body", "commit"} <= cats


def _rank_file(tmp_path, rank, clock, perf0, wall0, marks, spans):
    events = [{"name": n, "cat": "step", "ph": "X", "ts": t / 1e3, "dur": 5.0, "pid": rank,
               "tid": 1} for n, t in spans]  # fmt: skip
    doc = {"traceEvents": events, "otherData": {"coconet": {
        "rank": rank, "world": 2, "host": f"h{rank}", "clock": clock, "pid": 1,
        "perf0_ns": perf0, "wall0_ns": wall0, "marks": marks, "dropped": 0}}}  # fmt: skip
    (tmp_path / f"rank{rank}.trace.json").write_text(json.dumps(doc))


@settings(max_examples=30, deadline=None)
@given(offset=st.integers(-10**12, 10**12), skew=st.integers(-2000, 2000))
def test_the_merge_shifts_another_machine_onto_rank_0s_clock(tmp_path_factory, offset, skew):
    """Rank 1's clock reads ``offset`` ns more than rank 0's; both marked one instant (rank 1
    ``skew`` ns late: an aligned start's release skew). Its events land where rank 0's clock
    puts them, within the skew."""
    d = tmp_path_factory.mktemp("m")
    _rank_file(d, 0, "boot A", 0, 0, [["record: entry", 1_000_000]], [("a", 1_000_000)])
    _rank_file(d, 1, "boot B", 0, 0, [["record: entry", 1_000_000 + offset + skew]],
               [("b", 1_000_000 + offset + 40_000)])  # fmt: skip
    merged = trace.merge(d)
    info = merged["otherData"]["coconet"]
    assert info["aligned"] == {"0": "one clock", "1": "clock marks"}
    ts = {e["name"]: e["ts"] for e in merged["traceEvents"]}
    assert ts["a"] == 0
    assert abs(ts["b"] - (40.0 - skew / 1e3)) < 1e-3


def test_the_merge_keeps_one_clock_unshifted_and_falls_back_to_the_wall_clock(tmp_path):
    one, other = tmp_path / "one", tmp_path / "other"
    one.mkdir(), other.mkdir()
    # one boot: no shift, whatever the marks or the wall clocks say
    _rank_file(one, 0, "boot A", 0, 0, [["m", 10]], [("a", 1_000)])
    _rank_file(one, 1, "boot A", 0, 99_000, [["m", 50_000]], [("b", 3_000)])
    ts = {e["name"]: e["ts"] for e in trace.merge(one)["traceEvents"]}
    assert ts == {"a": 0.0, "b": 2.0}
    # another boot, no common mark: the wall clocks (rank 1's perf clock 7 ms behind)
    _rank_file(other, 0, "boot A", 1_000, 5_000_000, [], [("a", 1_000)])
    _rank_file(other, 1, "boot B", 1_000, 12_000_000, [["x", 1]], [("b", 1_000)])
    merged = trace.merge(other, other / "merged.json")
    assert merged["otherData"]["coconet"]["aligned"]["1"] == "wall clock"
    ts = {e["name"]: e["ts"] for e in merged["traceEvents"]}
    assert ts == {"a": 0.0, "b": 7000.0}
    assert json.loads((other / "merged.json").read_text())["traceEvents"]


def test_bad_files_are_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match="no rank traces"):
        trace.merge(tmp_path)
    (tmp_path / "rank0.trace.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the trace"):
        trace.merge(tmp_path)
    bad = {"traceEvents": [{"name": "x", "ph": "X", "ts": 1, "dur": -1, "pid": 0, "tid": 0},
                           {"ph": "Q"}]}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        trace.check(bad)
    assert [d.split(":")[0] for d in info.value.details] == ["event 0", "event 1", "event 1"]
    (tmp_path / "rank0.trace.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ConfigError, match="not written by a coconet recorder"):
        trace.merge(tmp_path)


def test_summary_and_plot_read_a_merged_trace(tmp_path):
    _rank_file(tmp_path, 0, "A", 0, 0, [], [("s", 0), ("t", 10_000)])
    _rank_file(tmp_path, 1, "A", 0, 0, [], [("s", 2_000)])
    merged = trace.merge(tmp_path)
    text = trace.summary(merged)
    assert "step" in text and text.count("\n") >= 3
    pytest.importorskip("matplotlib")
    png = trace.plot(merged, tmp_path / "t.png", title="two ranks")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="no spans"):
        trace.plot({"traceEvents": []}, tmp_path / "empty.png")


def test_coconet_trace_opens_a_recorder_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_TRACE", str(tmp_path / "env"))
    r = tracing.start_from_environment()
    try:
        assert r is not None and tracing.recording() is r
        assert tracing.start_from_environment() is None  # one already open
        with tracing.span("s", Category.STEP):
            pass
    finally:
        path = tracing.stop_from_environment()
    assert path == tmp_path / "env" / "rank0.trace.json" and trace.load(path)
    assert tracing.stop_from_environment() is None


def test_the_overlap_report_splits_each_collectives_flight_into_exposed_and_hidden():
    def x(name, cat, ts, dur, pid=0):
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": 1}

    doc = {"traceEvents": [
        # gloo-like: started (10 us), the rank computes, then waits 30 us: in flight 100 us
        x("all_gather: p_new", "collective", 0.0, 10.0),
        x("kernel: fused_1", "kernel", 10.0, 60.0),
        x("wait all_gather: p_new", "wait", 70.0, 30.0),
        # shared-memory-like: done inside its start, twice: all exposed
        x("all_reduce: g", "collective", 200.0, 20.0),
        x("all_reduce: g", "collective", 300.0, 20.0),
        # another rank
        x("all_reduce: g", "collective", 0.0, 5.0, pid=1),
    ]}  # fmt: skip
    rows = {(r["rank"], r["collective"]): r for r in trace.overlap(doc)}
    gather = rows[(0, "all_gather: p_new")]
    assert (gather["calls"], gather["in_flight_ms"], gather["exposed_ms"]) == (1, 0.1, 0.04)
    assert gather["hidden_ms"] == pytest.approx(0.06)
    reduce0 = rows[(0, "all_reduce: g")]
    assert (reduce0["calls"], reduce0["hidden_ms"]) == (2, 0.0)
    assert reduce0["exposed_ms"] == pytest.approx(0.04)
    assert rows[(1, "all_reduce: g")]["calls"] == 1
    text = trace.format_overlap(trace.overlap(doc))
    assert "60%" in text and text.count("\n") == 3
    assert trace.format_overlap([]) == "no collectives recorded"


def test_the_overlap_report_per_step_sums_to_the_whole():
    """Per step: each collective in the outermost span (the step) holding its start; the rows
    of every step add up to the summed report; a bare collective is a step of its own."""
    def x(name, cat, ts, dur):
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": 1}

    events = [x("step: adam", "step", 0.0, 100.0), x("step: adam", "step", 200.0, 100.0)]
    for base in (0.0, 200.0):
        events += [x("all_reduce: g", "collective", base + 10, 20.0),
                   x("kernel: k", "kernel", base + 30, 30.0),
                   x("wait all_reduce: g", "wait", base + 60, 10.0)]  # fmt: skip
    events.append(x("all_reduce: loose", "collective", 400.0, 5.0))
    doc = {"traceEvents": events}
    per = trace.overlap(doc, per_step=True)
    assert [(r["step"], r["step_name"], r["collective"]) for r in per] == [
        (0, "step: adam", "all_reduce: g"), (1, "step: adam", "all_reduce: g"),
        (2, "all_reduce: loose", "all_reduce: loose")]
    whole = {r["collective"]: r for r in trace.overlap(doc)}
    for key in ("in_flight_ms", "exposed_ms", "hidden_ms"):
        assert sum(r[key] for r in per if r["collective"] == "all_reduce: g") == \
            pytest.approx(whole["all_reduce: g"][key])
    assert per[1]["hidden_ms"] == pytest.approx(0.03)
    assert "#1 step: adam" in trace.format_overlap(per)


def test_the_merge_names_the_rank_each_wait_waited_on(tmp_path):
    """Three ranks make call #7: rank 2 starts it 3 ms after the others. Rank 0's wait (gloo:
    a start, then a wait) and rank 1's start (shared memory: done inside it) began before rank
    2 started: each waited on rank 2 for as long as it was blocked before rank 2 came. Call #8:
    every rank had started before any waited: nobody waited on anyone."""
    def x(pid, name, cat, ts, dur, **args):
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": 1,
                "args": args}  # fmt: skip

    def call(n):
        return {"comm": "c", "call": n, "group": [0, 1, 2]}

    per_rank = {
        0: [x(0, "all_reduce: g", "collective", 1_000, 100, **call(7)),
            x(0, "wait all_reduce: g", "wait", 2_000, 2_500),
            x(0, "all_reduce: h", "collective", 10_000, 100, **call(8)),
            x(0, "wait all_reduce: h", "wait", 12_000, 500)],
        1: [x(1, "all_reduce: g", "collective", 1_500, 3_000, **call(7)),
            x(1, "all_reduce: h", "collective", 10_500, 300, **call(8))],
        2: [x(2, "all_reduce: g", "collective", 4_000, 500, **call(7)),
            x(2, "all_reduce: h", "collective", 11_000, 100, **call(8))],
    }  # fmt: skip
    for r, events in per_rank.items():
        doc = {"traceEvents": events, "otherData": {"coconet": {
            "rank": r, "world": 3, "host": "h", "clock": "A", "pid": 1, "perf0_ns": 0,
            "wall0_ns": 0, "marks": [], "dropped": 0}}}  # fmt: skip
        (tmp_path / f"rank{r}.trace.json").write_text(json.dumps(doc))
    merged = trace.merge(tmp_path)
    marked = {(e["pid"], e["name"]): e["args"] for e in merged["traceEvents"]
              if "waited_on" in (e.get("args") or {})}  # fmt: skip
    assert marked == {
        (0, "wait all_reduce: g"): {"waited_on": 2, "peer_late_ms": 2.0},
        (1, "all_reduce: g"): {"comm": "c", "call": 7, "group": [0, 1, 2], "waited_on": 2,
                               "peer_late_ms": 2.5},
    }
    assert trace.late_ranks(merged) == [{"rank": 2, "waits": 2, "peers_waited_ms": 4.5}]
    text = trace.summary(merged)
    assert "2.500 ms of it on rank 2" in text and "waited on: rank 2, 2 time(s)" in text


@settings(max_examples=60, deadline=None)
@given(starts=st.lists(st.integers(0, 5_000), min_size=2, max_size=5),
       lasting=st.lists(st.integers(1, 8_000), min_size=5, max_size=5),
       gloo=st.booleans())  # fmt: skip
def test_each_blocked_span_names_the_last_rank_to_start(starts, lasting, gloo):
    """Ranks start one call at random instants and block for random lengths (in a wait after
    the start, or inside the start): a rank whose blocking span holds the last rank's start is
    marked with that rank and the time until it; no other span is marked; the merged trace's
    own tallies (``late_ranks``) add the marks up."""
    events = []
    for r, t0 in enumerate(starts):
        start = {"name": "all_reduce: g", "cat": "collective", "ph": "X", "ts": float(t0),
                 "dur": 1.0 if gloo else float(lasting[r]), "pid": r, "tid": 1,
                 "args": {"comm": "c", "call": 3, "group": list(range(len(starts)))}}
        events.append(start)
        if gloo:
            events.append({"name": "wait all_reduce: g", "cat": "wait", "ph": "X",
                           "ts": t0 + 1.0, "dur": float(lasting[r]), "pid": r, "tid": 1})
    trace._mark_late(events)
    last = max(range(len(starts)), key=lambda r: starts[r])
    expected = {}
    for r, t0 in enumerate(starts):
        began = t0 + (1.0 if gloo else 0.0)
        if r != last and 0 < starts[last] - began < lasting[r]:
            expected[r] = round((starts[last] - began) / 1e3, 3)
    marked = {e["pid"]: e["args"]["peer_late_ms"] for e in events
              if "waited_on" in (e.get("args") or {})}  # fmt: skip
    assert marked == expected
    assert all(e["args"]["waited_on"] == last for e in events
               if "waited_on" in (e.get("args") or {}))  # fmt: skip
    rows = trace.late_ranks({"traceEvents": events})
    assert rows == ([{"rank": last, "waits": len(expected),
                      "peers_waited_ms": pytest.approx(sum(expected.values()))}]
                    if expected else [])  # fmt: skip


def test_the_cost_models_prediction_stands_beside_each_collective_it_names(tmp_path):
    tune = {"winner": "w", "candidates": [
        {"schedule": "other", "predicted_parts": [["g (all_reduce)", "communication", 9.0]]},
        {"schedule": "w", "predicted_parts": [
            ["g_rs (reduce_scatter)", "communication", 0.5],
            ["g_rs copied into symmetric memory", "communication", 0.25],
            ["fused_collective_1: gather p_new", "communication", 2.0],
            ["fused_collective_1: synchronisation", "communication", 0.1],
            ["x (all_reduce, read in place)", "communication", 0.125],
            ["m_new (mul)", "compute", 7.0],
        ]},
    ]}  # fmt: skip
    (tmp_path / "tune.json").write_text(json.dumps(tune))
    predicted = trace.predictions(tmp_path / "tune.json")
    assert predicted == {"g_rs": 0.75, "p_new": 2.0, "x": 0.125}
    rows = [{"rank": 0, "collective": "reduce_scatter: g_rs", "calls": 2, "in_flight_ms": 2.0,
             "exposed_ms": 2.0, "hidden_ms": 0.0},
            {"rank": 0, "collective": "all_reduce: other", "calls": 1, "in_flight_ms": 1.0,
             "exposed_ms": 1.0, "hidden_ms": 0.0}]  # fmt: skip
    lines = trace.format_overlap(rows, predicted).splitlines()
    assert lines[0].endswith("predicted/call")
    assert lines[1].split()[-4:] == ["1.000", "ms", "0.750", "ms"]
    assert lines[2].split()[-1] == "-"
    with pytest.raises(ConfigError, match="winner"):
        trace.predictions({"candidates": []})


def test_the_flight_recorder_keeps_the_last_calls_and_says_where_it_is(tmp_path, monkeypatch):
    from coconet.errors import RuntimeFault
    from coconet.runtime.faults import FaultGuard
    from coconet.runtime.flight import FlightRecorder

    monkeypatch.setenv("COCONET_FLIGHT_DIR", str(tmp_path))
    guard = FaultGuard(0, 2, "gloo", 7.0, lambda axis: (0, 1))
    recorder = guard.recorder = FlightRecorder("probe", 0, (0, 1), 4)
    assert recorder.position() == "no call yet"
    for k in range(6):
        guard("all_reduce", f"x{k}", None, int)

    def fails():
        raise RuntimeFault("boom", op="shared memory")

    with pytest.raises(RuntimeFault) as info:
        guard("reduce_scatter", "y", "dp", fails)
    kept = recorder.entries()
    assert [(e["seq"], e["label"], e["state"]) for e in kept] == [
        (4, "x3", "completed"), (5, "x4", "completed"), (6, "x5", "completed"),
        (7, "y", "failed")]  # fmt: skip
    assert [e["end_ns"] is None for e in kept] == [True, True, True, False]  # failed: its end
    assert kept[-1]["end_ns"] >= kept[-1]["start_ns"]
    assert recorder.position() == "#7 reduce_scatter: y (failed)"
    # the fault says which call it was (no peers to ask: no store), and where the dump went
    details = "\n".join(info.value.details)
    assert "call #7 of this communicator (reduce_scatter: y)" in details
    assert f"flight recorder dump: {tmp_path / 'rank0.flight.json'}" in details
    dump = json.loads((tmp_path / "rank0.flight.json").read_text())
    (mine,) = [c for c in dump["communicators"] if c["name"] == "probe"]
    assert [e["seq"] for e in mine["entries"]] == [4, 5, 6, 7]


def test_a_call_that_is_refused_before_it_starts_is_not_recorded():
    from coconet.errors import RuntimeFault
    from coconet.runtime.faults import FaultGuard
    from coconet.runtime.flight import FlightRecorder

    guard = FaultGuard(0, 2, "gloo", 7.0, lambda axis: (0, 1))
    guard.recorder = FlightRecorder("probe", 0, (0, 1), 8)
    guard.broken = "an earlier failure"
    with pytest.raises(RuntimeFault, match="unusable"):
        guard("all_reduce", "x", None, int)
    assert guard.recorder.seq == 0
