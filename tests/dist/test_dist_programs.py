"""Every op and layout, run on 2 ranks, equals the simulator: on torch.distributed (gloo) under
every collective algorithm, and on shared memory.

One spawned group runs every case (spawning costs ~2.3 s); the tests below read its rows.

Tolerances: with the "exact" algorithms (reductions by all_to_all, in rank order) and with 2 ranks
(a sum of two values has one order) everything is bitwise equal. The "native" and "all_reduce"
forms reduce in gloo's order: with more ranks they may differ from the simulator by rounding, so
they are checked to 1e-6 relative here and exactly on 2 ranks.
"""

from __future__ import annotations

import pytest
from support import dist_programs, dist_workers

from coconet.runtime import CommOptions, spawn

POLICIES = [
    "exact",
    "native",
    {
        "all_reduce": "native",
        "reduce_scatter": "all_reduce",
        "all_gather": "all_reduce",
        "reduce": "native",
    },
]
SIZES = (5, 8)  # 5: uneven over 2 ranks


@pytest.fixture(scope="module")
def rows():
    """torch.distributed (gloo) under every algorithm policy, then shared memory."""
    gloo = CommOptions(timeout=30, transport="torch.distributed")
    results = spawn(dist_workers.run_programs, 2, SIZES, POLICIES, options=gloo, timeout=150)
    shm = CommOptions(timeout=30, transport="shared memory")
    shared = spawn(dist_workers.run_programs, 2, SIZES, ["exact"], options=shm, timeout=150)
    return {"torch.distributed": results[0], "shared memory": shared[0]}


CASES = [("torch.distributed", str(p)) for p in POLICIES] + [("shared memory", "exact")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("transport", "policy"), CASES)
@pytest.mark.parametrize("program", sorted(dist_programs.PROGRAMS))
def test_program_equals_simulator(rows, program, transport, policy):
    mine = [r for r in rows[transport] if r["program"] == program and r["policy"] == policy]
    assert len(mine) == len(SIZES) * (2 if program == "collectives" else 1)
    for r in mine:
        assert r["status"] == "ok", r["status"]
        assert r["abs"] == 0.0, (r["size"], r["dtype"], r["errors"])
