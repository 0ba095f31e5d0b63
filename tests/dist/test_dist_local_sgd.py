"""Local SGD and Overlap Local-SGD (issue 49) against their meaning in plain torch
(``local_sgd_workers.reference``: every rank's model on one process, averages summed in rank
order): on 2 ranks bitwise (a sum of two terms is the same in either order), on 3 and 4 to
float rounding (the transports' sums are in their own order); checkpoints that resume exactly;
a rank that dies with an average in flight; what is refused."""

from __future__ import annotations

import pytest
import torch
from support import local_sgd_workers as w

from coconet.runtime import CommOptions, RankFailure, spawn

OVERLAP = {"name": "overlap", "inner": "sgd", "period": 3, "pull": 0.5, "momentum": 0.0}
STEPS = 10


def _compare(results: list[dict], ref: dict, exact: bool) -> None:
    for rank, got in enumerate(results):
        for step, (mine, want) in enumerate(zip(got["params"], ref["params"][rank], strict=True)):
            for a, b in zip(mine, want, strict=True):
                a = torch.from_numpy(a)
                if exact:
                    assert torch.equal(a, b), (rank, step, (a - b).abs().max())
                else:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if exact:
            assert got["losses"] == ref["losses"][rank], rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc, transport, algo", [
    (2, "shared memory", OVERLAP),
    (2, "torch.distributed", {**OVERLAP, "momentum": 0.5, "inner": "adamw"}),
    (3, "shared memory", {**OVERLAP, "pull": 0.3}),
    (4, "torch.distributed", OVERLAP),
    (2, "shared memory", {"name": "local", "inner": "adamw", "period": 4, "warmup": 2}),
    (3, "torch.distributed", {"name": "local", "inner": "sgd", "period": 3}),
    (4, "shared memory", {"name": "local", "inner": "sgd", "period": 4, "host_period": 2}),
])  # fmt: skip
def test_each_rank_follows_the_plain_torch_algorithm(nproc, transport, algo):
    """Every rank's parameters after every step, and its losses; the run checkpointed after
    step 4 and resumed by a second model ends with the same bits."""
    results = spawn(w.train, nproc, algo, STEPS, 4,
                    options=CommOptions(timeout=60, transport=transport), timeout=220)
    ref = w.reference(nproc, algo, STEPS)  # one host: host averages are the world's
    _compare(results, ref, exact=nproc == 2)
    for got in results:
        for a, b in zip(got["resumed"], got["params"][-1], strict=True):
            assert (a == b).all()
    # the models did move apart between averages and back together at them
    period = algo["period"]
    last = [r["params"][-1][0] for r in results]
    if algo["name"] == "local" and STEPS % period == (algo.get("warmup", 0) % period):
        assert all((last[0] == x).all() for x in last)
    first_local = [r["params"][0][0] for r in results]
    if algo["name"] == "overlap" or not algo.get("warmup"):
        assert not (first_local[0] == first_local[1]).all()
    assert "the average travels" in results[0]["explain"], results[0]["explain"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shared memory", "torch.distributed"])
def test_a_rank_dead_with_an_average_in_flight_fails_the_others(transport):
    options = CommOptions(timeout=20, transport=transport)
    survivor, victim = spawn(w.dies_in_flight, 2, 1, options=options, timeout=100,
                             failures="return")  # fmt: skip
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert survivor["status"] == "fault", survivor
    assert survivor["seconds"] < 20, survivor
    assert survivor["intact"], survivor  # the local step's model, untouched by the failed sync
    assert survivor["steps"] in (4, 6), survivor  # a sync (dies_in_flight says which)


@pytest.mark.timeout(120)
def test_what_is_refused():
    out = spawn(w.refusals, 2, options=CommOptions(timeout=60), timeout=100)[0]
    assert "period=0" in out["period"], out
    assert "pull=1.5" in out["pull"], out
    assert "momentum=1.0" in out["momentum"], out
    assert "wraps a torch.optim.Optimizer" in out["not an optimizer"], out
    assert "its steps are not local" in out["averaging inner"], out
    assert "'LocalSGD'" in out["wrong kind"], out
