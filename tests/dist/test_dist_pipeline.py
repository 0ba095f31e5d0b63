"""coconet.pipeline.Pipeline on 2 and 4 ranks, its stage messages over shared memory (the ranks
share a host) and over gloo (``CommOptions(transport="torch.distributed")``): GPipe and 1F1B (and
fewer micro-batches than stages) train like one process on both, each spawned group checking
every case on both transports (per-stage gradients and losses to 1e-5 relative in float32: the
micro-batches' sums re-associate the batch's), and on 4 ranks that pretend to be 2 hosts, with
shared memory inside each host and gloo between them; a rank killed mid-schedule fails the
others within the timeout on both, their parameters untouched, and a rank whose stage raises
fails its shared-memory peer at once; 200 random schedules on 2-4 ranks (every other one over
shared memory) are each refused before they run or run correctly, none hangs."""

from __future__ import annotations

import pytest
from support import pipeline_workers

from coconet import Mesh
from coconet.runtime import CommOptions, RankFailure, spawn

SHM, GLOO = pipeline_workers.SHM, pipeline_workers.GLOO
OPTIONS = CommOptions(timeout=30)  # one host: shared memory (the workers add a gloo variant)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("nproc", "cases"),
    [(2, [("gpipe", 4), ("1f1b", 4), ("1f1b", 1)]),
     (4, [("gpipe", 8), ("1f1b", 8), ("1f1b", 2)])],  # 1f1b m=2 on 4: fewer micro-batches
)  # fmt: skip
def test_pipeline_trains_like_one_process(nproc, cases):
    results = spawn(pipeline_workers.train_cases, nproc, cases, nproc == 4, options=OPTIONS,
                    timeout=220)  # fmt: skip
    for rank, by_case in enumerate(results):
        assert len(by_case) == 2 * len(cases) + (nproc == 4)
        for case, out in by_case.items():
            bad = {k: v for k, v in out["errors"].items() if not v <= 1e-5}
            assert bad == {}, f"rank {rank}, {case}: {bad}"
            if case.startswith(("shared memory", "torch.distributed")):
                want = case.split(" ")[0] if case.startswith(GLOO) else SHM
                assert set(out["links"].values()) == {want}, (rank, case, out["links"])
    for case, out in results[-1].items():
        assert len(out["losses"]) == 3, case
    if nproc == 4:
        # hosts {0, 1} and {2, 3}: each host's boundary over shared memory, the one between
        # the hosts over gloo, both directions
        links = {}
        for by_case in results:
            links.update(by_case["pretend hosts 1f1b m=4"]["links"])  # this rank's channels
        assert links == {"0->1": SHM, "1->0": SHM, "1->2": GLOO, "2->1": GLOO, "2->3": SHM,
                         "3->2": SHM}, links  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("transport", "how"), [(SHM, "kill"), (GLOO, "kill"), (SHM, "raise")])
def test_a_rank_killed_mid_schedule(transport, how):
    options = CommOptions(timeout=30, transport="auto" if transport == SHM else GLOO)
    results = spawn(pipeline_workers.killed_mid_schedule, 2, 1, how, options=options,
                    timeout=100, failures="return")  # fmt: skip
    survivor, victim = results
    if how == "kill":
        assert isinstance(victim, RankFailure)
    else:
        assert victim == {"status": "raised"}
    assert survivor["status"] == "fault", survivor
    assert survivor["links"] == [transport]
    if transport == GLOO:
        # the communicator's fault guard: "a peer rank died: its connection closed" where gloo
        # saw the connection close, "... a peer rank stalled or died" at the timeout
        message = survivor["message"]
        assert "a peer rank died" in message or "stalled or died" in message, message
        assert survivor["seconds"] < 40
    else:  # its life and its abort word are watched: at once, not at the timeout
        cause = "the peer rank died" if how == "kill" else "the peer rank aborted its step"
        assert cause in survivor["message"], survivor["message"]
        assert survivor["seconds"] < 1.5, survivor
    assert survivor["unchanged"]
    assert "unusable after an earlier failure" in survivor["again"], survivor["again"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("nproc", "count"), [(2, 80), (3, 60), (4, 60)])
def test_random_schedules_are_refused_or_run_on_ranks(nproc, count):
    # 200 in all. The same seed on every rank: the same pipelines, refused alike by `check`.
    results = spawn(pipeline_workers.random_schedules, nproc, count, 1234 + nproc,
                    options=CommOptions(timeout=20), timeout=220)  # fmt: skip
    counts = results[0]["counts"]
    assert all(out["counts"] == counts for out in results), results
    assert counts["ran"] + counts["refused"] == count
    assert counts["ran"] >= count // 4 and counts["refused"] >= 1, counts  # both kinds met
    assert min(results[0]["ran_on"].values()) >= count // 10, results[0]["ran_on"]
    assert max(out["worst"] for out in results) <= 1e-5, results


@pytest.mark.timeout(120)
def test_a_boundary_sliced_over_tp_trains_like_one_process():
    results = spawn(pipeline_workers.sliced_boundaries, Mesh(pp=2, tp=2), ["1f1b", "gpipe"],
                    options=CommOptions(timeout=30), timeout=100)  # fmt: skip
    for global_rank, by_case in enumerate(results):
        assert len(by_case) == 6
        for case, out in by_case.items():
            assert out["grads"] <= 1e-5, (global_rank, case, out)
            transport = case.removeprefix("fused ")
            assert out["links"] == [GLOO if transport.startswith(GLOO) else SHM], (case, out)
            if case.startswith("fused"):
                # the fused boundary sends each tp rank's part of the 3 rows as it is: 2 and 1
                assert out["sent"] == ([(2, 6)] if global_rank % 2 == 0 else [(1, 6)]), out
            else:
                assert out["sent"] == ([(8,)] if global_rank % 2 == 0 else [(7,)]), out  # 8+7
    for case in results[2]:
        assert all(results[r][case]["loss"] <= 1e-5 for r in (2, 3)), results
