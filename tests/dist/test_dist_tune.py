"""coconet.tune on real ranks (2 processes, Adam with N of a few thousand, eager programs).

The ranks agree on the winner, which is the fastest measured candidate; the unscheduled program
on the ranks' own transport is always measured; a second tune is read from the cache (the same
rows, no measurement) unless the size, the state or ``retune`` changes; a candidate that fails on
one rank scores as failed with that rank's error and the others are still measured, and the
caller's communicator still works afterwards; the tuner can be restricted to torch.distributed.

The tests of this module share one cache directory, so the machine is calibrated once (by the
first tune that runs); each test tunes cases no other test tunes (another size or setting).
"""

from __future__ import annotations

import math

import pytest
from support import tune_workers

from coconet.runtime import CommOptions, spawn


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> CommOptions:
    return CommOptions(timeout=60, cache_dir=str(tmp_path_factory.mktemp("tune-cache")))


def _same_on_every_rank(outs: list[dict], key: str):
    values = [o[key] for o in outs]
    assert all(v == values[0] for v in values), (key, values)
    return values[0]


@pytest.mark.timeout(60)
def test_the_ranks_agree_on_the_fastest_measured_candidate(options):
    outs = spawn(tune_workers.tune_adam, 2, 8192, 3, options=options, timeout=55)
    winner = _same_on_every_rank(outs, "winner")
    _same_on_every_rank(outs, "rows")  # the same predictions and measurements everywhere
    out = outs[0]
    assert not out["cached"] and out["json_winner"] == winner
    measured = [r for r in out["rows"] if r["measured"]]
    ran = [r for r in measured if r["measured_ms"] is not None]
    assert 2 <= len(measured) <= 4  # top=3, and the baseline if it was not among them
    assert ran and all(math.isfinite(r["measured_ms"]) and r["measured_ms"] > 0 for r in ran)
    fastest, second = sorted(ran, key=lambda r: r["measured_ms"])[:2]
    again = out["rematch"]
    if again is None:  # the winner is the fastest measured
        assert fastest["measured_ms"] == out["winner_ms"]
        assert fastest["candidate"] == winner
        assert second["measured_ms"] > 1.5 * fastest["measured_ms"]  # too far for a rematch
    else:  # the two fastest were close: the faster in their rematch won
        assert (again["first"], again["second"]) == (fastest["label"], second["label"])
        assert second["measured_ms"] <= 1.5 * fastest["measured_ms"]
        assert out["winner_label"] == again["winner"]
    for r in ran:
        assert len(r["steps_ms"]) >= 3
    # The baseline: the unscheduled program on the transport the ranks use, always measured.
    base = [r for r in out["rows"] if r["unscheduled"] and r["transport"] == out["own_transport"]]
    assert len(base) == 1 and base[0]["measured"] and base[0]["measured_ms"] is not None
    text = out["explain"]
    assert base[0]["label"] in text
    assert f"winner: {out['winner_label']}" in text
    # The top 3 by prediction were measured.
    by_prediction = sorted(out["rows"], key=lambda r: r["predicted_ms"])
    assert all(r["measured"] for r in by_prediction[:3])


@pytest.mark.timeout(90)
def test_the_two_best_meet_in_a_rematch_whose_winner_every_rank_takes(options):
    outs = spawn(tune_workers.tune_rematch, 2, 6144, options=options, timeout=85)
    for key in ("first", "cached", "never"):
        _same_on_every_rank([o[key] for o in outs], "winner")
        _same_on_every_rank([o[key] for o in outs], "rematch")
    first = outs[0]["first"]
    again = first["rematch"]
    assert again is not None
    ran = sorted(
        (r for r in first["rows"] if r["measured_ms"] is not None), key=lambda r: r["measured_ms"]
    )
    assert (again["first"], again["second"]) == (ran[0]["label"], ran[1]["label"])
    assert len(again["first_ms"]) == len(again["second_ms"]) == 3
    assert all(math.isfinite(t) and t > 0 for t in again["first_ms"] + again["second_ms"])
    faster = min(("first", "second"), key=lambda k: sorted(again[f"{k}_ms"])[1])  # the median of 3
    assert first["winner_label"] == again["winner"] == again[faster]
    assert "deciding round, their steps interleaved (3 each)" in first["explain"]
    cached = outs[0]["cached"]
    assert cached["cached"] and cached["rematch"] == again and cached["winner"] == first["winner"]
    never = outs[0]["never"]
    assert never["rematch"] is None and "deciding round" not in never["explain"]


