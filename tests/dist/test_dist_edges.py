"""Faults at the edges of a step (issue 26), on 2 local ranks over both transports: a Ctrl-C in
the local checks before the agreement is announced at once; a rank killed while its peer
compiles the first step is noticed during that compile, within the timeout."""

from __future__ import annotations

import pytest
from support import edge_workers

from coconet.runtime import CommOptions, RankFailure, spawn

TRANSPORTS = ["shared memory", "torch.distributed"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_ctrl_c_in_the_local_checks_reaches_the_peers_at_once(transport):
    options = CommOptions(timeout=20.0, algorithms="exact", transport=transport)
    other, victim = spawn(
        edge_workers.interrupted_in_local_checks, 2, 1, options=options, timeout=80
    )
    assert victim["status"] == "KeyboardInterrupt" and victim["broken"], victim
    assert other["status"] == "RuntimeFault" and "aborted" in other["message"], other
    assert other["unchanged"] and victim["unchanged"]
    assert other["seconds"] < 2.5, other  # before the victim's exit at 3.3 s: from the abort


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("transport", "watch_pids"),
    [("shared memory", True), ("torch.distributed", True), ("torch.distributed", False)],
)
def test_a_rank_killed_while_its_peer_compiles_is_noticed_during_the_compile(
    transport, watch_pids
):
    options = CommOptions(timeout=1.5, algorithms="exact", transport=transport)
    survivor, victim = spawn(
        edge_workers.killed_while_peer_compiles, 2, 1, watch_pids, options=options,
        timeout=80, failures="return",
    )
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert survivor["status"] == "RuntimeFault", survivor
    why = "rank(s) [1] died" if watch_pids else "rank(s) [1] gave no sign of life for 1.5 s"
    assert why in survivor["message"], survivor
    # its own compile takes 30 s: the fault came while it compiled, within the timeout (+ the
    # rehearsal and the heartbeat's look)
    assert survivor["unchanged"] and survivor["seconds"] < 8, survivor


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_differing_lr_is_named_as_the_users_lr(transport):
    options = CommOptions(timeout=20.0, algorithms="exact", transport=transport)
    for out in spawn(edge_workers.differing_lr, 2, options=options, timeout=80):
        assert "the ranks hold different parameters" in out["built"], out["built"]
        assert "lr=0.1" in out["built"] and "lr=0.2" in out["built"], out["built"]
        assert out["status"] == "RuntimeFault" and out["unchanged"], out
        head = out["message"].splitlines()[0]
        assert "Replicated inputs differ across ranks: lr" in head, out["message"]
        assert "lr (step_size = lr / (1 - beta1 ** step)) (input 'step_size'" in out["message"]
