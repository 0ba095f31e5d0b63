"""coconet.pipeline.Pipeline on 2 and 4 ranks: GPipe and 1F1B (and fewer micro-batches than
stages) train like one process (per-stage gradients and losses to 1e-5 relative in float32: the
micro-batches' sums re-associate the batch's); a rank killed mid-schedule fails the others
within the timeout, their parameters untouched; 200 random schedules on 2-4 ranks are each
refused before they run or run correctly, none hangs."""

from __future__ import annotations

import pytest
from support import pipeline_workers

from coconet import Mesh
from coconet.runtime import CommOptions, RankFailure, spawn

OPTIONS = CommOptions(timeout=30, transport="torch.distributed")


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("schedule", "nproc", "micro"),
    [("gpipe", 2, 4), ("1f1b", 2, 4), ("1f1b", 2, 1), ("gpipe", 4, 8), ("1f1b", 4, 8),
     ("1f1b", 4, 2)],  # the last: fewer micro-batches than stages
)  # fmt: skip
def test_pipeline_trains_like_one_process(schedule, nproc, micro):
    results = spawn(pipeline_workers.train_vs_one_process, nproc, schedule, micro,
                    options=OPTIONS, timeout=180)  # fmt: skip
    for rank, out in enumerate(results):
        bad = {k: v for k, v in out["errors"].items() if not v <= 1e-5}
        assert bad == {}, f"rank {rank}: {bad}"
    assert len(results[-1]["losses"]) == 3


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_schedule():
    results = spawn(pipeline_workers.killed_mid_schedule, 2, 1, options=OPTIONS, timeout=100,
                    failures="return")  # fmt: skip
    survivor, victim = results
    assert isinstance(victim, RankFailure)
    assert survivor["status"] == "fault", survivor
    assert "stalled or died" in survivor["message"]
    assert survivor["seconds"] < 40
    assert survivor["unchanged"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("nproc", "count"), [(2, 80), (3, 60), (4, 60)])
def test_random_schedules_are_refused_or_run_on_ranks(nproc, count):
    # 200 in all. The same seed on every rank: the same pipelines, refused alike by `check`.
    results = spawn(pipeline_workers.random_schedules, nproc, count, 1234 + nproc,
                    options=CommOptions(timeout=20, transport="torch.distributed"),
                    timeout=220)  # fmt: skip
    counts = results[0]["counts"]
    assert all(out["counts"] == counts for out in results), results
    assert counts["ran"] + counts["refused"] == count
    assert counts["ran"] >= count // 4 and counts["refused"] >= 1, counts  # both kinds met
    assert max(out["worst"] for out in results) <= 1e-5, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_boundary_sliced_over_tp_trains_like_one_process(schedule):
    results = spawn(pipeline_workers.sliced_boundary_vs_one_process, Mesh(pp=2, tp=2), schedule,
                    options=CommOptions(timeout=30), timeout=100)  # fmt: skip
    for global_rank, out in enumerate(results):
        assert out["grads"] <= 1e-5, (global_rank, out)
        assert out["sent"] == ([(8,)] if global_rank % 2 == 0 else [(7,)]), out  # 15 = 8 + 7
    assert all(results[r]["loss"] <= 1e-5 for r in (2, 3)), results
