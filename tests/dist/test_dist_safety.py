"""Safety at the edges (issue 13), on 2 local ranks over both transports: misuse that used to
corrupt state silently, or fail on one rank while the others waited out the timeout, now fails
on every rank at once with the real reason, before any data moves; a commit interrupted after
the vote still ends wholly after the step; Ctrl-C mid-step reaches the peers at once.
"""

from __future__ import annotations

import pytest
from support import safety_workers

from coconet.runtime import CommOptions, RankFailure, spawn

TRANSPORTS = ["shared memory", "torch.distributed"]
TIMEOUT = 20.0  # what "at once" is measured against


def _options(transport: str) -> CommOptions:
    return CommOptions(timeout=TIMEOUT, algorithms="exact", transport=transport)


def _same_fault_everywhere(results, label, *fragments):
    safety_workers.assert_same_fault(results, label, *fragments, within=TIMEOUT / 4)


@pytest.fixture(scope="module", params=TRANSPORTS)
def healthy(request):
    """One job per transport runs every check that leaves the communicator usable."""
    results = spawn(safety_workers.healthy, 2, options=_options(request.param), timeout=150)
    return {key: [r[key] for r in results] for key in results[0]}


@pytest.mark.timeout(160)
def test_misuse_fails_on_every_rank_before_any_data_moves(healthy):
    results = healthy["misuse"]
    same = _same_fault_everywhere
    same(results, "expand", "rank 1: input 'm' is updated but several of its elements")
    same(results, "inference", "rank 0: input 'p' is updated but is an inference tensor")
    same(results, "same p and m", "rank 1: inputs 'p' and 'm' share memory and both are updated")
    same(results, "overlapping views", "rank 0: inputs 'p' and 'm' share memory")
    same(results, "int nan", "rank 1: input 'k' (int64): nan is not an integer")
    same(results, "int too big", "rank 0: input 'k' (int64): 9223372036854775808 is outside")
    same(results, "int fraction", "rank 1: input 'k' (int64): 1.5 is not an integer")
    same(results, "float too big", "rank 1: input 'lr' (float32): 100000000000...(401 digits)")
    same(results, "float32 overflow", "rank 0: input 'lr' (float32): 1e+39 overflows float32")
    same(results, "step ahead", "Replicated inputs differ", "input 'k': rank 0 has 2")
    same(results, "re-pointed", "rank 0: inputs 'p' and 'm' share memory and both are updated")
    for out in results:
        assert out["interleaved views"]["status"] == "no error"  # disjoint views are fine
        assert out["float nan passes"]["status"] == "no error"
        assert out["good"]["status"] == "no error" and not out["good"]["unchanged"]
        assert out["calls"] == 3  # the refused calls are not counted, on any rank


@pytest.mark.timeout(160)
def test_steps_called_in_different_orders_are_caught(healthy):
    results = healthy["sequence"]
    for check in (True, False):
        _same_fault_everywhere(
            results, f"swapped steps {check}", "different compiled steps of the same program"
        )
        _same_fault_everywhere(
            results, f"swapped programs {check}", "ranks are running different programs",
            "program: rank 0 has 'x', rank 1 has 'y'",
        )
    _same_fault_everywhere(
        results, "shape change", "rank 1: input shapes changed since the first step",
        "check_every_step=False",
    )


@pytest.mark.timeout(160)
@pytest.mark.parametrize("option", [o for o, _ in safety_workers.OPTION_PAIRS])
def test_options_that_differ_across_ranks_fail_every_rank(healthy, option):
    results = healthy[f"option {option}"]
    for out in results:
        assert out["status"] == "RuntimeFault", out
        assert "ranks are running different programs" in out["message"]
        assert f"option {option}: rank 0 has" in out["message"] and out["unchanged"]
        assert out["seconds"] < TIMEOUT / 4
    assert results[0]["message"] == results[1]["message"]


@pytest.mark.timeout(160)
def test_replicated_drift_is_caught_only_when_asked(healthy):
    for out in healthy["drift"]:
        assert out["False"]["status"] == "no error"  # documented: not checked by default
        assert out["True"]["status"] == "RuntimeFault" and out["True"]["unchanged"]
        assert "input 'p': rank 0 has [64] checksum" in out["True"]["message"]


@pytest.mark.timeout(160)
@pytest.mark.parametrize("kind", ["error", "interrupt"])
def test_a_commit_that_fails_after_the_vote_still_ends_wholly_after(healthy, kind):
    other, victim = healthy[f"commit {kind}"]
    for out in (other, victim):
        assert out["wholly_after"], out  # every rank: wholly after the step, like the others
        assert out["broken"] is None and out["again"] == "no error", out
    assert other["status"] == "no error" and not other["warnings"]
    if kind == "interrupt":
        assert victim["status"] == "KeyboardInterrupt"
        assert any("was committed on this rank" in n for n in victim["notes"]), victim
    else:
        assert victim["status"] == "no error"
        assert any("failed once and was repeated" in w for w in victim["warnings"]), victim


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ctrl_c_mid_step_reaches_the_peers_at_once(transport):
    results = spawn(
        safety_workers.interrupted_mid_step, 2, 1, options=_options(transport), timeout=80,
        failures="return",
    )
    other, victim = results
    assert not isinstance(victim, RankFailure), victim
    assert victim["status"] == "KeyboardInterrupt" and victim["broken"] and victim["unchanged"]
    assert other["status"] == "RuntimeFault" and other["unchanged"], other
    assert other["seconds"] < 2.5, other  # before the victim's exit at 3 s: from the abort


@pytest.mark.timeout(90)
def test_a_slow_first_compile_does_not_count_against_the_timeout():
    # The readiness agreement goes through the job's store whatever the transport: one suffices.
    options = CommOptions(timeout=1.5, algorithms="exact", transport="shared memory")
    results = spawn(safety_workers.slow_compile, 2, 1, 3.0, options=options, timeout=80)
    for out in results:
        assert out["status"] == "no error", out
        assert not out["unchanged"]  # the step committed
    assert max(results[1]["compile_seconds"].values()) >= 3.0


@pytest.mark.timeout(90)
def test_a_rank_that_dies_while_compiling_is_reported_at_once():
    options = CommOptions(timeout=1.5, algorithms="exact", transport="shared memory")
    results = spawn(
        safety_workers.slow_compile, 2, 1, 0.0, True, options=options, timeout=80,
        failures="return",
    )
    survivor, victim = results
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert survivor["status"] == "RuntimeFault" and "rank(s) [1] died" in survivor["message"]
    assert survivor["unchanged"] and survivor["seconds"] < 10
