"""examples/train_gpt_tp.py, train_gpt_pp.py and generate_tp.py as a user runs them (small
sizes): the tensor-parallel (and dp x tp) and pipelined (and pp x tp) GPT's losses follow one
process, and greedy decoding with the KV cache is token for token one process's."""

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
def test_data_x_tensor_parallel_training_follows_one_process():
    # dp 2 x tp 2: coconet.optim over each replica group (comm.along("dp")), the layers over tp
    proc = _run("train_gpt_tp.py", "--steps", "4", "--d-model", "32", "--layers", "1",
                "--dp", "2", "--batch", "4", "--tolerance", "1e-5")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "x 2 data-parallel replicas" in proc.stdout
    assert re.search(r"max relative\): \S+ \(tolerance 1e-05\)", proc.stdout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, tp, boundary", [
    ("1f1b", 1, "fused"), ("gpipe", 1, "fused"), ("1f1b", 2, "fused"), ("gpipe", 2, "sliced"),
    ("1f1b", 2, "whole")])  # fmt: skip
def test_pipeline_training_follows_one_process(schedule, tp, boundary):
    # pp 2 (x tp 2: 4 ranks, each stage's blocks coconet.nn layers over its own tp group; the
    # boundary fused (stage 0 ends with a reduce_scatter of the tokens), sliced over tp, or
    # whole activations)
    proc = _run("train_gpt_pp.py", "--steps", "4", "--d-model", "32", "--layers", "2",
                "--micro", "4", "--batch", "8", "--schedule", schedule, "--tp", str(tp),
                "--tolerance", "1e-5", "--boundary", boundary)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if tp > 1:
        said = {"fused": "1/2 of the tokens from a reduce_scatter",
                "sliced": "1/2 slices of the whole activation", "whole": "whole activations"}
        assert said[boundary] in proc.stdout, proc.stdout[-2000:]
    assert re.search(r"max relative\): \S+ \(tolerance 1e-05\)", proc.stdout)
    held = [int(n) for n in re.findall(r"at most (\d+) micro-batches", proc.stdout)]
    assert held == ([4, 4] if schedule == "gpipe" else [2, 1]), proc.stdout


@pytest.mark.timeout(300)
def test_tensor_parallel_decoding_is_one_process_token_for_token():
    proc = _run("generate_tp.py", "--d-model", "64", "--layers", "1", "--train-steps", "80",
                "--new", "12")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "token for token equal to one process" in proc.stdout
    distinct = int(re.search(r"(\d+) distinct tokens", proc.stdout).group(1))
    assert distinct >= 2, proc.stdout  # not a model that says one thing
