"""coconet.trace on 2 ranks: a data-parallel optimizer step, a tensor-parallel layer and a pipeline
step, each recorded on every rank into trace-event files that validate and hold the phases
expected of that workload, merged onto one clock (the ranks share this machine's) with a track per
rank, summarized (with the rank a late collective was waited on) and drawn."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import trace_workers

from coconet import trace
from coconet.cli import main
from coconet.runtime import CommOptions, spawn


def _spans(document: dict, rank: int) -> list[dict]:
    return [e for e in document["traceEvents"] if e.get("ph") == "X" and e["pid"] == rank]


def _names(spans: list[dict], cat: str) -> set[str]:
    return {e["name"] for e in spans if e.get("cat") == cat}


@pytest.mark.timeout(240)
def test_each_workload_is_traced_on_every_rank_and_merges_onto_one_timeline(tmp_path, capsys):
    folders = spawn(trace_workers.workloads, 2, str(tmp_path), options=CommOptions(timeout=60),
                    timeout=200)[0]  # fmt: skip
    for name, folder in folders.items():
        for rank in (0, 1):
            one = trace.load(Path(folder) / f"rank{rank}.trace.json")  # validates the format
            info = one["otherData"]["coconet"]
            assert (info["rank"], info["world"], info["dropped"]) == (rank, 2, 0), name
            assert [m[0] for m in info["marks"]] == ["record: entry", "record: exit"], name
        merged = trace.merge(folder, Path(folder) / "merged.json")
        assert merged["otherData"]["coconet"]["aligned"] == {"0": "one clock", "1": "one clock"}
        json.loads((Path(folder) / "merged.json").read_text())
        for rank in (0, 1):
            spans = _spans(merged, rank)
            assert spans, (name, rank)
            assert min(e["ts"] for e in _spans(merged, 0) + _spans(merged, 1)) == 0
            if name == "dp":
                assert _names(spans, "optimizer") == {"Adam: step"}
                for cat in ("step", "agreement", "body", "commit", "collective"):
                    assert _names(spans, cat), (rank, cat, sorted(e["name"] for e in spans))
                assert any(e.get("args", {}).get("bytes", 0) > 0
                           for e in spans if e["cat"] == "collective")  # fmt: skip
            elif name == "tp":
                layers = _names(spans, "layer")
                assert {"ColumnParallelLinear: forward", "RowParallelLinear: forward"} <= layers
                assert {"ColumnParallelLinear: backward", "RowParallelLinear: backward"} <= layers
                assert _names(spans, "collective"), sorted(e["name"] for e in spans)
            elif name == "pipeline":
                pipeline = _names(spans, "pipeline")
                assert any("forward" in n for n in pipeline), pipeline
                assert any("backward" in n for n in pipeline), pipeline
                assert any("send_activation" in n for n in pipeline) != any(
                    "recv_activation" in n for n in pipeline), pipeline  # one end of the link
        # nesting holds on one clock: every collective lies inside its rank's step
        if name == "dp":
            for rank in (0, 1):
                spans = _spans(merged, rank)
                steps = [e for e in spans if e["cat"] == "optimizer"]
                for c in (e for e in spans if e["cat"] == "collective"):
                    assert any(s["ts"] <= c["ts"] and c["ts"] + c["dur"] <= s["ts"] + s["dur"]
                               + 1e-3 for s in steps), c  # fmt: skip
    # rank 1 joined the second all_reduce 80 ms late: rank 0's span that blocked for it says so
    # (its wait, or its start where shared memory completes the call inside it); the others
    # were joined within the ranks' own skew
    late = trace.merge(folders["late"])
    marked = {e["name"].removeprefix("wait "): e["args"] for e in _spans(late, 0)
              if "waited_on" in e.get("args", {})}  # fmt: skip
    assert marked["all_reduce: x1"]["waited_on"] == 1
    assert 40 < marked["all_reduce: x1"]["peer_late_ms"] < 1000, marked
    assert all(a["peer_late_ms"] < 20 for n, a in marked.items() if n != "all_reduce: x1")
    assert all(e["args"]["peer_late_ms"] < 20 for e in _spans(late, 1)
               if "waited_on" in e.get("args", {}))  # fmt: skip
    assert trace.late_ranks(late)[0]["rank"] == 1
    # every collective's flight splits into exposed + hidden
    rows = trace.overlap(trace.load(Path(folders["dp"]) / "merged.json"))
    assert {r["rank"] for r in rows} == {0, 1}
    for r in rows:
        assert r["calls"] > 0 and r["exposed_ms"] <= r["in_flight_ms"] + 1e-9, r
        assert r["hidden_ms"] == pytest.approx(r["in_flight_ms"] - r["exposed_ms"], abs=1e-6)
    # the command: the summary, the overlap report, the merged file and the PNG
    dp = folders["dp"]
    tune = {"winner": "w", "candidates": [{"schedule": "w", "predicted_parts": [
        ["fused_collective_1: gather p_new", "communication", 0.25]]}]}  # fmt: skip
    (tmp_path / "tune.json").write_text(json.dumps(tune))
    assert main(["trace", "merge", dp, "-o", str(tmp_path / "dp.json"), "--png",
                 str(tmp_path / "dp.png"), "--predicted", str(tmp_path / "tune.json")]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "ui.perfetto.dev" in out and "hidden share" in out
    gathers = [line for line in out.splitlines()
               if re.match(r" +\d +all_gather: p_new ", line)]  # the table's rows
    assert len(gathers) == 2 and all(line.endswith("0.250 ms") for line in gathers), out
    assert (tmp_path / "dp.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["trace", "merge", folders["late"], "--per-step"]) == 0
    out = capsys.readouterr().out
    assert "waited on: rank 1, " in out and "per step" in out
    assert re.search(r"#\d+ all_reduce: x1 +all_reduce: x1", out), out


_SUMS = '''
import coconet as cc


def program():
    N = cc.Dim("N")
    g = cc.Tensor("g", cc.float32, [N], cc.Local)
    return cc.Program("sums", [g], {"s": cc.all_reduce(g, name="g_sum")})
'''


@pytest.mark.timeout(240)
def test_coconet_show_draws_a_programs_timeline(tmp_path, capsys):
    """``coconet show --timeline``: the step runs on 2 local ranks at the given size, and its
    summary, per-step overlap report and PNG come out after the generated code."""
    (tmp_path / "sums.py").write_text(_SUMS)
    png = tmp_path / "sums.png"
    assert main(["show", f"{tmp_path / 'sums.py'}:program", "--world", "2", "--size",
                 "N=4096", "--steps", "2", "--timeline", str(png)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "def step(" in out or "all_reduce" in out
    rows = re.findall(r"^ +([01]) +#(\d) sums +all_reduce: s +\d ", out, re.M)
    assert sorted(rows) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], out
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="go with --timeline"):
        main(["show", f"{tmp_path / 'sums.py'}:program", "--size", "N=8"])
    with pytest.raises(SystemExit, match="--steps"):
        main(["show", f"{tmp_path / 'sums.py'}:program", "--size", "N=8", "--steps", "0",
              "--timeline", str(png)])  # fmt: skip