@pytest.mark.timeout(60)
def test_a_second_tune_is_read_from_the_cache_unless_something_changed(options):
    outs = spawn(tune_workers.tune_twice, 2, 4096, 2, options=options, timeout=55)
    for key in ("first", "second", "other_size", "other_state", "retune"):
        assert outs[0][key]["winner"] == outs[1][key]["winner"], key
    out = outs[0]
    first, second = out["first"], out["second"]
    assert not first["cached"] and second["cached"]
    assert second["winner"] == first["winner"]
    # Nothing was measured again: the very same step times, read back.
    assert [r["steps_ms"] for r in second["rows"]] == [r["steps_ms"] for r in first["rows"]]
    assert [r["candidate"] for r in second["rows"]] == [r["candidate"] for r in first["rows"]]
    assert first["measure_calls"] == 1 and second["measure_calls"] == 0
    assert second["seconds"] < first["seconds"] + 5.0  # (a loose bound: both can be fast)
    assert "(from the cache, read in " in second["explain"]
    for key in ("other_size", "other_state", "retune"):
        assert not out[key]["cached"], key
    assert out["measure_calls"] == 4  # first, other size, other state, retune: each measured
    assert out["retune"]["rows"] != first["rows"]  # measured again (times are never equal)
    # retune recalibrated: the calibration it replaced is kept, and the drift is said
    assert "earlier calibration(s) kept: the winner's prediction spans" in \
        out["retune"]["explain"], out["retune"]["explain"]  # fmt: skip


@pytest.mark.timeout(60)
def test_a_candidate_failing_on_one_rank_does_not_stop_the_tuning(options):
    outs = spawn(tune_workers.measure_with_a_broken_candidate, 2, 4096, options=options, timeout=55)
    assert outs[0]["errors"] == outs[1]["errors"]  # the same verdict on every rank
    for out in outs:
        assert out["names"] == ["AR_C", "unscheduled", "fuse_RS_C_AG"]
        assert out["ms"][0] is None
        assert out["errors"][0].startswith("rank 1: RuntimeError: deliberately broken on rank 1")
        for ms, error in zip(out["ms"][1:], out["errors"][1:], strict=True):
            assert error is None and ms is not None and math.isfinite(ms) and ms > 0
        assert out["comm_still_works"]
    assert outs[0]["ms"] == outs[1]["ms"]  # each time is the slowest rank's


@pytest.mark.timeout(60)
def test_tuning_over_torch_distributed_only(options):
    outs = spawn(tune_workers.tune_torch_only, 2, 6144, options=options, timeout=55)
    _same_on_every_rank(outs, "winner")
    out = outs[0]
    assert {r["transport"] for r in out["rows"]} == {"torch.distributed"}
    assert "[torch.distributed" in out["winner_label"]
    assert any(r["measured_ms"] is not None for r in out["rows"])


LAYER_SIZES = {"B": 8, "H": 64, "H2": 32}


@pytest.mark.timeout(60)
def test_a_layer_with_integer_scalars_tunes_when_they_are_given(options):
    outs = spawn(
        tune_workers.tune_layer, 2, LAYER_SIZES, {"seed": 3, "step": 1}, options=options, timeout=55
    )
    _same_on_every_rank(outs, "winner")
    assert outs[0]["winner"] is not None
    assert outs[0]["errors"] and all(e is None for e in outs[0]["errors"])


@pytest.mark.timeout(60)
def test_a_layer_with_integer_scalars_tunes_with_the_default_scalars(options):
    outs = spawn(tune_workers.tune_layer, 2, LAYER_SIZES, None, options=options, timeout=55)
    assert all(e is None for e in outs[0]["errors"]), outs[0]["errors"][0]
    assert outs[0]["winner"] is not None


@pytest.mark.timeout(60)
def test_only_measures_exactly_the_named_candidates_and_caches_nothing(options):
    label = "AR_C [shared memory]"
    outs = spawn(tune_workers.tune_only, 2, 6144, label, options=options, timeout=55)
    assert outs[0]["measured"] == [label]
    assert outs[0]["full_cached"] is False
