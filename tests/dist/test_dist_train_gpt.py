"""examples/train_gpt.py and train_like_nanogpt.py end to end, as a user runs them (small
configurations): coconet.optim.AdamW on 2 ranks and DDP follow one process on the full batch
(the example's own check, at a tight tolerance), and it writes its JSON summary; a loop with
nanoGPT's structure ported to coconet.optim follows DDP + torch.optim.AdamW, resumed included."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.examples_loader import EXAMPLES


@pytest.mark.timeout(240)
def test_the_training_example_follows_one_process(tmp_path):
    """With ``--fully-shard``: a third run, the model fully sharded (coconet.fsdp), whose
    parameters follow coconet.optim's over the same programs (one sliced, one gathered); with
    ``--local-sgd 2 --overlap``, runs of Local SGD and Overlap Local-SGD beside them, whose
    first step is every run's (the same model and batch, no average yet)."""
    out = tmp_path / "run.json"
    argv = ["--steps", "4", "--d-model", "32", "--layers", "2", "--tolerance", "1e-5",
            "--fully-shard", "--local-sgd", "2", "--overlap"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["loss_drift"]["coconet"] <= 1e-5
    assert summary["loss_drift"]["fsdp"] <= 1e-5
    assert summary["param_drift"]["fsdp_vs_coconet"]["max"] <= 1e-6
    assert len(summary["losses"]["coconet"]) == 4
    assert "communication + optimizer are" in proc.stdout
    for run in ("local_sgd", "overlap_local_sgd"):
        losses = summary["losses"][run]
        assert len(losses) == 4 and abs(losses[0] - summary["losses"]["coconet"][0]) < 1e-6
        assert summary["local_sgd"][f"{run}_final_loss_over_sync_dp"] > 0
    assert "overlap local sgd (K=2): final loss" in proc.stdout


@pytest.mark.timeout(240)
def test_the_training_example_in_bfloat16_follows_one_process(tmp_path):
    """``--dtype bfloat16``: coconet.optim.AdamW's float32 masters of a bfloat16 model, DDP's
    bfloat16 gradients over torch.optim.AdamW's float32 masters, and one process doing the
    same: the losses follow one another (10-step means; the first steps, before the runs'
    different bfloat16 roundings compound, to 1e-3)."""
    out = tmp_path / "run.json"
    argv = ["--steps", "10", "--d-model", "32", "--layers", "1", "--dtype", "bfloat16",
            "--tolerance", "1e-3"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["config"]["dtype"] == "bfloat16"
    assert summary["loss_drift_window"] == 10
    assert summary["loss_drift"]["coconet"] <= 1e-3


@pytest.mark.timeout(300)
def test_a_nanogpt_style_loop_ported_to_coconet_follows_ddp(tmp_path):
    # two param groups, nanoGPT's lr schedule, 4 accumulation micro-steps, clipping (0.3: active
    # at this size, where nanoGPT's 1.0 is not), a rank-0 checkpoint halfway and a resume
    out = tmp_path / "run.json"
    argv = ["--iters", "8", "--d-model", "32", "--layers", "1", "--clip", "0.3",
            "--tolerance", "1e-5", "--json", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_like_nanogpt.py"), *argv],
                          capture_output=True, text=True, timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["drift"] <= 1e-5 and summary["resumed_drift"] <= 1e-5, summary
    assert len(summary["losses"]["resumed"]) == 4
    ddp, ours = summary["norms"]["ddp"], summary["norms"]["coconet"]
    assert sum(n > 0.3 for n in ddp) >= 4, ddp  # clipping did something
    assert max(abs(a - b) / b for a, b in zip(ours, ddp, strict=True)) <= 1e-5
