"""Ctrl-C at random moments (issue 26, item 5): 2 local ranks, many trials in one pair of
processes (``support.sigint_workers``), over shared memory and torch.distributed. Every
interrupt is acted on: the interrupted rank raises ``KeyboardInterrupt`` and its peer a
``RuntimeFault``, both within a second of the signal (the peer's timeout is 20 s: it was told,
not timed out). None is lost."""

from __future__ import annotations

import pytest
from support import sigint_workers

from coconet.runtime import CommOptions, spawn

TIMEOUT = 20.0


def _check(peer: list[dict], victim: list[dict]) -> None:
    lost = [k for k, t in enumerate(victim) if not t["status"].startswith("KeyboardInterrupt")]
    assert lost == [], [victim[k] for k in lost]
    untold = [k for k, t in enumerate(peer) if not t["status"].startswith("RuntimeFault")]
    assert untold == [], [peer[k] for k in untold]
    slow = [
        (k, v["after_signal"], p["after_signal"])
        for k, (v, p) in enumerate(zip(victim, peer, strict=True))
        if max(v["after_signal"], p["after_signal"]) > 1.0
    ]
    assert slow == [], slow


@pytest.mark.timeout(400)
def test_a_ctrl_c_at_a_random_moment_is_never_lost_over_shared_memory():
    """200 trials in one pair of processes: over shared memory a step uses no torch.distributed
    collective after its first, so an interrupted trial leaves nothing half done there and the
    next trial's communicator starts clean."""
    options = CommOptions(timeout=TIMEOUT, algorithms="exact", transport="shared memory")
    peer, victim = spawn(
        sigint_workers.trials, 2, 1, 200, 2026, "fuse_RS_C_AG", options=options, timeout=380
    )
    _check(peer, victim)


@pytest.mark.timeout(300)
def test_a_ctrl_c_at_a_random_moment_is_never_lost_over_torch_distributed():
    """Over gloo a trial can leave a collective of the default group half done, so each trial
    gets a pair of processes of its own (fewer: each costs a launch)."""
    options = CommOptions(timeout=TIMEOUT, algorithms="exact", transport="torch.distributed")
    for seed in range(8):
        peer, victim = spawn(
            sigint_workers.trials, 2, 1, 1, seed, "none", options=options, timeout=120
        )
        _check(peer, victim)
