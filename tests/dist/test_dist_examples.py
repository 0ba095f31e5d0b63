"""Every example x every named schedule, run on local ranks (over shared memory, the default
transport on one host; gloo for the native-algorithm rows), equals the simulator's unscheduled
program.

- 2 ranks: the optimizers and the tensor-parallel layer, even and uneven sizes (12, 7), in
  float32, bfloat16 and float16;
- 3 ranks (on 2 cores): the optimizers and the layer in float32, uneven slices everywhere;
- 4 ranks: the same in float32, then the pipeline example on a 2x2 mesh (pp x tp sub-groups) and
  a program using every mesh axis.

Tolerances (``tests/support/tolerances.py``): with the "exact" collective algorithms every
reduction runs in the simulator's rank order, so results are bitwise equal unless
``coconet.sim.exactness`` finds a sum the schedule re-associates: LAMB's reorder computes the
norm as the all_reduce of per-slice sums of squares, and ``ol_MM_fuse_RS_C_AG`` runs the matmul
chunk by chunk (BLAS blocks a chunk of rows differently from the whole product on some CPUs).
Those are checked to 1e-5 relative in float32 and 1e-2 in 16-bit floats. With gloo's native
algorithms on 4 ranks, reductions run in gloo's order: 1e-6 relative.
"""

from __future__ import annotations

import pytest
from support import dist_workers
from support.tolerances import NATIVE_GLOO_RTOL, schedule_rtol

from coconet.runtime import CommOptions, spawn

SIZES = (12, 7)
DTYPES = ("float32", "bfloat16", "float16")


def _cases(names):
    out = []
    for name in names:
        mod = dist_workers.load_example(name)
        for schedule in ("(none)", *getattr(mod, "SCHEDULES", {})):
            out.append((name, schedule))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    names = dist_workers.OPTIMIZERS + dist_workers.LAYERS
    return spawn(
        dist_workers.run_examples,
        2,
        names,
        SIZES,
        list(DTYPES),
        options=CommOptions(timeout=60),
        timeout=200,
    )[0]


@pytest.fixture(scope="module")
def three_ranks():
    """3 ranks on 2 cores, over shared memory: every example x schedule in float32 (uneven
    slices everywhere: 12 and 7 rows over 3 ranks)."""
    names = dist_workers.OPTIMIZERS + dist_workers.LAYERS
    return spawn(
        dist_workers.run_examples,
        3,
        names,
        SIZES,
        ["float32"],
        options=CommOptions(timeout=60),
        timeout=250,
    )[0]


@pytest.fixture(scope="module")
def four_ranks():
    return spawn(
        dist_workers.run_world_and_mesh,
        4,
        SIZES,
        {"pp": 2, "tp": 2},
        options=CommOptions(timeout=60),
        timeout=250,
    )[0]


def _rtol(name: str, schedule: str, dtype: str) -> float:
    """What ``schedule`` of example ``name`` may differ from its program by (0.0: bitwise)."""
    if schedule == "(none)":
        return 0.0
    mod = dist_workers.load_example(name)
    program = mod.program()
    return schedule_rtol(program, mod.SCHEDULES[schedule](program).program, dtype)


def _assert_rows(rows, name, schedule, *, rtol_exact=0.0):
    mine = [r for r in rows if r["example"] == name and r["schedule"] == schedule]
    assert mine, f"no results for {name} / {schedule}"
    for r in mine:
        assert r["status"] == "ok", r["status"]
        assert r["rel"] <= max(rtol_exact, _rtol(name, schedule, r["dtype"])), r


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("name", "schedule"), _cases(dist_workers.OPTIMIZERS + dist_workers.LAYERS)
)
def test_two_ranks(two_ranks, name, schedule):
    _assert_rows(two_ranks, name, schedule)
    dtypes = {r["dtype"] for r in two_ranks if r["example"] == name}
    assert dtypes == set(DTYPES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "schedule"), _cases(dist_workers.OPTIMIZERS + dist_workers.LAYERS)
)
def test_three_ranks(three_ranks, name, schedule):
    _assert_rows(three_ranks, name, schedule)
    assert {r["world"] for r in three_ranks} == {"Mesh(world=3)"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "schedule"), _cases(dist_workers.OPTIMIZERS + dist_workers.LAYERS)
)
def test_four_ranks(four_ranks, name, schedule):
    _assert_rows(four_ranks["world"], name, schedule)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "schedule"), _cases(("adam", "lamb")))
def test_four_ranks_native_algorithms(four_ranks, name, schedule):
    _assert_rows(four_ranks["native"], name, schedule, rtol_exact=NATIVE_GLOO_RTOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "schedule"), _cases(dist_workers.PIPELINES))
def test_pipeline_on_2x2_mesh(four_ranks, name, schedule):
    _assert_rows(four_ranks["mesh"], name, schedule)
    assert {r["world"] for r in four_ranks["mesh"]} == {"Mesh(pp=2, tp=2)"}


@pytest.mark.timeout(300)
def test_mesh_axes_program(four_ranks):
    """mesh_program and its gradient program (reverse sends, axis_index) on a 2x2 mesh."""
    assert {r["example"] for r in four_ranks["mesh_program"]} == {"mesh_program",
                                                                  "mesh_program_grad"}
    for r in four_ranks["mesh_program"]:
        assert r["status"] == "ok", r["status"]
        assert r["abs"] == 0.0, r
