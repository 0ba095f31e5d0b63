"""examples/train_gpt_tp.py and examples/generate_tp.py as a user runs them (small sizes): the
tensor-parallel GPT's losses follow one process, and greedy decoding with the KV cache is token
for token one process's."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support.examples_loader import EXAMPLES


def _run(script: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *argv], capture_output=True,
                          text=True, timeout=280)  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_training_follows_one_process(world):
    proc = _run("train_gpt_tp.py", "--steps", "5", "--d-model", "32", "--layers", "1",
                "--world", str(world), "--tolerance", "1e-5")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"max relative\): \S+ \(tolerance 1e-05\)", proc.stdout)


@pytest.mark.timeout(300)
def test_tensor_parallel_decoding_is_one_process_token_for_token():
    proc = _run("generate_tp.py", "--d-model", "64", "--layers", "1", "--train-steps", "80",
                "--new", "12")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "token for token equal to one process" in proc.stdout
    distinct = int(re.search(r"(\d+) distinct tokens", proc.stdout).group(1))
    assert distinct >= 2, proc.stdout  # not a model that says one thing
