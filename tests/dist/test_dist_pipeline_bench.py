"""benchmarks/pipeline_parallel.py as a user runs it, tiny: every contender (coconet.pipeline's
1F1B and GPipe with the stage messages over shared memory and forced to gloo,
torch.distributed.pipelining's, one process) passes its check against one process and is timed,
the message probe times one message each way on both transports, and the JSON carries issue 21's
targets computed from the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline_parallel.py"


@pytest.mark.timeout(120)
def test_the_pipeline_benchmark_runs_and_checks_every_contender(tmp_path):
    out = tmp_path / "pp.json"
    argv = ["--steps", "2", "--warmup", "0", "--d-model", "32", "--layers", "2", "--heads", "2",
            "--seq", "8", "--batch", "8", "--timeout", "100"]  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--json", str(out)],
                          capture_output=True, text=True, timeout=110)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["failed"] == {}
    rows = doc["summary"]["rows"]
    assert set(rows) == {"one_process", "coconet_1f1b", "coconet_gpipe", "coconet_1f1b_gloo",
                         "coconet_gpipe_gloo", "torch_1f1b", "torch_gpipe"}  # fmt: skip
    for name in ("coconet_1f1b", "coconet_gpipe"):
        assert rows[name]["stage_messages"] == "shared memory", name
        assert rows[f"{name}_gloo"]["stage_messages"] == "torch.distributed", name
    messages = doc["summary"]["messages"]
    assert set(messages) == {"shared memory", "torch.distributed"}
    assert all(m["rounds"] == 300 and m["round_trip_median_us"] > 0 for m in messages.values())
    for name, row in rows.items():
        assert row["max_rel_err"] <= 1e-5, name
        assert len(doc["raw_times_s"][name]) == 2
    assert rows["coconet_1f1b"]["schedule_peak_micro_batches"] == [2, 1]
    assert rows["coconet_gpipe"]["schedule_peak_micro_batches"] == [8, 8]
    assert len(doc["targets"]) == 4
    assert all(t["measured"] is not None for t in doc["targets"])
    # at 8 micro-batches 1F1B keeps 2 (rank 0) and 1 (rank 1) of GPipe's 8 alive
    assert doc["targets"][-1]["met"]
