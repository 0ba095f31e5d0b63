"""examples/train_gpt.py end to end, as a user runs it (a small configuration): coconet.optim.AdamW
on 2 ranks and DDP follow one process on the full batch (the example's own check, at a tight
tolerance), and it writes its JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.examples_loader import EXAMPLES


@pytest.mark.timeout(240)
def test_the_training_example_follows_one_process(tmp_path):
    out = tmp_path / "run.json"
    argv = ["--steps", "4", "--d-model", "32", "--layers", "1", "--tolerance", "1e-5"]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["loss_drift"]["coconet"] <= 1e-5
    assert len(summary["losses"]["coconet"]) == 4
    assert "communication + optimizer are" in proc.stdout
