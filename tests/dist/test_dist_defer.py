"""The deferred collective (``coconet.schedule.defer``) on real ranks: Overlap Local-SGD's sync
as a coconet program, its average started at the end of one call and landed at the next,
against the simulator call by call (bitwise on 2 ranks, where a sum of two terms has one order;
to float rounding on 3), on both transports and with the average split into a reduce_scatter
in the step and a deferred all_gather; the program in a training loop against the plain-torch
Overlap Local-SGD of ``local_sgd_workers.reference``; and a rank that dies with the average in
flight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import defer_workers as w
from support import local_sgd_workers as lsw

from coconet.runtime import CommOptions, RankFailure, spawn

CALLS = 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc, transport, split", [
    (2, "shared memory", False),
    (2, "torch.distributed", False),
    (2, "shared memory", True),
    (3, "torch.distributed", True),
])  # fmt: skip
def test_each_call_is_the_simulators(nproc, transport, split):
    results = spawn(w.run, nproc, CALLS, 2, split,
                    options=CommOptions(timeout=40, transport=transport), timeout=110)
    want = w.simulated(nproc, CALLS)

    def same(a, b):
        if nproc == 2:
            return np.array_equal(a, b)
        return np.allclose(a, b, rtol=1e-6, atol=1e-7)

    for rank, got in enumerate(results):
        assert got["in_flight"] == [True] * CALLS
        for call, (row, ref) in enumerate(zip(got["rows"], want, strict=True)):
            assert same(row["x"], ref["x"][rank]), (rank, call)
            for k in ("z", "v"):
                assert same(row[k], ref[k]), (rank, call, k)
            assert (row["a"] is not None) == (call in (2, CALLS - 1))
            if row["a"] is not None:
                assert same(row["a"], ref["a"]), (rank, call)
    assert "def land(" in results[0]["source"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shared memory", "torch.distributed"])
def test_overlap_local_sgd_as_a_program_follows_plain_torch(transport):
    """Not bitwise: torch.lerp's two formulas and the anchor's ``z + (a - z)`` round
    differently from the reference's ``lerp`` and ``z = a``."""
    algo = {"name": "overlap", "inner": "sgd", "period": 3, "pull": 0.5, "momentum": 0.5}
    results = spawn(w.train, 2, algo, 10, options=CommOptions(timeout=40, transport=transport),
                    timeout=110)  # fmt: skip
    ref = lsw.reference(2, algo, 10, make=w.model32)
    for rank, got in enumerate(results):
        assert got["in_flight"]  # the last sync's average still travelling
        for mine, want in zip(got["params"], ref["params"][rank], strict=True):
            for a, b in zip(mine, want, strict=True):
                torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-5, atol=1e-6)
    # the models moved apart between syncs
    assert not np.array_equal(results[0]["params"][4][0], results[1]["params"][4][0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shared memory", "torch.distributed"])
def test_a_rank_dead_with_the_average_in_flight_fails_the_other(transport):
    options = CommOptions(timeout=15, transport=transport)
    survivor, victim = spawn(w.dies_in_flight, 2, 1, options=options, timeout=100,
                             failures="return")  # fmt: skip
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert survivor["status"] == "fault", survivor
    assert survivor["seconds"] < 15, survivor
    assert survivor["intact"], survivor  # x as the local steps left it, z and v as committed
    assert not survivor["left"], survivor  # dropped, not waited for again
