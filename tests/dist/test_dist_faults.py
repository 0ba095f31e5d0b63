"""Safety at the edges, on 2 local ranks: mismatched programs and bad inputs fail together before
any communication; a rank that dies or stalls gives the others a RuntimeFault (no hang, no C++
abort: the survivors report and exit 0); a failed step leaves every rank's tensors as they were.
Dead and stalled peers are checked on both transports (shared memory, the default on one host,
and torch.distributed/gloo).
"""

from __future__ import annotations

import pytest
from support import dist_workers

from coconet.runtime import CommOptions, RankFailure, spawn

OPTIONS = CommOptions(timeout=30, algorithms="exact")
TRANSPORTS = ["shared memory", "torch.distributed"]


@pytest.mark.timeout(60)
def test_mismatch_and_bad_inputs_fail_on_every_rank():
    results = spawn(dist_workers.handshake_faults, 2, options=OPTIONS, timeout=50)
    for rank, out in enumerate(results):
        assert "ranks are running different programs" in out["program"]
        assert "rank 0 has 'adam', rank 1 has 'sgd'" in out["program"]
        assert "rank 1: input 'g' is torch.float64" in out["dtype"]
        assert "size N is 11 from rank 1's 'g'" in out["local_size"]
        assert "rank 0: input 'm' (Sliced(dim=0)) holds 4 elements" in out["slice_size"]
        assert "rank 1: input 'lr'" in out["missing"] and "is missing" in out["missing"]
        assert out["unchanged"], f"rank {rank}: a refused step changed a tensor"
        # the communicator is still usable: the next good step runs and commits
        assert out["good"] == "no error"
        assert out["changed_after_good"]
    assert results[0] == results[1]  # the same verdict on every rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("where", ["all_gather", "commit"])
def test_peer_killed_mid_step(where, transport):
    options = CommOptions(timeout=30, algorithms="exact", transport=transport)
    results = spawn(
        dist_workers.fault_peer_dies, 2, 1, where, options=options, timeout=50, failures="return"
    )
    survivor, victim = results
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert survivor["status"] == "fault"
    assert "a peer rank died" in survivor["message"]
    assert survivor["seconds"] < 10
    assert survivor["unchanged"], "the survivor committed part of a failed step"


@pytest.mark.timeout(60)
def test_peer_killed_before_a_swapping_commit():
    """CommitMode.SWAP keeps the guarantee: a vote that fails leaves state as it was."""
    results = spawn(
        dist_workers.fault_peer_dies,
        2,
        1,
        "commit",
        "swap",
        options=OPTIONS,
        timeout=50,
        failures="return",
    )
    survivor, victim = results
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert survivor["status"] == "fault" and "a peer rank died" in survivor["message"]
    assert survivor["unchanged"], "the survivor committed part of a failed step"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stalled_peer_times_out(transport):
    options = CommOptions(timeout=1.5, algorithms="exact", transport=transport)
    results = spawn(
        dist_workers.fault_peer_stalls, 2, 1, 4.0, options=options, timeout=50, failures="return"
    )
    survivor = results[0]
    assert survivor["status"] == "fault"
    assert "no answer within 1.5 s" in survivor["message"]
    assert 1.0 < survivor["seconds"] < 4.0
    assert survivor["unchanged"]
    # the stalled rank, once awake, fails too (its peer is gone) and keeps its tensors
    stalled = results[1]
    assert isinstance(stalled, dict) and stalled["status"] == "fault" and stalled["unchanged"]


@pytest.mark.timeout(60)
def test_a_late_point_to_point_send_is_waited_for_whole():
    """A recv that waits longer than the communicator's wait slices gets its data, and the
    connection still carries the next collective (gloo closes it if a slice ends mid-recv)."""
    options = CommOptions(timeout=20, algorithms="exact", transport="torch.distributed")
    results = spawn(dist_workers.late_sender, 2, 1.0, options=options, timeout=50)
    for out in results:
        assert out["status"] == "ok", out
        assert out["transport"] == "torch.distributed"
        assert out["received"] and out["after"]
    assert results[1]["waited"] > 0.9  # it did wait through the slices


@pytest.mark.timeout(60)
def test_a_stalled_point_to_point_send_times_out():
    options = CommOptions(timeout=1.5, algorithms="exact", transport="torch.distributed")
    results = spawn(
        dist_workers.late_sender, 2, 4.0, options=options, timeout=50, failures="return"
    )
    receiver = results[1]
    assert receiver["status"] == "fault", receiver
    assert "no answer within 1.5 s" in receiver["message"]
    assert 1.0 < receiver["seconds"] < 4.0


@pytest.mark.timeout(60)
def test_local_failure_mid_step():
    results = spawn(
        dist_workers.fault_local_error, 2, 1, options=OPTIONS, timeout=50, failures="return"
    )
    other, failing = results
    assert failing["status"] == "ValueError" and "injected failure" in failing["message"]
    assert failing["unchanged"] and failing["broken"]
    assert other["status"] == "RuntimeFault" and other["unchanged"]
