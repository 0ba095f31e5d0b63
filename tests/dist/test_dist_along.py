"""``Communicator.along(axis)``: the communicator of one group of a larger mesh. Its steps agree,
vote and wait with that group alone, so the groups of a pp x tp mesh run their own programs at
their own pace (what pipeline stages with tensor-parallel layers need), checked against the
simulator; a dead member fails its own group within the timeout and leaves the others alone."""

from __future__ import annotations

import pytest
from support import along_workers

from coconet import Mesh
from coconet.runtime import CommOptions, RankFailure, spawn


@pytest.mark.timeout(200)
def test_each_group_runs_its_own_steps():
    results = spawn(along_workers.groups_run_their_own_steps, Mesh(pp=2, tp=2),
                    options=CommOptions(timeout=30), timeout=180)  # fmt: skip
    for global_rank, out in enumerate(results):
        pp, tp = divmod(global_rank, 2)
        assert out["world"] == 2 and out["rank"] == tp and out["cached"], out
        assert out["members"] == [2 * pp, 2 * pp + 1], out
        assert out["pp members"] == [tp, tp + 2], out
        assert f"the job's ranks {out['members']}" in out["repr"], out
        assert max(out["errors"]) <= 1e-5, out
        assert "no axis 'dp'" in out["bad axis"], out


@pytest.mark.timeout(120)
def test_a_dead_member_fails_its_group_only():
    results = spawn(along_workers.a_group_member_dies, Mesh(pp=2, tp=2), 1,
                    options=CommOptions(timeout=5), timeout=100, failures="return")  # fmt: skip
    victim, peer, other_a, other_b = results[1], results[0], results[2], results[3]
    assert isinstance(victim, RankFailure) and victim.exit_code == -9
    assert peer["status"].startswith("RuntimeFault"), peer
    assert peer["seconds"] < 15, peer
    for out, expect in ((other_a, 2 + 3), (other_b, 2 + 3)):
        assert out["status"] == "no error" and out["value"] == expect, out
