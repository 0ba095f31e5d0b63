"""Fault trials in the layers, the pipeline and the optimizer (issue 42): a SIGKILL, a stall past
the timeout and a Ctrl-C of one rank at a precise point of a ``coconet.nn`` layer's forward (the
row-parallel layer's all_reduce) and backward (the column-parallel layer's input gradient), of a
``coconet.pipeline`` step (a stage's forward, its backward, a receive at the stage boundary) on 2
ranks, and of a ``coconet.optim.AdamW`` step over ``comm.along("dp")`` of ``Mesh(dp=2, tp=2)``
(at its first bucket's commit vote; and, one place more, at its second's) on 4, over shared
memory (one host), the communicator's timeout 4 s (``support.fault_trial_workers``).

Every trial: every other rank gets a ``RuntimeFault`` naming a rank and what happened to it
within the timeout + 5 s, the victim of a Ctrl-C a ``KeyboardInterrupt``; every live rank's
parameters and optimizer state are wholly before or wholly after the step, the replicas of one
part alike; no rank maps a segment after closing its communicator, and nothing is left in
/dev/shm. A SIGKILL ends its job, so each gets a spawn of its own; the stalls and Ctrl-Cs of a
world share one. ``python tests/support/fault_trial_workers.py`` prints the counts.

Found by these trials and fixed in the runtime: a rank that stalled past its peer's timeout went
on alone when it woke, the peer's part of the round already posted (it committed an optimizer
bucket its peer had given up: ``votes_counted``; it finished a one-round collective, or a
pipeline step whose messages were in the ring, and trained a step more than its peer:
``cn_one_shot`` and ``PeerChannels.send`` now fail when the peer aborted first); errors on a
communicator along one axis named group ranks only (now the job's rank too).

An optimizer step over dp of a dp x tp mesh is voted on by every rank of the mesh (each dp group
voting on its own left the other group's parts stepped when a rank failed before its vote).

Known and not fixed here (``coconet.optim``): a bucket commits on its own, so a fault between
two buckets' votes leaves the first bucket stepped and the second not on every surviving rank
(``test_..._between_two_buckets``, a strict xfail); the survivors' error says so ("partly a step
ahead ... restore them from a checkpoint").
"""

from __future__ import annotations

import pytest
from support import fault_trial_workers as workers

from coconet.runtime import RankFailure

NN_PIPELINE = workers.PLACES[:5]
OPTIM = workers.PLACES[5:]
_VERDICTS: dict[tuple, list[dict]] = {}


def _run(world: str, plan: tuple[tuple[str, str], ...]) -> list[dict]:
    """The verdicts of ``plan``'s trials in one spawned job (cached for the tests that follow),
    after checking that nothing was left in /dev/shm."""
    key = (world, plan)
    if key not in _VERDICTS:
        before = workers.shm_entries()
        results = workers.run(world, list(plan))
        assert workers.shm_leftovers(before) == [], "left in /dev/shm"
        if any(fault == "kill" for _, fault, _ in plan):
            victim = results[workers.VICTIM[world]]
            assert isinstance(victim, RankFailure) and victim.exit_code == -9, victim
        _VERDICTS[key] = [workers.judge(t) for t in workers.split_trials(results, list(plan))]
    return _VERDICTS[key]


def _check(verdicts: list[dict], whole: bool = True) -> None:
    for v in verdicts:
        where = (v["fault"], v["place"])
        assert v["clear"], (where, v["problems"])
        assert v["named"], (where, "the survivors' errors do not name the victim and the call")
        assert v["leaked"] == 0, (where, "segments still mapped after close", v["leaked"])
        if whole:
            assert v["whole"], (where, v["states"])


STALLS_AND_CTRL_C = workers.stalls_and_ctrl_cs(NN_PIPELINE)
OPTIM_STALLS_AND_CTRL_C = workers.stalls_and_ctrl_cs(OPTIM)


@pytest.mark.timeout(200)
def test_a_stall_or_a_ctrl_c_in_a_layer_or_a_pipeline_step():
    verdicts = _run("2", STALLS_AND_CTRL_C)
    assert [(v["place"], v["fault"], v["point"]) for v in verdicts] == list(STALLS_AND_CTRL_C)
    _check(verdicts)
    for v in verdicts:  # nothing stepped: every rank failed in its forward or backward
        assert set(v["states"].values()) == {"before"}, v


@pytest.mark.timeout(90)
@pytest.mark.parametrize("place", NN_PIPELINE)
def test_a_rank_killed_in_a_layer_or_a_pipeline_step(place):
    (verdict,) = _run("2", ((place, "kill", workers.POINTS[place]),))
    _check([verdict])
    assert set(verdict["states"].values()) == {"before"}, verdict


@pytest.mark.timeout(200)
def test_a_stall_or_a_ctrl_c_in_an_optimizer_step_on_dp_x_tp():
    verdicts = _run("dp=2,tp=2", OPTIM_STALLS_AND_CTRL_C)
    # the second bucket's stall leaves its group half stepped (see below): clear, not whole
    _check([v for v in verdicts if v["place"] == "optim step" or v["fault"] == "ctrl-c"])
    _check(verdicts, whole=False)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("place", OPTIM)
def test_a_rank_killed_in_an_optimizer_step_on_dp_x_tp(place):
    (verdict,) = _run("dp=2,tp=2", ((place, "kill", workers.POINTS[place]),))
    _check([verdict], whole=place == "optim step")


def _optim_verdicts() -> list[dict]:
    out = list(_run("dp=2,tp=2", OPTIM_STALLS_AND_CTRL_C))
    for place in OPTIM:
        out += _run("dp=2,tp=2", ((place, "kill", workers.POINTS[place]),))
    return out


@pytest.mark.timeout(300)
def test_an_optimizer_step_on_dp_x_tp_is_whole_across_the_mesh():
    """Every rank of the dp x tp mesh votes on each bucket's commit (not each dp group on its
    own): a rank killed or stalled before its vote leaves every rank's parts as they were."""
    bad = [(v["fault"], v["place"], v["states"]) for v in _optim_verdicts()
           if v["place"] == "optim step" and not v["mesh_whole"]]  # fmt: skip
    assert bad == []


@pytest.mark.timeout(300)
@pytest.mark.xfail(strict=True, reason="coconet.optim commits bucket by bucket: a fault between "
                   "two buckets' votes leaves the first stepped, the second not")
def test_an_optimizer_step_is_whole_when_a_rank_fails_between_two_buckets():
    bad = [(v["fault"], v["states"]) for v in _optim_verdicts()
           if v["place"] == "optim step, 2nd bucket" and not v["whole"]]  # fmt: skip
    assert bad == []


def test_the_counts(capsys):
    """The note's counts, from the trials run above (``-s`` shows them)."""
    verdicts = [v for vs in _VERDICTS.values() for v in vs]
    if not verdicts:
        pytest.skip("no trial ran in this session")
    with capsys.disabled():
        print("\n" + workers.table(verdicts))
    assert all(v["clear"] for v in verdicts)
