"""torch's optimizer contracts on several ranks (issue 42, items 10-11): a parameter whose
``.data`` every rank re-pointed (accelerate's ``prepare``, a device move) is taken in again;
a parameter frozen at construction and unfrozen later on every rank is stepped from its first
gradient (gradual unfreezing); a model wrapped in ``DistributedDataParallel`` after the
optimizer was built (HF Trainer, accelerate) has its gradients reduced once, by DDP, and a
``clip_grad_norm_`` between ``backward()`` and ``step()`` clips their average. Each against
torch's AdamW on one process stepping the ranks' average gradient, to 1e-5 relative. (Ranks
that change their parameters differently: tests/dist/test_dist_optim_misuse.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import contract_workers

from coconet.runtime import CommOptions, spawn

TOL = 1e-5
OPTIONS = CommOptions(timeout=60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["repointed", "unfrozen"])
def test_changed_parameters_are_taken_in_again_on_every_rank(case):
    results = spawn(getattr(contract_workers, case), 2, options=OPTIONS, timeout=160)
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert bad == {}, (case, rank, bad)


@pytest.mark.timeout(180)
def test_a_ddp_wrapper_found_is_the_one_reduction():
    results = spawn(contract_workers.ddp_wrapped, 2, options=OPTIONS, timeout=160)
    for r in results:
        bad = {k: v for k, v in r["errors"].items() if not v <= TOL}
        assert bad == {}, bad
        assert r["averaged_by"] == "DistributedDataParallel"
        # the steps move no data: their programs have no collective, one agreement round each
        assert r["moves"] == [] and r["rounds"][1:] == [1, 1, 1], (r["moves"], r["rounds"])


SCRIPT = Path(__file__).resolve().parents[1] / "support" / "hf_trainer.py"


@pytest.mark.timeout(300)
def test_transformers_trainer_with_coconet_adamw_follows_torch_adamw():
    """``transformers.Trainer(model, args, optimizers=(coconet.optim.AdamW(...), scheduler))``
    on 2 ranks (a small GPT-2, random weights; Trainer wraps it in DDP and clips its gradients
    at 1.0) against the same Trainer with torch's AdamW: the losses of every step."""
    pytest.importorskip("transformers")
    losses = {}
    for which in ("torch", "coconet"):
        proc = subprocess.run(
            [sys.executable, "-m", "coconet.cli", "run", "--nproc", "2", str(SCRIPT), which],
            capture_output=True, text=True, timeout=280,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        found = re.search(r"^LOSSES (\S+) (.*)$", proc.stdout, re.M)
        assert found and found.group(1) == which, proc.stdout[-2000:]
        losses[which] = json.loads(found.group(2))
        if which == "coconet":
            assert "averaged by DistributedDataParallel" in proc.stdout, proc.stdout[-2000:]
    assert len(losses["torch"]) == len(losses["coconet"]) == 6
    for a, b in zip(losses["coconet"], losses["torch"], strict=True):
        assert abs(a - b) <= TOL * abs(b), losses


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["shared memory", "torch.distributed"])
def test_a_rank_with_one_step_more_is_told_who_stopped_where(transport):
    """Item 7: before, the longer rank got "peer died" at its timeout and the other exited
    without a word. The rank that leaves tells its peers the calls it made."""
    options = CommOptions(timeout=30, transport=transport)
    longer, shorter = spawn(contract_workers.one_step_more, 2, options=options, timeout=160)
    assert shorter == {"error": None, "step": 4}
    assert longer["step"] == 5, longer
    text = longer["error"]
    assert "left the job" in text and "rank 1 left the job after 4 x coconet.optim.AdamW.step" \
        in text, text  # fmt: skip
    assert "this rank was making its coconet.optim.AdamW.step number 5" in text, text
    # the flight recorder's verdict: where the peer that left was (its last call), not "no answer"
    assert re.search(r"rank 1: at #\d+ .*\(completed\), then left the job", text), text
    assert "the same number of batches" in text, text
    assert longer["seconds"] < 10.0, longer  # told, not timed out (30 s)


@pytest.mark.timeout(180)
def test_lamb_keeps_lambs_diagnostics_on_two_ranks():
    """Item 13: a bucket of rows sliced over the ranks computes its rows' diagnostics where
    they live and gathers them (a flat bucket's come out of its step)."""
    for rank, errors in enumerate(spawn(contract_workers.lamb_diagnostics, 2, options=OPTIONS,
                                        timeout=160)):  # fmt: skip
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert bad == {}, (rank, bad)
