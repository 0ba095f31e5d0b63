"""A Ctrl-C at each phase of a step leaves it applied on every rank or on none (issue 42, item
6): the vote and the commit are two-phase across the ranks (``coconet.runtime.interrupts``: a
Ctrl-C from a rank's vote to the end of its commit is held until the commit ends), and an
optimizer step's buckets are held together. 2 ranks; compiled steps over shared memory (the
fused one-pass step, whose commit copies the peers' published slices) and torch.distributed,
and ``coconet.optim.AdamW`` with two buckets. Every phase: the victim raises
``KeyboardInterrupt``, its peer a ``RuntimeFault``, both promptly; the parameters are the same
on both ranks and every bucket's state moved on both or on neither."""

from __future__ import annotations

import pytest
from support import commit_phase_workers as workers

from coconet.runtime import CommOptions, spawn

TIMEOUT = 20.0


def _check(peer: list[dict], victim: list[dict]) -> None:
    for v, p in zip(victim, peer, strict=True):
        phase = v["phase"]
        assert v["status"].startswith("KeyboardInterrupt"), (phase, v["status"])
        assert p["status"].startswith("RuntimeFault"), (phase, p["status"])
        assert v["params"] == p["params"], (phase, "the ranks' parameters differ")
        moved = set(v["changed"] + p["changed"])
        assert len(moved) == 1, (phase, "split", v["changed"], p["changed"])
        applied = moved.pop()
        if phase == "between steps":  # the step had returned: applied, and nothing to note
            assert applied, (phase, v["changed"])
        else:  # the victim's note says what happened, and it is what happened
            assert ("(committed)" in v["status"]) == applied, (phase, v["status"], v["changed"])
        assert max(v["after_signal"], p["after_signal"]) < 5.0, (phase, v, p)


@pytest.mark.timeout(300)
def test_a_ctrl_c_at_every_phase_of_a_fused_step_over_shared_memory():
    options = CommOptions(timeout=TIMEOUT, algorithms="exact", transport="shared memory")
    peer, victim = spawn(workers.trials, 2, 1, "step", "fuse_RS_C_AG", options=options,
                         timeout=280)  # fmt: skip
    assert [t["phase"] for t in victim] == list(workers.STEP_PHASES)
    _check(peer, victim)


@pytest.mark.timeout(400)
def test_a_ctrl_c_at_every_phase_of_a_step_over_torch_distributed():
    """Over gloo an interrupted trial can leave a collective of the default group half done:
    each phase gets a pair of processes of its own."""
    options = CommOptions(timeout=TIMEOUT, algorithms="exact", transport="torch.distributed")
    for phase in workers.STEP_PHASES:
        peer, victim = spawn(workers.trials, 2, 1, "step", "none", [phase], options=options,
                             timeout=60)  # fmt: skip
        assert [t["phase"] for t in victim] == [phase]
        _check(peer, victim)


@pytest.mark.timeout(300)
def test_a_ctrl_c_at_every_phase_of_an_optimizer_step_of_two_buckets():
    options = CommOptions(timeout=TIMEOUT, transport="shared memory")
    peer, victim = spawn(workers.trials, 2, 1, "optim", "fuse_RS_C_AG", options=options,
                         timeout=280)  # fmt: skip
    assert [t["phase"] for t in victim] == list(workers.OPTIM_PHASES)
    _check(peer, victim)
