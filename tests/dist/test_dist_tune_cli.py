"""``coconet tune`` end to end: local ranks, the table, the JSON format, the cache."""

import json
import pathlib
import statistics
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tune(tmp_path, *extra):
    cmd = [sys.executable, "-m", "coconet.cli", "tune", f"{ROOT}/examples/sgd.py:program",
           "--nproc", "2", "--size", "N=4099", "--eager", "--top", "2", "--reps", "3",
           "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "t.json"), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((tmp_path / "t.json").read_text())


@pytest.mark.timeout(300)
def test_coconet_tune_prints_the_table_and_writes_the_documented_json(tmp_path):
    text, doc = _tune(tmp_path)
    assert {"program", "world_size", "candidates", "winner"} <= set(doc)
    assert doc["world_size"] == 2 and doc["program"] == "sgd"
    for c in doc["candidates"]:
        assert isinstance(c["schedule"], str) and isinstance(c["predicted_ms"], float)
        assert c["measured_ms"] is None or c["measured_ms"] > 0
    ran = [c for c in doc["candidates"] if c["measured_ms"] is not None]
    # the 2 best predicted and the unscheduled program (which may be one of them)
    assert len(ran) >= 2
    fastest = min(ran, key=lambda c: c["measured_ms"])
    again = doc["rematch"]
    if again is None:  # the winner is the fastest measured
        assert doc["winner"] == fastest["schedule"]
    else:  # the two best were close: the faster in their deciding round won
        first, second = doc["candidates"][again["first"]], doc["candidates"][again["second"]]
        assert first["schedule"] == fastest["schedule"]
        overturned = statistics.median(again["second_ms"]) < statistics.median(again["first_ms"])
        assert doc["winner"] == (second if overturned else first)["schedule"]
        assert "deciding round" in text
    assert any(c["schedule"].startswith("unscheduled [shared memory]") for c in ran)
    assert "winner:" in text and "why the others were not chosen:" in text
    # a second tune of the same case is read from the cache, with the same winner
    again, doc2 = _tune(tmp_path)
    assert "(from the cache, read in " in again and doc2["winner"] == doc["winner"]
