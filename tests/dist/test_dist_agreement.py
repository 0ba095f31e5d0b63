"""The per-step agreement when it costs no round of its own (``coconet.runtime.handshake``), on 2
local ranks over both transports: a step's agreement that rides with its first all_reduce, and
steps that communicate nothing, agreed at the communicator's next round. Results stay bitwise
the simulator's, and every misuse the agreement catches before its own round is still caught,
on every rank alike, with the communicator usable after.
"""

from __future__ import annotations

import pytest
from support import agreement_workers
from support.safety_workers import assert_same_fault

from coconet.runtime import CommOptions, spawn

TRANSPORTS = ["shared memory", "torch.distributed"]
TIMEOUT = 20.0  # what "at once" is measured against


@pytest.fixture(scope="module", params=TRANSPORTS)
def checked(request):
    options = CommOptions(timeout=TIMEOUT, transport=request.param)
    return request.param, spawn(agreement_workers.checks, 2, options=options, timeout=150)


def _same_fault(results, label, *fragments):
    assert_same_fault(results, label, *fragments, within=TIMEOUT / 4)


@pytest.mark.timeout(160)
def test_calls_are_exact_and_ride_with_the_all_reduce(checked):
    transport, results = checked
    for rank, out in enumerate(results):
        assert all(out["good"]["exact"]), f"rank {rank}: {out['good']}"
        assert out["good"]["rounds"] == 6  # one agreement round per call, never two
        # over shared memory every call after the first carries the all_reduce in that round
        assert out["good"]["carried"] == (5 if transport == "shared memory" else 0)
        assert out["new shapes"] and out["new shapes again"], f"rank {rank}"
        assert out["usable"], f"rank {rank}: the communicator is not usable after the refusals"


@pytest.mark.timeout(160)
def test_misuse_is_refused_on_every_rank_when_the_agreement_rides(checked):
    _, results = checked
    _same_fault(results, "scalar differs", "Replicated inputs differ", "input 'c'")
    _same_fault(results, "bad dtype", "bad inputs", "rank 1: input 'x' is torch.float64")
    _same_fault(results, "one rank's shape", "do not fit the program together")
    _same_fault(results, "swapped steps", "different compiled steps of the same program")
    # the refused calls are not counted: 6 good, 2 with new shapes, 1 after the local calls, 1
    # after the refusals, 7 with shapes seen, 1 at the end (the three the local steps'
    # divergence refused are not, nor the two whose verdicts differed)
    assert [out["calls"] for out in results] == [18, 18]


@pytest.mark.timeout(160)
def test_shapes_seen_before_or_alike_on_every_rank_need_no_exchange(checked):
    """Shapes that change back to ones a rank had (a decoder's lengths, prompt after prompt),
    or to new ones that every rank has alike, are agreed in the step's one round: no exchange
    of reports (an all_gather_object), results bitwise the simulator's. Ranks whose shapes
    differ are refused on every rank alike, kept verdicts or new."""
    _, results = checked
    for rank, out in enumerate(results):
        seen = out["shapes seen"]
        assert all(seen["exact"]) and seen["local"], f"rank {rank}: {seen}"
        assert seen["exchanges"] == [0, 0], f"rank {rank}: {seen}"
        assert out["usable after"], f"rank {rank}"
    _same_fault(results, "kept verdicts differ", "do not fit the program together",
                "size N is 69")  # fmt: skip
    _same_fault(results, "new verdicts differ", "do not fit the program together",
                "size N is 75")  # fmt: skip


@pytest.mark.timeout(160)
def test_steps_that_communicate_nothing_are_agreed_at_the_next_round(checked):
    _, results = checked
    for rank, out in enumerate(results):
        # calls 3 and 4 like the call before: replayed (CompiledStep._replay_local)
        assert out["local calls"] == {"equal": True, "rounds": 0, "replayed": 2}, f"rank {rank}"
        replays = out["local replays"]
        assert replays["equal"] and replays["rounds"] == ["no error"], f"rank {rank}: {replays}"
        # replayed: the same tensor again (calls 3, 10), a new one of its shape (4), the same
        # length again (8); not: one that needs grad (5), a new number (6), a new length (7, 9)
        assert replays["replayed"] == [True, True, False, False, False, True, False, True], \
            f"rank {rank}: {replays}"
        assert out["after local calls"] == "no error", f"rank {rank}"
    _same_fault(results, "local extra call", "ranks ran different steps that communicate nothing",
                "rank 0 ran 2 such calls, rank 1 ran 1")  # fmt: skip
    _same_fault(results, "local scalar differs", "communicate nothing",
                "rank 0 ran scalar (compiled step 1) call 2 with c=2.0")  # fmt: skip
    # the bad input fails its own rank at once; the other ran the call: told at the next round
    bad = [out["local bad input"] for out in results]
    assert bad[0]["status"] == "no error"
    assert bad[1]["status"] == "RuntimeFault" and "bad inputs" in bad[1]["message"]
    _same_fault(results, "after local bad input", "communicate nothing",
                "rank 0 ran 1 such calls, rank 1 ran 0")  # fmt: skip


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_in_different_control_rounds_are_told_at_once(transport):
    # (on gloo, rounds of different sizes used to abort the process: every round is one size)
    options = CommOptions(timeout=TIMEOUT, transport=transport)
    results = spawn(agreement_workers.out_of_step, 2, options=options, timeout=60)
    for rank, out in enumerate(results):
        assert out["status"] == "RuntimeFault", f"rank {rank}: {out}"
        assert "out of step on the control channel" in out["message"], out["message"]
        assert out["seconds"] < TIMEOUT / 4, f"rank {rank}: {out}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_aligned_start_lets_no_rank_go_before_the_last_arrives(transport):
    """The start the tuner and the calibration time from (``Communicator.aligned_start``): a
    barrier on either transport, with a late rank and back to back."""
    options = CommOptions(timeout=TIMEOUT, transport=transport)
    results = spawn(agreement_workers.aligned_starts, 2, 0.2, options=options, timeout=50)
    assert [r["transport"] for r in results] == [transport] * 2
    for k in range(3):
        last_arrival = max(r["spans"][k][0] for r in results)
        first_exit = min(r["spans"][k][1] for r in results)
        assert first_exit >= last_arrival, f"start {k}: a rank left before the last arrived"
    assert results[0]["spans"][0][1] - results[0]["spans"][0][0] > 0.1  # rank 0 waited for 1
